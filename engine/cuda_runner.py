"""The model runner on a GPU: Triton attention, CUDA-graph decode steps, one upload a step.

What changes from ``ModelRunner``:

- every attention layer runs the Triton kernels (paged decode, varlen prefill, KV write);
  no decode mask and no padding to the longest sequence are built;
- a step's host-side inputs (ids, positions, slots, context lengths, block tables, the
  packed prefill chunks, the sampled rows) are written into one pinned int32 buffer and
  reach the device in one non-blocking copy;
- decode-only steps of up to ``max_num_seqs`` rows replay a CUDA graph of their bucket
  (``engine.cuda_graphs``); mixed steps run eagerly;
- sampling goes through ``DeviceSampler``, whose common rows read nothing back but the
  tokens.

It runs on the CPU too, for tests: with a fake graph capture and Triton's interpreter.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.config import EngineConfig, ModelConfig
from engine.cuda_graphs import CudaGraphCapture, DecodeGraphs, GraphCapture, default_buckets
from engine.device_sampler import DeviceSampler
from engine.forward_context import (
    AttentionMetadata,
    ForwardContext,
    PackedPrefills,
    forward_context,
)
from engine.layers.attention import PagedAttention, triton_attention_backend
from engine.model_runner import ModelRunner
from engine.prompt_logprobs import PromptRows, fill_prompt_logprobs, prompt_logprob_rows
from engine.scheduler import PENDING_TOKEN, SampledToken, SchedulerOutput


@dataclass(slots=True)
class GraphRows:
    """A decode-only step's rows, as host lists, for a graph replay."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]


@dataclass(slots=True)
class GpuBatch:
    sample_seq_idx: list[int]  # index into sched.seqs of each sampling row
    sample_rows: torch.Tensor | None  # device rows to sample; None: every row, in order
    graph: GraphRows | None = None  # set: replay a graph; else the eager fields below
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    meta: AttentionMetadata | None = None
    prompt_lp: list[PromptRows] = field(default_factory=list)


class Uploader:
    """Moves a step's int32 inputs to the device in one copy from one pinned buffer."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pin = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int32)
        self._dev = torch.empty(0, dtype=torch.int32, device=device)
        self._copied: torch.cuda.Event | None = None

    def upload(self, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """Device int32 copies of ``parts`` (1-d), views of one buffer valid until the next
        call."""
        total = sum(len(p) for p in parts)
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffer is free once its copy landed
        if self._host.numel() < total:
            size = max(total, 2 * self._host.numel(), 4096)
            self._host = torch.empty(size, dtype=torch.int32, pin_memory=self._pin)
            self._dev = torch.empty(size, dtype=torch.int32, device=self.device)
        host = self._host.numpy()
        offset = 0
        bounds = []
        for part in parts:
            host[offset : offset + len(part)] = part
            bounds.append((offset, offset + len(part)))
            offset += len(part)
        if self._pin:
            self._dev[:total].copy_(self._host[:total], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))
        else:
            self._dev[:total].copy_(self._host[:total])
        return [self._dev[a:b] for a, b in bounds]


def _tables(rows: list[list[int]], width: int) -> np.ndarray:
    out = np.zeros((len(rows), width), dtype=np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


@dataclass(slots=True)
class DeferredStep:
    """A step whose inputs are built on the compute thread, when it runs."""

    sched: SchedulerOutput


class CudaModelRunner(ModelRunner):
    def __init__(
        self,
        cfg: EngineConfig,
        model_cfg: ModelConfig,
        checkpoint: Path,
        *,
        num_blocks: int,
        kv_pool: torch.Tensor | None = None,
        show_progress: bool = True,
        capture: GraphCapture | None = None,
        buckets: tuple[int, ...] | None = None,
    ):
        """``capture``: how decode graphs are recorded (default: real CUDA graphs on a GPU,
        none on the CPU); ``buckets``: their batch sizes (default from max_num_seqs)."""
        super().__init__(
            cfg, model_cfg, checkpoint, num_blocks=num_blocks, kv_pool=kv_pool,
            show_progress=show_progress,
        )  # fmt: skip
        if triton_attention_backend() is None:
            raise ValueError(
                f"device {cfg.device!r} needs Triton for attention; install baton[gpu]"
            )
        for module in self.model.modules():
            if isinstance(module, PagedAttention):
                module.use_triton = True
        self.sampler = DeviceSampler(self.device, cfg.seed)
        max_len = cfg.max_model_len or model_cfg.max_position_embeddings
        self.max_blocks_per_seq = -(-max_len // self.block_size)
        on_gpu = self.device.type == "cuda"
        self.sm_count = (
            torch.cuda.get_device_properties(self.device).multi_processor_count if on_gpu else 4
        )
        self._uploader = Uploader(self.device)
        self.graphs: DecodeGraphs | None = None
        if not cfg.enforce_eager and (capture is not None or on_gpu):
            from engine.kernels.triton_decode_attention import num_splits_for

            kv_heads = model_cfg.num_kv_heads
            with self._on_device(), torch.inference_mode():
                self.graphs = DecodeGraphs(
                    self._logits_of_all_rows,
                    self.kv_cache,
                    buckets=buckets or default_buckets(cfg.max_num_seqs),
                    max_blocks_per_seq=self.max_blocks_per_seq,
                    splits_for=lambda b: num_splits_for(b, kv_heads, max_len, self.sm_count),
                    capture=capture or CudaGraphCapture(self.device),
                )

    # -- the step ---------------------------------------------------------------------

    # Everything happens on the compute thread, in step order: the one upload reads the
    # previous step's samples directly, so there is nothing to prepare ahead.

    def prepare(self, sched: SchedulerOutput) -> DeferredStep:  # type: ignore[override]
        return DeferredStep(sched)

    @torch.inference_mode()
    def _run(self, step: DeferredStep) -> list[SampledToken | None]:  # type: ignore[override]
        with self._on_device():
            t0 = time.perf_counter()
            batch = self._prepare(step.sched)
            logits = self._forward(batch)
            return self._sample(step.sched, batch.sample_seq_idx, logits, t0)

    @torch.inference_mode()
    def _forward_logits(self, step: DeferredStep) -> torch.Tensor:  # type: ignore[override]
        with self._on_device():
            return self._forward(self._prepare(step.sched)).clone()  # graph outputs are reused

    def _on_device(self) -> contextlib.AbstractContextManager[None]:
        """Triton launches on the current device, which is per thread: make it ours."""
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def _logits_of_all_rows(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(self.model(ids, positions)).float()

    def _forward(self, batch: GpuBatch) -> torch.Tensor:  # type: ignore[override]
        if batch.graph is not None:
            assert self.graphs is not None
            g = batch.graph
            logits = self.graphs.run(g.ids, g.positions, g.slots, g.context_lens, g.block_tables)
            return logits if batch.sample_rows is None else logits[batch.sample_rows]
        assert batch.meta is not None and batch.input_ids is not None
        with forward_context(ForwardContext(batch.meta, self.kv_cache)):
            hidden = self.model(batch.input_ids, batch.positions)
        fill_prompt_logprobs(self.model.compute_logits, batch.prompt_lp, hidden)
        if not batch.sample_seq_idx:
            return hidden.new_empty((0, self.model_cfg.vocab_size), dtype=torch.float32)
        rows = hidden if batch.sample_rows is None else hidden[batch.sample_rows]
        return self.model.compute_logits(rows).float()

    def _prepare(self, sched: SchedulerOutput) -> GpuBatch:  # type: ignore[override]
        bs = self.block_size
        seqs = sched.seqs
        decode = [i for i, s in enumerate(seqs) if s.num_new == 1]
        prefill = [i for i, s in enumerate(seqs) if s.num_new > 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        row_end: dict[int, int] = {}
        lens: list[int] = []
        tables: list[list[int]] = []
        for i in decode:
            s = seqs[i]
            tok = s.input_ids[0]
            if tok == PENDING_TOKEN:
                tok = self._last_sampled[s.request.request_id]
            ids.append(tok)
            positions.append(s.start)
            slots.append(s.block_ids[s.start // bs] * bs + s.start % bs)
            lens.append(s.start + 1)
            tables.append(s.block_ids[: s.start // bs + 1])
            row_end[i] = len(ids) - 1
        q_start: list[int] = []
        q_len: list[int] = []
        ctx: list[int] = []
        pf_tables: list[list[int]] = []
        for i in prefill:
            s = seqs[i]
            chunk = s.input_ids
            if chunk[-1] == PENDING_TOKEN:
                chunk = chunk[:-1] + [self._last_sampled[s.request.request_id]]
            q_start.append(len(ids))
            q_len.append(s.num_new)
            ctx.append(s.start)
            end = s.start + s.num_new
            pf_tables.append(s.block_ids[: -(-end // bs)])
            ids.extend(chunk)
            pos = range(s.start, end)
            positions.extend(pos)
            slots.extend(s.block_ids[p // bs] * bs + p % bs for p in pos)
            row_end[i] = len(ids) - 1
        sample_idx = [i for i, s in enumerate(seqs) if s.sample]
        rows = [row_end[i] for i in sample_idx]
        every_row = rows == list(range(len(ids)))
        graphs = self.graphs
        prompt_lp = prompt_logprob_rows(seqs)
        if (
            not prefill
            and not prompt_lp  # a graph computes the sampled rows' logits only
            and graphs is not None
            and graphs.bucket_for(len(decode)) is not None
        ):
            sample_rows = None
            if not every_row:
                (sample_rows,) = self._uploader.upload([np.asarray(rows, dtype=np.int32)])
            graph = GraphRows(ids, positions, slots, lens, tables)
            return GpuBatch(sample_idx, sample_rows, graph)
        dec_width = max((len(t) for t in tables), default=0)
        pf_width = max((len(t) for t in pf_tables), default=0)
        parts = [ids, positions, slots, rows, lens, q_start, q_len, ctx]
        up = self._uploader.upload(
            [np.asarray(p, dtype=np.int32) for p in parts]
            + [_tables(tables, dec_width).ravel(), _tables(pf_tables, pf_width).ravel()]
        )
        ids_d, pos_d, slots_d, rows_d, lens_d, qs_d, ql_d, ctx_d, dec_t, pf_t = up
        packed = None
        if prefill:
            packed = PackedPrefills(
                qs_d, ql_d, ctx_d, pf_t.view(len(prefill), pf_width), max(q_len)
            )
        splits = 1
        if decode:
            from engine.kernels.triton_decode_attention import num_splits_for

            splits = num_splits_for(
                len(decode), self.model_cfg.num_kv_heads, max(lens), self.sm_count
            )
        meta = AttentionMetadata(
            slot_mapping=slots_d,
            num_decode=len(decode),
            decode_block_tables=dec_t.view(len(decode), dec_width) if decode else None,
            decode_mask=None,
            prefills=[],
            decode_context_lens=lens_d if decode else None,
            packed_prefills=packed,
            decode_splits=splits,
        )
        return GpuBatch(
            sample_idx,
            None if every_row else rows_d,
            None,
            ids_d,
            pos_d,
            meta,
            prompt_lp,
        )
