"""Decode attention over a KV pool on 4 KiB pages against one on huge pages, interleaved.

A long-running server's pool is fragmented: a sequence's blocks sit anywhere in it. This
builds SmolLM2-135M's KV pool (30 layers, 3 KV heads of 64) twice, once as
``torch.zeros`` and once as ``engine.huge_pages.zeros_on_huge_pages``, gives a batch of
decode rows shuffled block tables over it, and times the compiled decode attention of
every layer (``torch.ops.baton_cpu.decode_attention``) on both pools in turn, so noise
from other work hits both alike. Prints the median step time of each pool, the bytes of
K and V read per step over that time, and the ratio; writes a markdown report to
``benchmarks/results/kv_huge_pages_<date>_<dtype>_<host kind>.md`` with the command, date, revision,
machine and load.

    python -m benchmarks.kv_huge_pages [--dtype bfloat16] [--batch 26] [--ctx 350]
        [--pool-gib 2] [--reps 15]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import markdown_table
from benchmarks.provenance import header_lines, publish
from engine.huge_pages import huge_page_bytes, thp_mode, zeros_on_huge_pages
from engine.kernels.cpu import cpu_kernels

LAYERS, KV_HEADS, HEADS, HEAD_DIM, BLOCK = 30, 3, 9, 64, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--batch", type=int, default=26, help="decode rows (W1 averages 25.7)")
    ap.add_argument("--ctx", type=int, default=350, help="mean context; +-200 spread")
    ap.add_argument("--pool-gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        sys.exit("the compiled CPU kernels are unavailable here")
    dtype = getattr(torch, args.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_block = LAYERS * 2 * KV_HEADS * BLOCK * HEAD_DIM * itemsize
    num_blocks = int(args.pool_gib * 2**30) // per_block
    shape = (LAYERS, 2, KV_HEADS, num_blocks, BLOCK, HEAD_DIM)
    rng = random.Random(0)
    lens = torch.tensor(
        [max(1, args.ctx + rng.randint(-200, 200)) for _ in range(args.batch)], dtype=torch.long
    )
    width = int((lens.max() + BLOCK - 1) // BLOCK)
    order = list(range(num_blocks))
    rng.shuffle(order)
    tables = torch.zeros(args.batch, width, dtype=torch.long)
    used = 0
    for b in range(args.batch):
        n = int((lens[b] + BLOCK - 1) // BLOCK)
        tables[b, :n] = torch.tensor(order[used : used + n])
        used += n
    if used > num_blocks:
        sys.exit(f"--pool-gib {args.pool_gib} holds {num_blocks} blocks; the batch needs {used}")
    load_before = os.getloadavg()
    pools = {
        "4 KiB pages (torch.zeros)": torch.zeros(shape, dtype=dtype),
        "huge pages (zeros_on_huge_pages)": zeros_on_huge_pages(shape, dtype),
    }
    for pool in pools.values():
        pool.normal_()
    q = torch.randn(args.batch, HEADS, HEAD_DIM).to(dtype)
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5

    def step(pool: torch.Tensor) -> float:
        began = time.perf_counter()
        for layer in range(LAYERS):
            kernels.ops.decode_attention(out, q, pool, layer, tables, lens, scale, 0)
        return time.perf_counter() - began

    times: dict[str, list[float]] = {name: [] for name in pools}
    for pool in pools.values():
        step(pool)  # warm: the first touch of the q/out buffers and the code
    for _ in range(args.reps):
        for name, pool in pools.items():
            times[name].append(step(pool))
    load_after = os.getloadavg()
    read = int(lens.sum()) * KV_HEADS * HEAD_DIM * 2 * itemsize * LAYERS
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    base = medians["4 KiB pages (torch.zeros)"]
    rows = [
        [
            name,
            f"{huge_page_bytes(pools[name]) >> 20}",
            f"{medians[name] * 1e3:.1f} ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})",
            f"{read / medians[name] / 1e9:.1f}",
            f"{base / medians[name]:.2f}",
        ]
        for name, ts in times.items()
    ]
    command = "python -m benchmarks.kv_huge_pages " + " ".join(sys.argv[1:])
    lines = [
        f"# Decode attention, KV pool on 4 KiB against huge pages ({args.dtype})",
        "",
        *header_lines(command, torch.get_num_threads(), load_before, load_after),
        "",
        f"Pool: {shape} {args.dtype}, {num_blocks * per_block / 2**30:.2f} GiB; THP mode "
        f"`{thp_mode()}`. Batch: {args.batch} decode rows, {int(lens.sum())} tokens of context "
        f"in shuffled blocks; {LAYERS} layers a step; {args.reps} steps a pool, interleaved.",
        "",
        markdown_table(
            ["pool", "huge MiB", "step ms, median (range)", "K+V GB/s", "speed vs 4 KiB"], rows
        ),
        "",
    ]
    publish("\n".join(lines), "kv_huge_pages", f"_{args.dtype}", args.out)


if __name__ == "__main__":
    main()
