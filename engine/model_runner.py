"""Turns a scheduler decision into one forward pass and sampled tokens.

Owns the model weights, the KV pool tensor, the previous step's sampled ids and the
compute thread that loads and runs the model (``engine.compute_thread``). Seeded sampling
keeps no per-request state: each output position gets its own generator
(``engine.sampler.position_generator``). A step is two calls: ``prepare`` builds its input
tensors from the ``SchedulerOutput`` alone (any thread, even while the previous step
computes), and ``run`` fills in the tokens that were still pending when the step was
scheduled from the previous step's samples, runs the forward and samples, on the compute
thread (``submit_run`` queues it there and returns a future). Steps run in the order
they are queued. ``execute`` is the two in a row. ``timeline`` (engine.timeline; set by
the ``AsyncEngine`` that drives the runner, OFF otherwise) gets each step's prepare,
forward and sample spans. Constrained requests (``SamplingParams.constraint``) are
masked by ``engine.guided``, whose matchers live here beside the sampler.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.compute_thread import ComputeThread
from engine.config import EngineConfig, ModelConfig
from engine.core_lending import CoreLending, Team, parse_seat
from engine.cpu_budget import pin_process
from engine.device import build_on, resolve_device
from engine.forward_context import AttentionMetadata, ForwardContext, PrefillSeq, forward_context
from engine.grammar import GrammarCompiler
from engine.guided import GuidedDecoding, GuidedRow
from engine.huge_pages import zeros_on_huge_pages
from engine.kernels.cpu import cpu_kernels
from engine.kernels.route_bench import RouteRequest, known_routes, measure_routes
from engine.kernels.route_cache import cpu_identity
from engine.kernels.route_table import (
    PANELS,
    RouteTable,
    deterministic_route,
    deterministic_table,
)
from engine.kv_layout import KVLayout
from engine.layers.attention import DETERMINISTIC_SPLIT
from engine.models.llama import LlamaForCausalLM
from engine.prompt_logprobs import PromptRows, fill_prompt_logprobs, prompt_logprob_rows
from engine.sampler import Sampler, SamplingRow, position_generator
from engine.scheduler import PENDING_TOKEN, SampledToken, ScheduledSeq, SchedulerOutput
from engine.timeline import OFF, RUNNER, TimelineRecorder
from engine.weights import iter_safetensors

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class PreparedStep:
    """A step's input tensors, ready for ``ModelRunner.run`` but for its pending tokens."""

    sched: SchedulerOutput
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # flat row of the last token of each sampling seq
    sample_seq_idx: list[int]  # index into sched.seqs of each sampling row
    # Flat rows whose token the previous step samples, and whose request it is.
    pending_rows: list[int]
    pending_ids: list[str]
    # engine.prompt_logprobs.prompt_logprob_rows of the step.
    prompt_lp: list[PromptRows] = dataclasses.field(default_factory=list)


class ModelRunner:
    timeline: TimelineRecorder = OFF

    def __init__(
        self,
        cfg: EngineConfig,
        model_cfg: ModelConfig,
        checkpoint: Path,
        *,
        num_blocks: int,
        kv_pool: torch.Tensor | None = None,
        show_progress: bool = True,
    ):
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.device = resolve_device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        self.block_size = cfg.block_size
        self.layout = KVLayout(
            num_layers=model_cfg.num_layers,
            block_size=cfg.block_size,
            num_kv_heads=model_cfg.num_kv_heads,
            head_dim=model_cfg.head_dim,
            dtype=cfg.dtype,
            deterministic=cfg.deterministic,
        )
        shape = self.layout.pool_shape(num_blocks)
        if kv_pool is not None and (
            tuple(kv_pool.shape) != shape
            or kv_pool.dtype != self.dtype
            or kv_pool.device != self.device
        ):
            raise ValueError(
                f"kv_pool has shape {tuple(kv_pool.shape)} {kv_pool.dtype} on {kv_pool.device}; "
                f"expected {shape} {self.dtype} on {self.device}"
            )
        self.compute = ComputeThread(cfg.num_threads)
        # Cores borrowed from, and lent to, workers on the same host (engine.core_lending).
        self.lending: CoreLending | None = None
        if cfg.core_seat and self.device.type == "cpu":
            directory, cpus, seat = parse_seat(Path(cfg.core_seat))
            home = Team(cpus, self.compute.num_threads())
            self.lending = CoreLending(
                directory, cpus, home.threads, seat=seat, borrow=not cfg.deterministic
            )
            # The mask and team now in force (they change only when a share does).
            self._mask, self._threads = home.cpus, home.threads
            self._mask_lock = threading.Lock()
        # The kernel of each linear row class (CPU; chosen while loading), None elsewhere.
        self.kernel_routes: RouteTable | None = None
        try:
            self.model, self.kv_cache, self.sampler = self.compute.call(
                self._load, checkpoint, shape, kv_pool, show_progress
            )
        except BaseException:
            self.compute.shutdown()
            raise
        self._last_sampled: dict[str, int] = {}
        self.guided = GuidedDecoding(
            functools.partial(_grammar_compiler, checkpoint, model_cfg.eos_token_ids),
            model_cfg.vocab_size,
            model_cfg.eos_token_ids,
            self.device,
        )
        # Wall seconds inside the model forward (and logits): the busy fraction's numerator,
        # the same whichever loop drives the runner.
        self.busy_seconds = 0.0
        # And around it: building the input tensors, sampling.
        self.prepare_seconds = 0.0
        self.sample_seconds = 0.0
        self.num_steps = 0

    def _load(
        self,
        checkpoint: Path,
        shape: tuple[int, ...],
        kv_pool: torch.Tensor | None,
        show_progress: bool,
    ) -> tuple[LlamaForCausalLM, torch.Tensor, Sampler]:
        """Model, KV pool and sampler, built on the compute thread."""
        torch.manual_seed(self.cfg.seed)
        with build_on(self.device, self.dtype, random_init=False):
            model = LlamaForCausalLM(self.model_cfg)
        model.load_weights(iter_safetensors(checkpoint, show_progress=show_progress))
        # Parameters already are in dtype; this casts the fp32 rope tables, as HF does.
        model = model.to(self.dtype).eval()
        model.linear_panels = self.cfg.linear_panels
        if self.cfg.deterministic:
            self._make_deterministic(model)
        elif self.device.type == "cpu":
            self._choose_kernel_routes(model)
        else:
            model.prepare_fast_path()
        if kv_pool is None and self.device.type == "cpu":
            kv_pool = zeros_on_huge_pages(shape, self.dtype)
        elif kv_pool is None:
            kv_pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return model, kv_pool, Sampler(self.device, self.cfg.seed)

    def _choose_kernel_routes(self, model: LlamaForCausalLM) -> None:
        """Route each class of linear layer to its kernel (``--cpu-kernels``) and pack
        the weight copies: with a cached or forced table only those it uses; to measure,
        all of them first, then those it leaves unused are freed. Logs the table once."""
        layers, lm_head = model.linear_layers()
        request = RouteRequest(
            mode=self.cfg.cpu_kernels,
            dtype=self.cfg.dtype,
            max_num_seqs=self.cfg.max_num_seqs,
            max_num_batched_tokens=self.cfg.max_num_batched_tokens,
            panels=self.cfg.linear_panels,
        )
        table = known_routes(request, layers, lm_head)
        model.set_kernel_routes(table)
        model.prepare_fast_path()
        if table is None:
            probe = functools.partial(model.prefill_attention_probe, block_size=self.cfg.block_size)
            table = measure_routes(request, layers, lm_head, attention=probe)
            model.set_kernel_routes(table)
            _return_freed_memory()
        self.kernel_routes = table
        logger.info(
            "CPU kernel routes: %s on %s; ONEDNN_MAX_CPU_ISA=%s",
            table.describe(),
            " ".join(cpu_identity()[1]) or "no listed ISA flags",
            os.environ.get("ONEDNN_MAX_CPU_ISA", "unset"),
        )

    def _make_deterministic(self, model: LlamaForCausalLM) -> None:
        """Deterministic mode: every linear layer on the one batch-invariant kernel
        (``route_table.deterministic_route``), the attention's fixed KV split."""
        kernels = cpu_kernels()
        if kernels is None:
            raise ValueError(
                "deterministic mode needs the compiled CPU kernels, which did not build or "
                "load here (see the warning above, or BATON_CPU_KERNELS=0)"
            )
        layers, lm_head = model.linear_layers()
        widths = [lin.weight.shape[1] for layer in layers for lin in layer] + [
            lm_head.weight.shape[1]
        ]
        route = deterministic_route(
            self.cfg.dtype, kernels.bf16_dot, all(k % 32 == 0 for k in widths)
        )
        model.linear_panels = route == PANELS
        table = deterministic_table(route)
        model.set_kernel_routes(table)
        model.prepare_fast_path()
        model.set_deterministic(DETERMINISTIC_SPLIT)
        self.kernel_routes = table
        logger.info(
            "deterministic mode: every linear layer on %s, attention over the KV in parts of "
            "%d tokens", route, DETERMINISTIC_SPLIT,
        )  # fmt: skip

    def close(self) -> None:
        """End the compute thread once queued steps are done. Idempotent."""
        self.compute.shutdown()
        self.guided.close()
        if self.lending is not None:
            self.lending.close()

    def idle(self) -> None:
        """The engine has no work: give back borrowed cores, lend this worker's, and keep
        its threads (gRPC's too) off those it lends. Call it with no forward in flight."""
        if self.lending is None:
            return
        self.lending.idle()
        with self._mask_lock:
            if self._mask != self.lending.home.cpus:
                pin_process(self.lending.home.cpus)
                self._mask = self.lending.home.cpus

    def _settle_team(self) -> None:
        """Before a forward: take this worker's cores back, borrow idle neighbours'."""
        if self.lending is None:
            return
        with self.timeline.span("cores", RUNNER):
            team = self.lending.team()
        with self._mask_lock:
            if team.cpus != self._mask:
                pin_process(team.cpus)
                self._mask = team.cpus
        if team.threads != self._threads:
            torch.set_num_threads(team.threads)  # the compute thread's own setting
            self._threads = team.threads

    # -- the step ---------------------------------------------------------------------

    def execute(self, sched: SchedulerOutput) -> list[SampledToken | None]:
        """Run one step; returns a sampled token for each seq with ``sample=True``.

        Prepares on the compute thread too: nothing overlaps here, and torch ops on the
        caller's thread would give it an OpenMP team of its own (``engine.compute_thread``).
        """
        return self.compute.call(self._prepare_and_run, sched)

    def _prepare_and_run(self, sched: SchedulerOutput) -> list[SampledToken | None]:
        return self._run(self.prepare(sched))

    def run(self, step: PreparedStep) -> list[SampledToken | None]:
        """Forward and sample a prepared step on the compute thread; waits for it."""
        return self.compute.call(self._run, step)

    def submit_run(
        self, step: PreparedStep
    ) -> concurrent.futures.Future[list[SampledToken | None]]:
        """Queue ``run(step)`` on the compute thread behind the steps already queued."""
        return self.compute.submit(self._run, step)

    @torch.inference_mode()
    def prepare(self, sched: SchedulerOutput) -> PreparedStep:
        """The step's input tensors. Reads only ``sched``: safe while a step runs."""
        t0 = time.perf_counter()
        with self.timeline.span("prepare", RUNNER):
            step = self._prepare(sched)
        self.prepare_seconds += time.perf_counter() - t0
        return step

    @torch.inference_mode()
    def _run(self, step: PreparedStep) -> list[SampledToken | None]:
        """Forward and sample; a token per seq with ``sample=True``. On the compute thread."""
        self._fill_pending(step)
        self._settle_team()
        tl = self.timeline
        t0 = time.perf_counter()
        with tl.span("forward", RUNNER, _step_args(step.sched) if tl.enabled else None):
            logits = self._forward(step)
        return self._sample(step.sched, step.sample_seq_idx, logits, t0)

    def _sample(
        self, sched: SchedulerOutput, sample_seq_idx: list[int], logits: torch.Tensor, t0: float
    ) -> list[SampledToken | None]:
        """Sample the step's rows from ``logits`` (its forward began at ``t0``)."""
        t1 = time.perf_counter()
        seqs = sched.seqs
        results: list[SampledToken | None] = [None] * len(seqs)
        last: dict[str, int] = {}
        if sample_seq_idx:
            with self.timeline.span("sample", RUNNER):
                rows = [self._sampling_row(seqs[i]) for i in sample_seq_idx]
                guided = [
                    self._guided_row(j, seqs[i])
                    for j, i in enumerate(sample_seq_idx)
                    if seqs[i].request.params.constraint is not None
                ]
                masks = self.guided.masks(guided)
                sampled = self.sampler(logits, rows, masks)
                if guided:
                    self.guided.accept([(g.request.request_id, sampled[g.row][0]) for g in guided])
            for i, (tok, lp) in zip(sample_seq_idx, sampled, strict=True):
                results[i] = SampledToken(tok, lp)
                last[seqs[i].request.request_id] = tok
        self._last_sampled = last
        self.busy_seconds += t1 - t0
        self.sample_seconds += time.perf_counter() - t1
        self.num_steps += 1
        return results

    def forward_logits(self, sched: SchedulerOutput) -> torch.Tensor:
        """Float32 logits [num sampling seqs, vocab] of a step, without sampling.

        Writes the step's KV like ``execute`` does; used by parity tests.
        """
        return self.compute.call(self._prepared_logits, sched)

    def _prepared_logits(self, sched: SchedulerOutput) -> torch.Tensor:
        return self._forward_logits(self.prepare(sched))

    @torch.inference_mode()
    def _forward_logits(self, step: PreparedStep) -> torch.Tensor:
        self._fill_pending(step)
        return self._forward(step).float()

    def _fill_pending(self, step: PreparedStep) -> None:
        if step.pending_rows:
            last = self._last_sampled
            step.input_ids[step.pending_rows] = torch.tensor(
                [last[rid] for rid in step.pending_ids], dtype=torch.long, device=self.device
            )

    def _forward(self, batch: PreparedStep) -> torch.Tensor:
        with forward_context(ForwardContext(batch.meta, self.kv_cache)):
            hidden = self.model(batch.input_ids, batch.positions)
        fill_prompt_logprobs(self.model.compute_logits, batch.prompt_lp, hidden)
        if not batch.sample_seq_idx:
            return hidden.new_empty((0, self.model_cfg.vocab_size), dtype=torch.float32)
        # In the model's dtype: the sampler widens them only for a row that needs more
        # than their argmax.
        return self.model.compute_logits(hidden[batch.sample_rows])

    def _sampling_row(self, seq: ScheduledSeq) -> SamplingRow:
        req = seq.request
        params = req.params
        end = seq.start + seq.num_new
        gen = None
        # A moved request's prompt ends with its earlier outputs (``output_offset``):
        # positions and output-only penalties count from where its output really began.
        num_prompt = req.num_prompt_tokens - params.output_offset
        if params.seed is not None and not params.greedy:
            gen = position_generator(self.device, params.seed, end - num_prompt)
        token_ids = None
        if params.has_penalties:
            token_ids = req.all_token_ids[:end]
            if len(token_ids) < end:
                token_ids = token_ids + [self._last_sampled[req.request_id]]
        return SamplingRow(
            params=params,
            num_outputs=end - req.num_prompt_tokens,
            eos_token_ids=req.eos_token_ids,
            generator=gen,
            token_ids=token_ids,
            num_prompt_tokens=num_prompt,
        )

    def _guided_row(self, row: int, seq: ScheduledSeq) -> GuidedRow:
        """A constrained row: its output tokens so far, counted from where its output
        really began (a moved request's prompt ends with its earlier outputs)."""
        req = seq.request
        end = seq.start + seq.num_new
        out_start = req.num_prompt_tokens - req.params.output_offset
        tokens = req.all_token_ids[out_start:end]
        if out_start + len(tokens) < end:  # the previous step's token, not yet appended
            tokens.append(self._last_sampled[req.request_id])
        return GuidedRow(row, req, tokens)

    def _prepare(self, sched: SchedulerOutput) -> PreparedStep:
        bs = self.block_size
        seqs = sched.seqs
        decode = [i for i, s in enumerate(seqs) if s.num_new == 1]
        prefill = [i for i, s in enumerate(seqs) if s.num_new > 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        row_end: dict[int, int] = {}
        pending_rows: list[int] = []
        pending_ids: list[str] = []
        for i in decode:
            s = seqs[i]
            tok = s.input_ids[0]
            if tok == PENDING_TOKEN:
                pending_rows.append(len(ids))
                pending_ids.append(s.request.request_id)
                tok = 0
            ids.append(tok)
            positions.append(s.start)
            slots.append(s.block_ids[s.start // bs] * bs + s.start % bs)
            row_end[i] = len(ids) - 1
        prefills: list[PrefillSeq] = []
        for i in prefill:
            s = seqs[i]
            chunk = s.input_ids
            if chunk[-1] == PENDING_TOKEN:
                pending_rows.append(len(ids) + len(chunk) - 1)
                pending_ids.append(s.request.request_id)
                chunk = chunk[:-1] + [0]
            q_start = len(ids)
            ids.extend(chunk)
            pos = range(s.start, s.start + s.num_new)
            positions.extend(pos)
            slots.extend(s.block_ids[p // bs] * bs + p % bs for p in pos)
            row_end[i] = len(ids) - 1
            prefills.append(
                PrefillSeq(
                    q_start=q_start,
                    q_len=s.num_new,
                    start=s.start,
                    block_ids=torch.tensor(s.block_ids, dtype=torch.long, device=self.device),
                )
            )
        tables = lens = None
        if decode:
            width = max(len(seqs[i].block_ids) for i in decode)
            tables_list = [
                seqs[i].block_ids + [0] * (width - len(seqs[i].block_ids)) for i in decode
            ]
            tables = torch.tensor(tables_list, dtype=torch.long, device=self.device)
            lens = torch.tensor([seqs[i].start + 1 for i in decode], device=self.device)
        sample_idx = [i for i, s in enumerate(seqs) if s.sample]
        dev = self.device
        return PreparedStep(
            sched=sched,
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=AttentionMetadata(
                slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
                num_decode=len(decode),
                decode_block_tables=tables,
                decode_mask=None,  # built by the plain-torch attention if it runs
                prefills=prefills,
                decode_context_lens=lens,
            ),
            sample_rows=torch.tensor(
                [row_end[i] for i in sample_idx], dtype=torch.long, device=dev
            ),
            sample_seq_idx=sample_idx,
            pending_rows=pending_rows,
            pending_ids=pending_ids,
            prompt_lp=prompt_logprob_rows(seqs),
        )


def _grammar_compiler(checkpoint: Path, eos_token_ids: tuple[int, ...]) -> GrammarCompiler:
    """The checkpoint's tokenizer as the grammar library sees it (made on first use)."""
    from transformers import AutoTokenizer

    return GrammarCompiler.from_hf(AutoTokenizer.from_pretrained(checkpoint), eos_token_ids)


def _step_args(sched: SchedulerOutput) -> dict[str, int]:
    """What a forward span shows: the batch's shape."""
    prefill = [s.num_new for s in sched.seqs if s.num_new > 1]
    return {
        "seqs": len(sched.seqs),
        "decode_seqs": len(sched.seqs) - len(prefill),
        "prefill_tokens": sum(prefill),
    }


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``): the weight
    copies freed after a measurement are hundreds of MB that glibc would otherwise keep
    mapped. A no-op where there is no glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
