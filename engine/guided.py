"""Constrained decoding inside a runner: one grammar matcher per constrained request, the
token masks of a step's constrained rows, and advancing the matchers by what was sampled.

A matcher's state is a function of the request's output tokens alone: before each
constrained row is masked, its matcher is advanced by whatever output tokens it has not
consumed yet. So every way a request reaches a runner gives the state a single process
would have: a decode worker's request arrives with the first token the prefill worker
sampled under the same constraint; a request moved between decode workers carries its
earlier outputs at the end of its prompt (``SamplingParams.output_offset``); a preempted
request keeps its outputs. A matcher that cannot take a token (a peer that sampled without
the constraint) leaves its request only the EOS tokens, so that request ends and no other
is touched.

Overlap: after a step samples, the matchers consume its tokens and the next masks are
filled on a side thread (llguidance drops the GIL) while the next forward runs on the
compute thread; the next step's sampling takes them when the matcher has not moved since,
and fills the rest itself. The masks apply to the constrained rows only.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import llguidance
import torch

from engine.compute_thread import serial_torch_here
from engine.grammar import GrammarCompiler
from engine.request import Request

logger = logging.getLogger(__name__)


def _fill_masks(
    executor: llguidance.LLExecutor,
    matchers: list[tuple[llguidance.LLMatcher, int]],
    bitmask: torch.Tensor,
) -> None:
    """Each (matcher, row): the matcher's next-token bitmask written into that row of
    ``bitmask`` (int32 [rows, words], contiguous, CPU), in parallel without the GIL.

    What ``llguidance.torch.fill_next_token_bitmask_par`` does; that module is not
    imported because it compiles a ``torch.compile`` kernel at import, which loads
    dynamo and inductor: seconds of every worker's start, guided or not."""
    assert bitmask.dtype == torch.int32 and bitmask.dim() == 2 and bitmask.is_contiguous()
    assert bitmask.device.type == "cpu"
    rows, words = bitmask.shape
    executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, rows)


@dataclass(slots=True)
class GrammarMasks:
    """Which rows of a step's logits are constrained, and the tokens each may take."""

    rows: list[int]  # indices into the step's sampling rows
    allowed: torch.Tensor  # bool [len(rows), vocab] on the logits' device


@dataclass(slots=True)
class GuidedRow:
    """One constrained row of a step: its index, request and output tokens so far."""

    row: int
    request: Request
    output_token_ids: list[int]


@dataclass(slots=True)
class _Track:
    request: Request
    matcher: llguidance.LLMatcher | None  # None: the constraint did not compile here
    consumed: int = 0  # output tokens the matcher has taken
    failed: bool = False


class GuidedDecoding:
    """Matchers of one runner. Called on the compute thread only (``masks``, ``accept``,
    ``close``); the side thread touches a matcher only between ``accept`` and the next
    ``masks``, which waits for it first."""

    def __init__(
        self,
        compiler: Callable[[], GrammarCompiler],
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device: torch.device,
    ) -> None:
        self._compiler_factory = compiler
        self._compiler: GrammarCompiler | None = None
        self.vocab_size = vocab_size
        self.device = device
        self._eos = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self._tracks: dict[str, _Track] = {}
        self._side = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="grammar", initializer=serial_torch_here
        )
        self._executor: llguidance.LLExecutor | None = None
        # The side thread's masks for the next step: request id -> (consumed, bitmask row).
        self._ahead: concurrent.futures.Future[dict[str, tuple[int, torch.Tensor]]] | None = None
        self.num_masked_rows = 0
        self.num_masks_ahead = 0

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = self._compiler_factory()
            self._executor = llguidance.LLExecutor(num_threads=1)
        return self._compiler

    def masks(self, rows: list[GuidedRow]) -> GrammarMasks | None:
        """The allowed tokens of each constrained row (None when there are none)."""
        ahead = self._take_ahead()
        self._forget_finished()
        if not rows:
            return None
        compiler = self.compiler
        words = (compiler.vocab_size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        todo: list[tuple[llguidance.LLMatcher, int]] = []
        for j, r in enumerate(rows):
            track = self._sync(r)
            if track.failed or track.matcher is None:
                bitmask[j] = 0
                continue
            ready = ahead.get(r.request.request_id)
            if ready is not None and ready[0] == track.consumed:
                bitmask[j] = ready[1]
                self.num_masks_ahead += 1
            else:
                todo.append((track.matcher, j))
        if todo:
            assert self._executor is not None
            _fill_masks(self._executor, todo, bitmask)
        allowed = _unpack(bitmask, self.vocab_size)
        for j, r in enumerate(rows):
            if self._tracks[r.request.request_id].failed:
                allowed[j, self._eos] = True
        self.num_masked_rows += len(rows)
        return GrammarMasks(rows=[r.row for r in rows], allowed=allowed.to(self.device))

    def accept(self, sampled: list[tuple[str, int]]) -> None:
        """The constrained rows' sampled tokens, (request id, token): each matcher takes
        its token now, and the side thread starts on the masks of their next step."""
        moved: list[tuple[str, _Track]] = []
        for rid, token in sampled:
            track = self._tracks.get(rid)
            if track is None or track.failed or track.matcher is None:
                continue
            if track.matcher.is_stopped():
                track.consumed += 1  # the EOS that ends a complete output
                continue
            if not track.matcher.consume_token(token):
                self._fail(rid, track, token)
                continue
            track.consumed += 1
            moved.append((rid, track))
        if moved:
            self._ahead = self._side.submit(self._fill_ahead, moved)

    def close(self) -> None:
        self._take_ahead()
        self._side.shutdown(wait=True)
        self._tracks.clear()

    def _take_ahead(self) -> dict[str, tuple[int, torch.Tensor]]:
        if self._ahead is None:
            return {}
        ahead, self._ahead = self._ahead, None
        return ahead.result()

    def _fill_ahead(self, moved: list[tuple[str, _Track]]) -> dict[str, tuple[int, torch.Tensor]]:
        """On the side thread: the next masks of the matchers that just moved."""
        assert self._executor is not None and self._compiler is not None
        words = (self._compiler.vocab_size + 31) // 32
        bitmask = torch.full((len(moved), words), -1, dtype=torch.int32)
        matchers = [(t.matcher, j) for j, (_, t) in enumerate(moved) if t.matcher is not None]
        _fill_masks(self._executor, matchers, bitmask)
        return {rid: (t.consumed, bitmask[j]) for j, (rid, t) in enumerate(moved)}

    def _sync(self, r: GuidedRow) -> _Track:
        """The request's matcher, advanced by every output token it has not taken."""
        req = r.request
        rid = req.request_id
        out = r.output_token_ids
        track = self._tracks.get(rid)
        if track is None or track.request is not req or track.consumed > len(out):
            constraint = req.params.constraint
            assert constraint is not None
            try:
                track = _Track(req, self.compiler.matcher(constraint))
            except ValueError as exc:  # admission checked it; this tokenizer still refused
                logger.warning("request %s: %s; it may only end now", rid, exc)
                track = _Track(req, None, failed=True)
            self._tracks[rid] = track
        if track.failed or track.consumed == len(out):
            return track
        assert track.matcher is not None
        new = out[track.consumed :]
        if track.matcher.is_stopped():
            track.consumed = len(out)
        elif not track.matcher.consume_tokens(new):
            self._fail(rid, track, None)
        else:
            track.consumed = len(out)
        return track

    def _fail(self, rid: str, track: _Track, token: int | None) -> None:
        track.failed = True
        assert track.matcher is not None
        error = track.matcher.get_error()
        logger.warning(
            "request %s: its output left its constraint (token %s): %s; it may only end now",
            rid,
            token,
            error.splitlines()[0] if error else "",
        )

    def _forget_finished(self) -> None:
        done = [rid for rid, t in self._tracks.items() if t.request.is_finished]
        for rid in done:
            del self._tracks[rid]


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [n, words] bit-packed masks -> bool [n, vocab_size] (tokens past the
    tokenizer's vocabulary are never allowed)."""
    n, words = bitmask.shape
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().reshape(n, words * 32)
    if words * 32 >= vocab_size:
        return allowed[:, :vocab_size].contiguous()
    pad = torch.zeros((n, vocab_size - words * 32), dtype=torch.bool)
    return torch.cat([allowed, pad], dim=1)
