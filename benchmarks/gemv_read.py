"""Batch-1 linear layers of a whole model: the GEMV kernel on small pages and on huge
pages, against torch's own linear and a plain read of memory, interleaved.

A batch-1 decode step streams every weight once, so its linear layers can go no faster
than memory reads. This lays out SmolLM2-135M's linear weights (30 layers of qkv, o,
gate_up and down, then the 49152-row LM head; random values, the model's shapes and
dtype) twice: as ordinary tensors (4 KiB pages) and in one ``engine.huge_pages``
arena, as the engine holds them. Each rep runs, in turn:

- ``gemv 4k`` / ``gemv huge``: the compiled GEMV (``torch.ops.baton_cpu.linear_bf16``,
  the engine's ``gemv`` route) over every weight, one row of input;
- ``torch huge``: ``torch.nn.functional.linear`` (oneDNN/MKL) over the same weights;
- ``read``: an int64 sum over as many bytes (what ``benchmarks.w1_offline`` calls the
  read bound).

Prints and writes (``benchmarks/results/gemv_read_<date>_<host kind>.md``) the median GB/s of each,
each one's share of the read, and the huge/4k ratio.

    python -m benchmarks.gemv_read [--reps 25] [--rows 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import interleaved_times, markdown_table
from benchmarks.provenance import header_lines, publish
from engine.huge_pages import HugePageArena, huge_page_bytes
from engine.kernels.cpu import cpu_kernels

LAYERS, HIDDEN, INTERMEDIATE, VOCAB = 30, 576, 1536, 49152
LAYER_SHAPES = ((960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))
HEADER = ["pass", "median ms", "median GB/s", "spread GB/s", "share of read"]


def _weights() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [s for _ in range(LAYERS) for s in LAYER_SHAPES] + [(VOCAB, HIDDEN)]
    return [(0.05 * torch.randn(s, generator=gen)).bfloat16() for s in shapes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--rows", type=int, default=1, help="rows of input (1: batch-1 decode)")
    args = ap.parse_args()
    kernels = cpu_kernels()
    if kernels is None or not kernels.bf16_dot:
        sys.exit("the compiled GEMV needs the CPU kernels with AVX512-BF16 here")
    small = _weights()
    arena = HugePageArena.for_tensors(small)
    if arena is None:
        sys.exit("huge pages are off here (THP mode or BATON_HUGE_PAGES=0)")
    huge = [arena.place(w) for w in small]
    nbytes = sum(w.numel() * w.element_size() for w in small)
    gen = torch.Generator().manual_seed(1)
    xs = {k: torch.randn((args.rows, k), generator=gen).bfloat16() for k in (HIDDEN, INTERMEDIATE)}
    src = torch.ones(nbytes // 8, dtype=torch.int64)
    gemv = kernels.ops.linear_bf16

    def over(fn: Callable, ws: list[torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for w in ws:
                fn(xs[w.shape[1]], w, None)

        return run

    passes = {
        "gemv 4k": over(gemv, small),
        "gemv huge": over(gemv, huge),
        "torch huge": over(F.linear, huge),
        "read": lambda: src.sum(),
    }
    for w, h in zip(small[:3], huge[:3], strict=True):  # the layouts compute the same
        assert torch.equal(gemv(xs[w.shape[1]], w, None), gemv(xs[h.shape[1]], h, None))
    load_before = os.getloadavg()
    with torch.inference_mode():
        times = interleaved_times(passes, args.reps)
    load_after = os.getloadavg()
    rate = {name: sorted(nbytes / t / 1e9 for t in ts) for name, ts in times.items()}
    med = {name: statistics.median(r) for name, r in rate.items()}
    rows = [
        [
            name, f"{statistics.median(times[name]) * 1e3:.2f}", f"{med[name]:.1f}",
            f"{rate[name][0]:.1f}-{rate[name][-1]:.1f}", f"{med[name] / med['read']:.2f}",
        ]
        for name in passes
    ]  # fmt: skip
    command = "python -m benchmarks.gemv_read " + " ".join(sys.argv[1:])
    lines = [
        "# Batch-1 linear layers: GEMV on small and huge pages, torch linear, plain read",
        "",
        *header_lines(command, torch.get_num_threads(), load_before, load_after),
        "",
        f"SmolLM2-135M's linear weights in bf16 ({LAYERS} layers and the LM head, "
        f"{nbytes / 1e6:.0f} MB; huge pages under the arena: "
        f"{huge_page_bytes(huge[0]) / 2**20:.0f} MiB), {args.rows} input row(s); "
        f"{args.reps} reps, each pass in turn; medians.",
        "",
        markdown_table(HEADER, rows),
        "",
        f"gemv huge / gemv 4k: {med['gemv huge'] / med['gemv 4k']:.2f}x; "
        f"gemv huge / torch huge: {med['gemv huge'] / med['torch huge']:.2f}x.",
        "",
    ]
    publish("\n".join(lines), "gemv_read")


if __name__ == "__main__":
    main()
