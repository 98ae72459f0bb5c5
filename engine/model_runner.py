"""Turns a scheduler decision into one forward pass and sampled tokens.

Owns the model weights, the KV pool tensor and the previous step's sampled ids. Seeded
sampling keeps no per-request state: each output position gets its own generator
(``engine.sampler.position_generator``). ``execute`` is called on one thread at a
time, in step order; it resolves tokens that were still pending when the step was
scheduled from the previous step's samples. ``timeline`` (engine.timeline; set by the
``AsyncEngine`` that drives the runner, OFF otherwise) gets each step's prepare, forward
and sample spans.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig, ModelConfig
from engine.device import build_on, resolve_device
from engine.forward_context import AttentionMetadata, ForwardContext, PrefillSeq, forward_context
from engine.kv_layout import KVLayout
from engine.models.llama import LlamaForCausalLM
from engine.sampler import Sampler, SamplingRow, position_generator
from engine.scheduler import PENDING_TOKEN, SampledToken, ScheduledSeq, SchedulerOutput
from engine.timeline import OFF, RUNNER, TimelineRecorder
from engine.weights import iter_safetensors

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # flat row of the last token of each sampling seq
    sample_seq_idx: list[int]  # index into sched.seqs of each sampling row


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
        )
        torch.manual_seed(cfg.seed)
        with build_on(self.device, self.dtype):
            model = LlamaForCausalLM(model_cfg)
        model.load_weights(iter_safetensors(checkpoint, show_progress=show_progress))
        # Parameters already are in dtype; this casts the fp32 rope tables, as HF does.
        self.model = model.to(self.dtype).eval()
        shape = self.layout.pool_shape(num_blocks)
        if kv_pool is None:
            kv_pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if (
            tuple(kv_pool.shape) != shape
            or kv_pool.dtype != self.dtype
            or kv_pool.device != self.device
        ):
            raise ValueError(
                f"kv_pool has shape {tuple(kv_pool.shape)} {kv_pool.dtype} on {kv_pool.device}; "
                f"expected {shape} {self.dtype} on {self.device}"
            )
        self.kv_cache = kv_pool
        self.sampler = Sampler(self.device, cfg.seed)
        self._last_sampled: dict[str, int] = {}
        self.busy_seconds = 0.0
        self.num_steps = 0

    # -- the step ---------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> list[SampledToken | None]:
        """Run one step; returns a sampled token for each seq with ``sample=True``."""
        t0 = time.perf_counter()
        tl = self.timeline
        with tl.span("prepare", RUNNER):
            batch = self._prepare(sched)
        with tl.span("forward", RUNNER, _step_args(sched) if tl.enabled else None):
            logits = self._forward(batch)
        results: list[SampledToken | None] = [None] * len(sched.seqs)
        last: dict[str, int] = {}
        if batch.sample_seq_idx:
            with tl.span("sample", RUNNER):
                rows = [self._sampling_row(sched.seqs[i]) for i in batch.sample_seq_idx]
                sampled = self.sampler(logits, rows)
            for i, (tok, lp) in zip(batch.sample_seq_idx, sampled, strict=True):
                results[i] = SampledToken(tok, lp)
                last[sched.seqs[i].request.request_id] = tok
        self._last_sampled = last
        self.busy_seconds += time.perf_counter() - t0
        self.num_steps += 1
        return results

    @torch.inference_mode()
    def forward_logits(self, sched: SchedulerOutput) -> torch.Tensor:
        """Float32 logits [num sampling seqs, vocab] of a step, without sampling.

        Writes the step's KV like ``execute`` does; used by parity tests.
        """
        return self._forward(self._prepare(sched))

    def _forward(self, batch: _Batch) -> torch.Tensor:
        with forward_context(ForwardContext(batch.meta, self.kv_cache)):
            hidden = self.model(batch.input_ids, batch.positions)
        if not batch.sample_seq_idx:
            return hidden.new_empty((0, self.model_cfg.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[batch.sample_rows]).float()

    def _sampling_row(self, seq: ScheduledSeq) -> SamplingRow:
        req = seq.request
        params = req.params
        end = seq.start + seq.num_new
        gen = None
        if params.seed is not None and not params.greedy:
            gen = position_generator(self.device, params.seed, end - req.num_prompt_tokens)
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
            num_prompt_tokens=req.num_prompt_tokens,
        )

    def _prepare(self, sched: SchedulerOutput) -> _Batch:
        bs = self.block_size
        seqs = sched.seqs
        decode = [i for i, s in enumerate(seqs) if s.num_new == 1]
        prefill = [i for i, s in enumerate(seqs) if s.num_new > 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        row_end: dict[int, int] = {}
        for i in decode:
            s = seqs[i]
            tok = s.input_ids[0]
            if tok == PENDING_TOKEN:
                tok = self._last_sampled[s.request.request_id]
            ids.append(tok)
            positions.append(s.start)
            slots.append(s.block_ids[s.start // bs] * bs + s.start % bs)
            row_end[i] = len(ids) - 1
        prefills: list[PrefillSeq] = []
        for i in prefill:
            s = seqs[i]
            chunk = s.input_ids
            if chunk[-1] == PENDING_TOKEN:
                chunk = chunk[:-1] + [self._last_sampled[s.request.request_id]]
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
        tables = mask = None
        if decode:
            width = max(len(seqs[i].block_ids) for i in decode)
            tables_list = [
                seqs[i].block_ids + [0] * (width - len(seqs[i].block_ids)) for i in decode
            ]
            tables = torch.tensor(tables_list, dtype=torch.long, device=self.device)
            ctx = torch.tensor([seqs[i].start + 1 for i in decode], device=self.device)
            cols = torch.arange(width * bs, device=self.device)
            mask = torch.zeros((len(decode), width * bs), dtype=torch.float32, device=self.device)
            mask.masked_fill_(cols.unsqueeze(0) >= ctx.unsqueeze(1), float("-inf"))
        sample_idx = [i for i, s in enumerate(seqs) if s.sample]
        dev = self.device
        return _Batch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=AttentionMetadata(
                slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
                num_decode=len(decode),
                decode_block_tables=tables,
                decode_mask=mask,
                prefills=prefills,
            ),
            sample_rows=torch.tensor(
                [row_end[i] for i in sample_idx], dtype=torch.long, device=dev
            ),
            sample_seq_idx=sample_idx,
        )


def _step_args(sched: SchedulerOutput) -> dict[str, int]:
    """What a forward span shows: the batch's shape."""
    prefill = [s.num_new for s in sched.seqs if s.num_new > 1]
    return {
        "seqs": len(sched.seqs),
        "decode_seqs": len(sched.seqs) - len(prefill),
        "prefill_tokens": sum(prefill),
    }
