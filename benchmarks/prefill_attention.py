"""Prefill attention: the compiled kernel over the paged pool against torch SDPA, interleaved.

One layer of SmolLM2-135M's attention (9 query heads on 3 KV heads of 64) for a chunk of
a prompt, at several (cached context, chunk) shapes: a short prompt in one chunk, a full
512-token chunk from scratch, and 512-token chunks after 1.5k and 7.7k cached tokens (the
last chunks of a 2k system prompt and of a prompt near ``max_model_len`` 8192). The pool
is on huge pages with shuffled block ids, as a running server's is.

- ``sdpa``: what the model ran before the kernel and still runs as its torch twin
  (``PagedAttention._prefill``): the chunk's own K/V for a first chunk with
  ``is_causal``; for a later chunk the context gathered from the pool (``index_select``)
  and an explicit mask.
- ``kernel``: ``torch.ops.baton_cpu.prefill_attention`` (``csrc/prefill_attention.h``),
  which reads every key, the chunk's own included, from the pool.

Prints and writes (``benchmarks/results/prefill_attention_<date>.md``) the median time of
each, its GFLOP/s (causal: only the attended pairs count) and the ratio, with the max
difference between the two outputs.

    python -m benchmarks.prefill_attention [--dtypes bfloat16,float32] [--reps 9]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import markdown_table
from benchmarks.provenance import REPO, header_lines
from engine.forward_context import PrefillSeq
from engine.huge_pages import zeros_on_huge_pages
from engine.kernels.cpu import cpu_kernels
from engine.layers.attention import PagedAttention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# (tokens cached before the chunk, chunk tokens)
SHAPES = ((0, 260), (0, 512), (1536, 512), (7680, 512))
HEADER = [
    "dtype", "cached", "chunk", "SDPA ms", "SDPA GFLOP/s", "kernel ms", "kernel GFLOP/s",
    "kernel speed-up", "max abs diff",
]  # fmt: skip


def _flops(start: int, n: int) -> int:
    """Multiply-adds x 2 of QK^T and PV over the attended (causal) pairs."""
    pairs = sum(start + i + 1 for i in range(n))
    return pairs * HEADS * HEAD_DIM * 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        sys.exit("the compiled CPU kernels are unavailable here")
    load_before = os.getloadavg()
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for start, n in SHAPES:
            total = start + n
            nblocks = (total + BLOCK - 1) // BLOCK
            pool_blocks = 2 * nblocks + 1
            pool = zeros_on_huge_pages((1, 2, KV_HEADS, pool_blocks, BLOCK, HEAD_DIM), dtype)
            pool.copy_(torch.randn(pool.shape, generator=gen))
            ids = torch.randperm(pool_blocks - 1, generator=gen)[:nblocks] + 1
            q = torch.randn((n, HEADS, HEAD_DIM), generator=gen).to(dtype)
            k_own = pool[0, 0].index_select(1, ids).view(KV_HEADS, -1, HEAD_DIM)[:, start:total]
            v_own = pool[0, 1].index_select(1, ids).view(KV_HEADS, -1, HEAD_DIM)[:, start:total]
            k_own, v_own = k_own.transpose(0, 1).contiguous(), v_own.transpose(0, 1).contiguous()
            attn = PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM)
            seq = PrefillSeq(q_start=0, q_len=n, start=start, block_ids=ids)
            out = torch.empty_like(q)

            def sdpa(q=q, k_own=k_own, v_own=v_own, pool=pool, seq=seq, attn=attn) -> torch.Tensor:
                return attn._prefill(q, k_own, v_own, pool[0, 0], pool[0, 1], seq)

            def kernel(q=q, pool=pool, ids=ids, start=start, out=out, attn=attn) -> torch.Tensor:
                kernels.ops.prefill_attention(out, q, pool, 0, ids, start, attn.scale, 0)
                return out

            diff = (sdpa().float() - kernel().float()).abs().max().item()
            times: dict[str, list[float]] = {"sdpa": [], "kernel": []}
            with torch.inference_mode():
                for _ in range(args.reps):
                    for label, fn in (("sdpa", sdpa), ("kernel", kernel)):
                        began = time.perf_counter()
                        fn()
                        times[label].append(time.perf_counter() - began)
            med = {label: statistics.median(ts) for label, ts in times.items()}
            flops = _flops(start, n)
            rows.append(
                [
                    name, str(start), str(n),
                    f"{med['sdpa'] * 1e3:.2f}", f"{flops / med['sdpa'] / 1e9:.0f}",
                    f"{med['kernel'] * 1e3:.2f}", f"{flops / med['kernel'] / 1e9:.0f}",
                    f"{med['sdpa'] / med['kernel']:.2f}", f"{diff:.2g}",
                ]
            )  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    load_after = os.getloadavg()
    command = "python -m benchmarks.prefill_attention " + " ".join(sys.argv[1:])
    lines = [
        "# Prefill attention: compiled kernel over the paged pool against torch SDPA",
        "",
        *header_lines(command, torch.get_num_threads(), load_before, load_after),
        "",
        f"One layer, {HEADS} query heads on {KV_HEADS} KV heads of {HEAD_DIM} (SmolLM2-135M), "
        f"block size {BLOCK}, shuffled block ids on a huge-page pool; {args.reps} reps each, "
        "interleaved; medians. GFLOP/s counts the attended (causal) pairs only.",
        "",
        markdown_table(HEADER, rows),
        "",
    ]
    report = "\n".join(lines)
    print(report)
    out_path = args.out or (
        REPO / "benchmarks" / "results" / f"prefill_attention_{dt.date.today()}.md"
    )
    out_path.write_text(report)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
