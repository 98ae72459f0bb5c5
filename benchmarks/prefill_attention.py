"""Prefill attention: the compiled kernel over the paged pool against torch SDPA, interleaved.

One layer of SmolLM2-135M's attention (9 query heads on 3 KV heads of 64) for a chunk of
a prompt, at several (cached context, chunk) shapes: a short prompt in one chunk, a full
512-token chunk from scratch, and 512-token chunks after 1.5k and 7.7k cached tokens (the
last chunks of a 2k system prompt and of a prompt near ``max_model_len`` 8192). The pool
is on huge pages with shuffled block ids, as a running server's is.

- ``sdpa``: what the model ran before the kernel and still runs as its torch twin and
  the ``torch`` route (``PagedAttention._prefill``): the chunk's own K/V for a first
  chunk with ``is_causal``; for a later chunk the context gathered from the pool
  (``index_select``) and an explicit mask.
- ``kernel``: the ``flash`` route, ``torch.ops.baton_cpu.prefill_attention``
  (``csrc/prefill_attention.h``), which reads every key, the chunk's own included, from
  the pool.

Both run through the start-up route timer's probe (``engine.layers.attention.prefill_probe``).

Prints and writes (``benchmarks/results/prefill_attention_<date>_<host kind>.md``) the
median time of each, its GFLOP/s (causal: only the attended pairs count) and the ratio, with the max
difference between the two outputs.

    python -m benchmarks.prefill_attention [--dtypes bfloat16,float32] [--reps 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import markdown_table
from benchmarks.provenance import header_lines, publish
from engine.kernels.cpu import cpu_kernels
from engine.kernels.route_table import FLASH, TORCH
from engine.layers.attention import PagedAttention, prefill_probe

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
    attn = PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM)
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for start, n in SHAPES:
            # The route timer's probe, at this shape: the same data on both routes.
            sdpa = prefill_probe(attn, TORCH, n, BLOCK, dtype, cached=start)
            kernel = prefill_probe(attn, FLASH, n, BLOCK, dtype, cached=start)
            if sdpa is None or kernel is None:
                sys.exit(f"the probe cannot run {name} here")
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
    publish("\n".join(lines), "prefill_attention", out=args.out)


if __name__ == "__main__":
    main()
