"""Decode attention: this tree's compiled kernel against an earlier revision's, interleaved.

Builds ``engine/kernels/csrc/attention.h`` (and the ``vec16.h`` it includes) as it was at
``--against`` into a small extension of its own, next to the engine's build of this tree,
and times both on the decode rows of a W1-sized step: SmolLM2-135M's 30 layers (9 query
heads on 3 KV heads of 64), 64 rows with contexts of 200-900 tokens, on a huge-page pool.
Two block layouts: ``contiguous`` (each sequence's blocks in a run, as a fresh pool hands
them out) and ``shuffled`` (anywhere in the pool, as in a long-running server). A plain
read of as many bytes (an int64 sum) runs in the same reps, as the bound.

Prints and writes (``benchmarks/results/decode_attention_<date>_<host kind>.md``) the median step
time, the K+V bytes read per second, each one's speed-up over ``--against`` and the max
difference between the two outputs.

    python -m benchmarks.decode_attention --against REV [--dtypes bfloat16,float32] [--reps 15]
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import markdown_table
from benchmarks.provenance import REPO, header_lines, publish
from engine.huge_pages import zeros_on_huge_pages
from engine.kernels.cpu import cpu_kernels, cxx_flags

LAYERS, KV_HEADS, HEADS, HEAD_DIM, BLOCK, ROWS = 30, 3, 9, 64, 16, 64
HEADER = [
    "dtype", "blocks", "kernel", "step ms", "K+V GB/s", "share of read", "speed-up",
    "max abs diff",
]  # fmt: skip
REGISTER = """#include "attention.h"
TORCH_LIBRARY(baton_cpu_against, m) {
  m.def("decode_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, int layer, "
        "Tensor block_tables, Tensor context_lens, float scale, int window=0, int split=0) -> ()");
}
TORCH_LIBRARY_IMPL(baton_cpu_against, CPU, m) {
  m.impl("decode_attention", &baton_kernels::decode_attention);
}
"""


def _build_against(rev: str, where: Path) -> Callable:
    """``decode_attention`` as revision ``rev`` had it, compiled as this tree's is."""
    from torch.utils.cpp_extension import include_paths, library_paths

    for name in ("attention.h", "vec16.h"):
        text = subprocess.run(
            ["git", "show", f"{rev}:engine/kernels/csrc/{name}"],
            cwd=REPO, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        (where / name).write_text(text)
    (where / "against.cpp").write_text(REGISTER)
    library = where / "against.so"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    subprocess.run(
        [
            os.environ.get("CXX", "c++"), *cxx_flags(), f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in include_paths()), str(where / "against.cpp"),
            *(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu", "-o", str(library),
        ],
        check=True,
    )  # fmt: skip
    torch.ops.load_library(str(library))
    return torch.ops.baton_cpu_against.decode_attention


def _tables(lens: list[int], shuffled: bool) -> tuple[torch.Tensor, int]:
    counts = [(n + BLOCK - 1) // BLOCK for n in lens]
    order = list(range(sum(counts)))
    if shuffled:
        random.Random(1).shuffle(order)
    tables = torch.zeros(len(lens), max(counts), dtype=torch.long)
    used = 0
    for b, n in enumerate(counts):
        tables[b, :n] = torch.tensor(order[used : used + n])
        used += n
    return tables, used


def _measure(
    kernel: dict[str, Callable], against: str, name: str, layout: str, lens: list[int], reps: int
) -> list[list[str]]:
    """The table rows of one (dtype, block layout): each kernel and the plain read."""
    dtype = getattr(torch, name)
    tables, blocks = _tables(lens, layout == "shuffled")
    pool = zeros_on_huge_pages((LAYERS, 2, KV_HEADS, blocks, BLOCK, HEAD_DIM), dtype)
    pool.normal_()
    q = torch.randn(ROWS, HEADS, HEAD_DIM).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.long)
    outs = {label: torch.empty_like(q) for label in kernel}
    nbytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * pool.element_size() * LAYERS
    src = torch.ones(nbytes // 8, dtype=torch.int64)

    def step(label: str) -> None:
        for layer in range(LAYERS):
            kernel[label](outs[label], q, pool, layer, tables, ctx, HEAD_DIM**-0.5, 0, 0)

    passes = {label: functools.partial(step, label) for label in kernel}
    passes["read"] = src.sum
    times: dict[str, list[float]] = {label: [] for label in passes}
    for fn in passes.values():
        fn()  # warm-up
    for _ in range(reps):
        for label, fn in passes.items():
            began = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - began)
    med = {label: statistics.median(ts) for label, ts in times.items()}
    diff = (outs["this tree"].float() - outs[against].float()).abs().max().item()
    rows = []
    for label in passes:
        rows.append(
            [
                name, layout, label, f"{med[label] * 1e3:.1f}", f"{nbytes / med[label] / 1e9:.1f}",
                f"{med['read'] / med[label]:.2f}",
                f"{med[against] / med[label]:.2f}" if label != "read" else "-",
                f"{diff:.2g}" if label == "this tree" else "-",
            ]
        )  # fmt: skip
        print(" | ".join(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="git revision of the kernel to compare")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        sys.exit("the compiled CPU kernels are unavailable here")
    rng = random.Random(0)
    lens = [rng.randint(200, 900) for _ in range(ROWS)]
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        against = _build_against(args.against, Path(tmp))
        kernel = {"this tree": kernels.ops.decode_attention, args.against: against}
        for name in args.dtypes.split(","):
            for layout in ("contiguous", "shuffled"):
                rows += _measure(kernel, args.against, name, layout, lens, args.reps)
    load_after = os.getloadavg()
    command = "python -m benchmarks.decode_attention " + " ".join(sys.argv[1:])
    lines = [
        f"# Decode attention: this tree's kernel against {args.against}'s",
        "",
        *header_lines(command, torch.get_num_threads(), load_before, load_after),
        "",
        f"{ROWS} decode rows, contexts 200-900 tokens ({sum(lens)} in all), {LAYERS} layers of "
        f"{HEADS} query heads on {KV_HEADS} KV heads of {HEAD_DIM}, block size {BLOCK}, pool on "
        f"huge pages; {args.reps} reps, each pass in turn; medians. read: an int64 sum over "
        "as many bytes as the step's K and V.",
        "",
        markdown_table(HEADER, rows),
        "",
    ]
    publish("\n".join(lines), "decode_attention")


if __name__ == "__main__":
    main()
