"""Decode-sized linear layers: the panel kernel against oneDNN's prepacked matmul, interleaved.

Builds SmolLM2-135M's 120 decoder weights (30 layers of qkv, o, gate_up, down; random
values, timing does not depend on them), each a separate tensor, so a pass over them
reads them from DRAM as a decode step does, and times one pass (every weight once, in
layer order) for each row count:

- ``onednn``: ``ops.linear`` with the oneDNN-prepacked weight (``pack_linear_weight``), the
  production path before the panels (and the bf16 GEMV kernel up to ``GEMV_MAX_ROWS``);
- ``panels``: ``ops.linear`` with the panel-packed weight (``pack_panels``) on the
  ``panels`` route at every row count (bf16 pair panels where the build has the bf16 dot
  product, else fp32 panels).

With ``--prefetch 0,1,2,4`` it also times the panels at each of those rates of software
prefetch (cache lines of the next panel per k of the current one; the kernel's own
rate, ``prefetch_lines_per_k``, is the ``panels`` column): the figures behind that rate.

The variants alternate pass by pass, so noise from other work hits both alike. Prints
the median pass time of each, GFLOP/s and the ratio; writes a markdown report to
``benchmarks/results/panel_linear_<date>_<dtype>_<host kind>.md`` with the command, date, revision,
machine and load.

    python -m benchmarks.panel_linear [--dtype float32] [--rows 1 8 26 64] [--reps 15]
        [--prefetch 0,1,2,4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import markdown_table
from benchmarks.provenance import header_lines, publish
from engine.kernels import ops
from engine.kernels.cpu import cpu_kernels

LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 30, 576, 1536, 9, 3, 64
SHAPES = (  # (N, K) of qkv, o, gate_up, down
    ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    (HIDDEN, HEADS * HEAD_DIM),
    (2 * INTERMEDIATE, HIDDEN),
    (HIDDEN, INTERMEDIATE),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 26, 40, 64, 96])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--prefetch", default="", help="rates to time too, e.g. 0,1,2,4")
    args = ap.parse_args()
    rates = [int(r) for r in args.prefetch.split(",") if r.strip()]
    if ops.pack_panels(torch.zeros(64, 64)) is None:
        sys.exit("the compiled CPU kernels are unavailable here")
    built = cpu_kernels()
    assert built is not None
    kernels = built.ops
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    load_before = os.getloadavg()
    weights = [(0.02 * torch.randn(n, k)).to(dtype) for _ in range(LAYERS) for n, k in SHAPES]
    onednn = [ops.pack_linear_weight(w) for w in weights]
    panels = [ops.pack_panels(w) for w in weights]
    flops_per_row = 2 * sum(w.numel() for w in weights)
    rows_out = []
    for m in args.rows:
        inputs = {k: torch.randn(m, k).to(dtype) for _, k in SHAPES}

        def run_onednn(m: int = m, inputs: dict = inputs) -> None:
            for w, p in zip(weights, onednn, strict=True):
                ops.linear(inputs[w.shape[1]], w, None, p)

        def run_panels(m: int = m, inputs: dict = inputs) -> None:
            for w, p in zip(weights, panels, strict=True):
                ops.linear(inputs[w.shape[1]], w, None, None, None, p, route="panels")

        def at_rate(lines: int, run: Callable[[], None] = run_panels) -> Callable[[], None]:
            def timed() -> None:
                kernels.set_panel_prefetch(lines)
                try:
                    run()
                finally:
                    kernels.set_panel_prefetch(-1)

            return timed

        variants = {"onednn": run_onednn, "panels": run_panels}
        variants.update({f"pf{r}": at_rate(r) for r in rates})
        times: dict[str, list[float]] = {name: [] for name in variants}
        for fn in variants.values():
            fn()
        for _ in range(args.reps):
            for name, fn in variants.items():
                began = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - began)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        rows_out.append(
            [
                str(m),
                f"{med['onednn'] * 1e3:.1f}",
                f"{med['panels'] * 1e3:.1f}",
                f"{m * flops_per_row / med['onednn'] / 1e9:.0f}",
                f"{m * flops_per_row / med['panels'] / 1e9:.0f}",
                f"{med['onednn'] / med['panels']:.2f}",
                *(f"{med[f'pf{r}'] * 1e3:.1f}" for r in rates),
            ]
        )
        print(" | ".join(rows_out[-1]), flush=True)
    load_after = os.getloadavg()
    command = "python -m benchmarks.panel_linear " + " ".join(sys.argv[1:])
    weight_mb = sum(w.numel() * w.element_size() for w in weights) / 1e6
    report = "\n".join(
        [
            f"# Decode-sized linear layers, panels against oneDNN ({args.dtype})",
            "",
            *header_lines(command, torch.get_num_threads(), load_before, load_after),
            "",
            f"One pass = SmolLM2-135M's {len(weights)} decoder weights ({weight_mb:.0f} MB in "
            f"{args.dtype}), each once, from DRAM; median of {args.reps} passes a variant, "
            "interleaved.",
            "",
            markdown_table(
                [
                    "rows",
                    "oneDNN ms",
                    "panels ms",
                    "oneDNN GFLOP/s",
                    "panels GFLOP/s",
                    "panels speed-up",
                    *(f"panels ms, {r} lines/k" for r in rates),
                ],
                rows_out,
            ),  # fmt: skip
            "",
        ]
    )
    publish(report, "panel_linear", f"_{args.dtype}", args.out)


if __name__ == "__main__":
    main()
