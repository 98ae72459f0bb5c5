"""One decode step of SmolLM2-135M, variant against variant, interleaved in one process.

Builds the SmolLM2-135M architecture with random weights (timing does not depend on the
values) and a paged KV cache whose sequences have mixed context lengths and shuffled,
non-contiguous block ids. For each batch size it times, round-robin so that noise from
other work on the machine hits every variant alike:

- ``before``: the gather + grouped-matmul decode as first committed, torch rope and norm;
- ``torch``: today's plain-torch path (the portable backend);
- ``sdpa``: decode queries through torch SDPA with ``enable_gqa`` and a padding mask;
- ``kernels``: the compiled CPU kernels for attention, rope and norm;
- ``kernels+llama``: also the model's fast linear path (``engine.kernels.ops``): linear
  layers through the bf16 GEMV kernel up to ``GEMV_MAX_ROWS`` rows and oneDNN-prepacked
  weights above, and SiLU-and-multiply in one op;
- ``kernels+fused``: also the fused decoder stack (``ops.decode_stack``), one compiled
  call for every layer of a decode-only batch. This is the model's production path.

It prints, per batch size, the median wall and CPU time of a step (model forward plus
logits of every row; sampling and batch preparation excluded) and the ratio to
``before``. CPU time is the steadier figure on a shared machine; with one thread it is
the work itself.

    python -m benchmarks.decode_step [--dtype bfloat16] [--batch 1 16 64] [--ctx 300]
        [--spread 32] [--reps 15] [--threads N] [--variants before torch kernels]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.forward_context import (
    AttentionMetadata,
    ForwardContext,
    forward_context,
    get_forward_context,
)
from engine.kernels.cpu import cpu_kernels
from engine.kv_layout import KVLayout
from engine.layers.attention import PagedAttention
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import MLP, DecoderLayer, Linear, LlamaForCausalLM

BLOCK_SIZE = 16
VARIANTS = ("before", "torch", "sdpa", "kernels", "kernels+llama", "kernels+fused")

SMOLLM2_135M = ModelConfig(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    attention_bias=False,
    rope_scaling=None,
    eos_token_ids=(2,),
    bos_token_id=1,
)


@dataclass(slots=True)
class DecodeBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    kv_cache: torch.Tensor


def make_decode_batch(
    cfg: ModelConfig, dtype: torch.dtype, batch: int, ctx: int, spread: int, seed: int = 0
) -> DecodeBatch:
    """``batch`` decode rows with contexts in [ctx - spread, ctx + spread], as the runner builds."""
    rng = random.Random(seed)
    lens = [max(1, ctx + rng.randint(-spread, spread)) for _ in range(batch)]
    nblocks = [(n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in lens]
    ids = list(range(1, sum(nblocks) + 1))
    rng.shuffle(ids)
    it = iter(ids)
    tables = [[next(it) for _ in range(n)] for n in nblocks]
    layout = KVLayout(cfg.num_layers, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, "float32")
    kv = torch.randn(layout.pool_shape(len(ids) + 1), dtype=dtype)
    width = max(nblocks)
    ctx_t = torch.tensor(lens)
    mask = torch.zeros(batch, width * BLOCK_SIZE)
    mask.masked_fill_(torch.arange(width * BLOCK_SIZE)[None] >= ctx_t[:, None], float("-inf"))
    slots = [
        tab[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
        for tab, n in zip(tables, lens, strict=True)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode=batch,
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_mask=mask,
        prefills=[],
    )
    input_ids = torch.tensor([rng.randrange(1000, 40000) for _ in range(batch)])
    return DecodeBatch(input_ids, ctx_t - 1, meta, kv)


# -- variants ---------------------------------------------------------------------------


def _before_forward(self: PagedAttention, q, k, v):
    """PagedAttention.forward as first committed (gather + grouped matmul)."""
    ctx = get_forward_context()
    meta = ctx.attn
    k_cache = ctx.kv_cache[self.layer_idx, 0]
    v_cache = ctx.kv_cache[self.layer_idx, 1]
    hkv, nb, bs, d = k_cache.shape
    k_cache.view(hkv, nb * bs, d).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_cache.view(hkv, nb * bs, d).index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    out = torch.empty_like(q)
    n_dec = meta.num_decode
    if n_dec:
        tables = meta.decode_block_tables
        b, m = tables.shape
        idx = tables.reshape(-1)
        keys = k_cache.index_select(1, idx).view(hkv, b, m * bs, d)
        values = v_cache.index_select(1, idx).view(hkv, b, m * bs, d)
        qg = q[:n_dec].view(b, hkv, self.group, d).transpose(0, 1)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float()
        scores = scores * self.scale + meta.decode_mask[None, :, None, :]
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        o = torch.matmul(probs, values)
        out[:n_dec] = o.transpose(0, 1).reshape(b, self.num_heads, d)
    for p in meta.prefills:
        rows = slice(p.q_start, p.q_start + p.q_len)
        out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, p)
    return out.view(q.shape[0], self.num_heads * self.head_dim)


def _sdpa_decode(self: PagedAttention, q, k_cache, v_cache, meta) -> torch.Tensor:
    """Decode rows through SDPA: q [B, H, 1, D] against the gathered [B, Hkv, T, D]."""
    tables = meta.decode_block_tables
    b, m = tables.shape
    hkv, _, bs, d = k_cache.shape
    idx = tables.reshape(-1)
    keys = k_cache.index_select(1, idx).view(hkv, b, m * bs, d).transpose(0, 1)
    values = v_cache.index_select(1, idx).view(hkv, b, m * bs, d).transpose(0, 1)
    mask = (meta.decode_mask == 0)[:, None, None, :]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
    )
    return o.view(b, self.num_heads, d)


def apply_variant(model: nn.Module, variant: str) -> None:
    """Switch every layer of ``model`` to ``variant`` (in place, reversible)."""
    kernels = variant.startswith("kernels")
    llama = variant in ("kernels+llama", "kernels+fused")
    for mod in model.modules():
        if isinstance(mod, PagedAttention | RMSNorm | RotaryEmbedding):
            mod.use_kernel = kernels
        if isinstance(mod, PagedAttention):
            for name in ("forward", "_decode"):
                mod.__dict__.pop(name, None)
            if variant == "before":
                mod.forward = types.MethodType(_before_forward, mod)
            elif variant == "sdpa":
                mod._decode = types.MethodType(_sdpa_decode, mod)
        if isinstance(mod, Linear | MLP):
            mod.use_kernel = llama
        if isinstance(mod, DecoderLayer):
            mod.use_kernel = variant == "kernels+fused"


def available_variants(dtype: torch.dtype, wanted: list[str]) -> list[str]:
    kernels = cpu_kernels()
    out = []
    for v in wanted:
        if v.startswith("kernels") and kernels is None:
            continue
        out.append(v)
    return out


# -- timing -----------------------------------------------------------------------------


def _step_fn(model: LlamaForCausalLM, batch: DecodeBatch) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        with forward_context(ForwardContext(batch.meta, batch.kv_cache)):
            hidden = model(batch.input_ids, batch.positions)
        return model.compute_logits(hidden).float()

    return step


def time_variants(
    model: LlamaForCausalLM, batch: DecodeBatch, variants: list[str], reps: int, warmup: int = 2
) -> dict[str, tuple[list[float], list[float]]]:
    """Per variant, wall and CPU seconds of ``reps`` steps, run round-robin."""
    step = _step_fn(model, batch)
    times: dict[str, tuple[list[float], list[float]]] = {v: ([], []) for v in variants}
    with torch.inference_mode():
        for r in range(warmup + reps):
            for v in variants:
                apply_variant(model, v)
                batch.meta.decode_context_lens = None  # as the runner leaves it today
                w0, c0 = time.perf_counter(), time.process_time()
                step()
                w1, c1 = time.perf_counter(), time.process_time()
                if r >= warmup:
                    times[v][0].append(w1 - w0)
                    times[v][1].append(c1 - c0)
    return times


def check_variants_agree(
    model: LlamaForCausalLM, batch: DecodeBatch, variants: list[str]
) -> dict[str, float]:
    """Max logit difference of each variant from the first, relative to its max logit."""
    step = _step_fn(model, batch)
    kv0 = batch.kv_cache.clone()
    out: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for v in variants:
            apply_variant(model, v)
            batch.kv_cache.copy_(kv0)
            out[v] = step()
    batch.kv_cache.copy_(kv0)
    base = out[variants[0]]
    return {v: ((o - base).abs().max() / base.abs().max()).item() for v, o in out.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--ctx", type=int, default=300, help="mean context length")
    ap.add_argument("--spread", type=int, default=32, help="contexts vary by +- this")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = LlamaForCausalLM(SMOLLM2_135M).to(dtype).eval()
    model.prepare_fast_path()
    variants = available_variants(dtype, args.variants)
    print(
        f"# decode step, SmolLM2-135M shape, {args.dtype}, {torch.get_num_threads()} threads, "
        f"context {args.ctx}+-{args.spread}, {args.reps} interleaved reps; "
        f"kernels: {'yes' if cpu_kernels() else 'no'}"
    )
    for b in args.batch:
        batch = make_decode_batch(SMOLLM2_135M, dtype, b, args.ctx, args.spread)
        diffs = check_variants_agree(model, batch, variants)
        times = time_variants(model, batch, variants, args.reps)
        base_w = statistics.median(times[variants[0]][0])
        base_c = statistics.median(times[variants[0]][1])
        print(
            f"\nbatch {b}:  variant        wall ms   cpu ms   wall x   cpu x"
            "   tok/s(wall)  rel dlogit"
        )
        for v in variants:
            w = statistics.median(times[v][0])
            c = statistics.median(times[v][1])
            print(
                f"           {v:13s} {w * 1e3:8.1f} {c * 1e3:8.1f} {base_w / w:7.2f}"
                f"  {base_c / c:6.2f}   {b / w:10.1f}   {diffs[v]:.3g}"
            )


if __name__ == "__main__":
    main()
