"""The synchronous engine: model files + scheduler + model runner, one step at a time.

``step`` reads as schedule -> execute -> update. The asyncio face (``async_engine``)
drives the same three calls from its own thread with the next step scheduled while the
current one computes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from engine.block_pool import BlockPool
from engine.config import EngineConfig, ModelConfig
from engine.cuda_runner import CudaModelRunner
from engine.device import resolve_device
from engine.grammar import check_constraint
from engine.kv_events import KVEventLog
from engine.kv_layout import KVLayout
from engine.layers.attention import build_triton_attention, choose_gpu_attention
from engine.model_files import ModelFiles, read_hf_config, resolve_model
from engine.model_runner import DTYPES, ModelRunner
from engine.request import Request, RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import SampledToken, Scheduler, SchedulerOutput
from engine.stats import EngineStats

logger = logging.getLogger(__name__)

# Given the layout and block count, returns the KV pool tensor (e.g. in shared memory).
KVPoolFactory = Callable[[KVLayout, int], torch.Tensor]


class EngineCore:
    def __init__(
        self,
        cfg: EngineConfig,
        *,
        kv_pool_factory: KVPoolFactory | None = None,
        show_progress: bool = True,
    ):
        self.cfg = cfg
        # cfg.num_threads applies on the runner's compute thread, where torch computes.
        self.files: ModelFiles = resolve_model(
            cfg.model, Path(cfg.cache_dir) if cfg.cache_dir else None
        )
        self.model_config = ModelConfig.from_hf(read_hf_config(self.files))
        mc = self.model_config
        max_len = cfg.max_model_len or mc.max_position_embeddings
        if max_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                f"{mc.max_position_embeddings}"
            )
        self.max_model_len = max_len
        self.layout = KVLayout(
            mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim, cfg.dtype,
            deterministic=cfg.deterministic,
        )  # fmt: skip
        num_blocks = cfg.num_blocks or max(2, cfg.kv_cache_bytes // self.layout.block_bytes)
        device = resolve_device(cfg.device)
        # GPU: the Triton kernels must build before the KV pool and weights are loaded (see
        # engine.layers.attention); the plain runner only where --attention-fallback allows.
        self.attention_fallback = device.type == "cuda" and self._gpu_attention(device) == "torch"
        pool_tensor = kv_pool_factory(self.layout, num_blocks) if kv_pool_factory else None
        on_gpu = device.type == "cuda" and not self.attention_fallback
        self.runner = (CudaModelRunner if on_gpu else ModelRunner)(
            cfg,
            mc,
            self.files.path,
            num_blocks=num_blocks,
            kv_pool=pool_tensor,
            show_progress=show_progress,
        )
        # The CPU kernel route of each linear row class, for Stats (none on GPU).
        routes = getattr(self.runner, "kernel_routes", None)
        self._kernel_routes = tuple(sorted(routes.routes.items())) if routes else ()
        # What the prefix cache stores and evicts, for the worker's KV events stream.
        self.kv_events = KVEventLog()
        self.pool = BlockPool(
            num_blocks, cfg.block_size, cfg.enable_prefix_caching, events=self.kv_events
        )
        self.scheduler = Scheduler(
            self.pool,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=max_len,
            max_queued=cfg.max_queued_requests,
            growth_tokens=cfg.kv_growth_tokens,
            max_prefill_while_decoding=cfg.max_prefill_tokens_while_decoding,
        )
        logger.info(
            "engine ready: model=%s dtype=%s blocks=%d (%.1f MiB KV) max_model_len=%d",
            self.files.name,
            cfg.dtype,
            num_blocks,
            num_blocks * self.layout.block_bytes / 2**20,
            max_len,
        )

    def _gpu_attention(self, device: torch.device) -> str:
        """``"triton"``, or ``"torch"`` when the kernels did not build and the config
        allows the fallback; AttentionBuildError otherwise."""
        mc = self.model_config
        build = functools.partial(
            build_triton_attention,
            device,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            block_size=self.cfg.block_size,
            dtype=DTYPES[self.cfg.dtype],
        )
        return choose_gpu_attention(self.cfg.attention_fallback, build)

    # -- requests ---------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        hold_kv: bool = False,
    ) -> Request:
        """Validate a request against this model; raises ValueError naming the problem."""
        if not request_id:
            raise ValueError("request_id must be a non-empty string")
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        vocab = self.model_config.vocab_size
        for tok in prompt_token_ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
                raise ValueError(
                    f"prompt_token_ids contains {tok!r}, outside the vocabulary [0, {vocab})"
                )
        params.validate_vocab(vocab)
        if params.constraint is not None:
            self._check_constraint(params)
        if params.output_offset >= len(prompt_token_ids):
            raise ValueError(
                f"output_offset ({params.output_offset}) must be less than the prompt's "
                f"{len(prompt_token_ids)} tokens: the prompt ends with the earlier outputs"
            )
        self.scheduler.check_admissible(request_id, len(prompt_token_ids))
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            eos_token_ids=frozenset(self.model_config.eos_token_ids),
            hold_kv=hold_kv,
        )

    def _check_constraint(self, params: SamplingParams) -> None:
        """A constraint must compile, and needs the checkpoint's tokenizer to mask by."""
        assert params.constraint is not None
        if not (self.files.path / "tokenizer.json").is_file():
            raise ValueError(
                f"{params.constraint.field}: model {self.files.name} has no tokenizer.json, "
                "which constrained decoding needs"
            )
        check_constraint(params.constraint)

    def add_request(self, req: Request) -> None:
        self.scheduler.add(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.scheduler.abort(request_id)

    # -- the step ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        return self.update(sched, self.runner.execute(sched))

    def update(
        self, sched: SchedulerOutput, sampled: list[SampledToken | None]
    ) -> list[RequestOutput]:
        outputs = self.scheduler.update(sched, sampled)
        self.kv_events.close_batch()
        return outputs

    def warm_up(self) -> None:
        """Run one tiny request through every path a step takes (prefill, decode, sample),
        then forget its KV, so the first real request pays no first-call costs."""
        self.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        self.pool.reset_prefix_cache()
        self.kv_events.close_batch()
        self.runner.idle()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        s = self.scheduler
        lending = self.runner.lending
        return EngineStats(
            num_running=len(s.running),
            # Reservations queued for blocks wait too (without blocks), as routing sees it.
            num_waiting=len(s.waiting) + len(s.reserving),
            num_waiting_for_kv=len(s.remote),
            num_total_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free,
            num_held_blocks=s.num_held_blocks,
            num_queued_prompt_tokens=s.num_queued_prompt_tokens,
            prefix_hit_tokens=self.pool.prefix_hit_tokens,
            prefix_query_tokens=self.pool.prefix_query_tokens,
            num_preemptions=s.num_preemptions,
            num_prompt_tokens_total=s.num_prompt_tokens_total,
            num_generated_tokens_total=s.num_generated_tokens_total,
            num_steps=self.runner.num_steps,
            busy_seconds=self.runner.busy_seconds,
            max_num_seqs=s.max_num_seqs,
            max_queued_requests=s.max_queued,
            cpu_kernel_routes=self._kernel_routes,
            attention_fallback=self.attention_fallback,
            borrowed_forwards=lending.borrowed_forwards if lending else 0,
            core_wait_seconds=lending.waited_s if lending else 0.0,
            core_group=lending.group if lending else "",
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Offline convenience: run prompts to completion; returns each one's output ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(self.make_request(rid, prompt, p))
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_work():
            for o in self.step():
                out[o.request_id].extend(o.new_token_ids)
        return [out[rid] for rid in ids]
