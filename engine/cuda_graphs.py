"""CUDA graphs of decode-only steps: one graph per bucket batch size, over static inputs.

A decode step of B rows replays the graph of the smallest bucket >= B. Each bucket's
inputs live at the start of one static int32 device buffer, laid out as
``[ids | positions | slots | context lens | block tables (bucket x max blocks)]``; the
runner fills the same layout in pinned host memory and uploads it with one
non-blocking copy. Rows past B are padding: slot -1 (the KV write skips it) and
context length 0 (attention writes zeros), so a padded replay never touches a block
a live sequence owns. The graph's output is the fp32 logits of every bucket row.

How a graph is captured is a seam (``GraphCapture``): ``CudaGraphCapture`` records real
CUDA graphs; a test passes a capture that runs the same closure eagerly on replay, so
the bucketing, the static layout and the padding are checked without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.forward_context import AttentionMetadata, ForwardContext, forward_context

# Per row: id, position, slot, context length (then the row's block table).
_ROW_FIELDS = 4


def default_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 16 up to ``max_num_seqs`` (which is always a bucket)."""
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return tuple(sorted({*small, *range(16, max_num_seqs, 16), max_num_seqs}))


class CapturedGraph(Protocol):
    output: torch.Tensor

    def replay(self) -> None:
        """Re-run the captured work; results land in ``output``."""


class GraphCapture(Protocol):
    def capture(self, run: Callable[[], torch.Tensor]) -> CapturedGraph:
        """Record ``run`` (which returns the output tensor) for later replays."""


@dataclass(slots=True)
class _CudaGraph:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphCapture:
    """Real CUDA graphs, all drawing on one memory pool (captured largest first)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool = torch.cuda.graph_pool_handle()

    def capture(self, run: Callable[[], torch.Tensor]) -> CapturedGraph:
        # Warm up on a side stream first: lazy inits (cuBLAS workspaces, Triton compiles)
        # must not happen inside the capture.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = run()
        return _CudaGraph(graph, output)


@dataclass(slots=True)
class _Bucket:
    size: int
    ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    graph: CapturedGraph | None = None


class DecodeGraphs:
    """The decode graphs of one model and KV pool; used by one thread at a time."""

    def __init__(
        self,
        run_model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        kv_cache: torch.Tensor,
        *,
        buckets: tuple[int, ...],
        max_blocks_per_seq: int,
        splits_for: Callable[[int], int],
        capture: GraphCapture,
    ) -> None:
        """``run_model(ids, positions)`` returns fp32 logits [rows, vocab] under the
        forward context set here; ``splits_for(bucket)`` is the decode split count."""
        assert buckets and list(buckets) == sorted(set(buckets)) and buckets[0] >= 1, buckets
        self.buckets = buckets
        self.width = max_blocks_per_seq
        self.kv_cache = kv_cache
        self.replays: dict[int, int] = dict.fromkeys(buckets, 0)  # per bucket, for tests/stats
        device = kv_cache.device
        numel = buckets[-1] * (_ROW_FIELDS + self.width)
        self.static = torch.zeros(numel, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self._host = torch.zeros(numel, dtype=torch.int32, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._uploaded: torch.cuda.Event | None = None
        self._buckets: dict[int, _Bucket] = {}
        for size in buckets:
            ids, pos, slots, lens, tables = self._split(self.static, size)
            meta = AttentionMetadata(
                slot_mapping=slots,
                num_decode=size,
                decode_block_tables=tables,
                decode_mask=None,
                prefills=[],
                decode_context_lens=lens,
                decode_splits=splits_for(size),
            )
            self._buckets[size] = _Bucket(size, ids, pos, meta)
        self._run_model = run_model
        # Largest first: the shared pool is sized once, smaller graphs reuse it.
        self._pad_all()
        for size in reversed(buckets):
            bucket = self._buckets[size]
            self._upload(size)
            bucket.graph = capture.capture(lambda b=bucket: self._forward(b))

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, rows: int) -> int | None:
        """The smallest bucket holding ``rows`` decode rows, or None when none does."""
        for size in self.buckets:
            if size >= rows:
                return size
        return None

    def run(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
    ) -> torch.Tensor:
        """Replay the decode step of these rows; returns fp32 logits [rows, vocab], a view
        of the graph's output that stays valid until the next ``run``."""
        rows = len(ids)
        size = self.bucket_for(rows)
        assert size is not None and rows >= 1, f"{rows} rows exceed the graph buckets"
        ids_h, pos_h, slots_h, lens_h, tables_h = self._split(self._host_np, size)
        ids_h[:rows] = ids
        pos_h[:rows] = positions
        slots_h[:rows] = slots
        lens_h[:rows] = context_lens
        tables_h[:rows] = 0
        for row, table in enumerate(block_tables):
            assert len(table) <= self.width, f"{len(table)} blocks > {self.width} per sequence"
            tables_h[row, : len(table)] = table
        self._pad(size, rows)
        self._upload(size)
        bucket = self._buckets[size]
        assert bucket.graph is not None
        bucket.graph.replay()
        self.replays[size] += 1
        return bucket.graph.output[:rows]

    # -- internals ----------------------------------------------------------------------------

    def _split(self, flat, size: int):  # noqa: ANN001, ANN202 - tensor or ndarray views
        w = self.width
        parts = [flat[i * size : (i + 1) * size] for i in range(_ROW_FIELDS)]
        base = _ROW_FIELDS * size
        tables = flat[base : base + size * w].reshape(size, w)
        return (*parts, tables)

    def _pad(self, size: int, rows: int) -> None:
        """Rows ``rows:size`` of the host layout become padding."""
        ids_h, pos_h, slots_h, lens_h, tables_h = self._split(self._host_np, size)
        ids_h[rows:] = 0
        pos_h[rows:] = 0
        slots_h[rows:] = -1
        lens_h[rows:] = 0
        tables_h[rows:] = 0

    def _pad_all(self) -> None:
        self._host_np[:] = 0
        self._pad(self.max_batch, 0)

    def _upload(self, size: int) -> None:
        """Copy the host layout of ``size`` rows into the static buffer (non-blocking on a
        GPU; the host buffer is reused only once the previous copy has landed)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        n = size * (_ROW_FIELDS + self.width)
        if self.static.device.type == "cuda":
            self.static[:n].copy_(self._host[:n], non_blocking=True)
            self._uploaded = torch.cuda.Event()
            self._uploaded.record(torch.cuda.current_stream(self.static.device))
        else:
            self.static[:n].copy_(self._host[:n])

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        with forward_context(ForwardContext(bucket.meta, self.kv_cache)):
            return self._run_model(bucket.ids, bucket.positions)
