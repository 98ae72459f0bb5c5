"""Where a batch-1 decode step's time goes: the whole step against its linear layers
alone and against a plain read of the same bytes, interleaved in one engine process.

Loads the bundled model in the engine (``EngineCore``, the dtype's defaults), starts one
request (a 256-token prompt) and then, rep after rep, times in turn:

- ``step``: one ``EngineCore.step()`` of that stream (forward, LM head, sampling, update);
- ``linears``: the panel kernel over every weight the step reads (each layer's qkv, o,
  gate_up and down, then the LM head), on the engine's own panels, one input row;
- one pass per linear kind (``qkv`` ... ``lm head``), the same calls split by kind;
- ``read``: a plain read of as many bytes as all those weights (``MemoryReader``).

Every pass runs on the runner's compute thread, whose OpenMP team the step uses. So
``step - linears`` is what the step spends beside its weight reads (norms, attention,
sampling, Python), and each kind's GB/s against its size shows the fixed cost per call
that small layers pay. Writes ``benchmarks/results/step_linears_<date>_<dtype>_<host>.md``.

    python -m benchmarks.step_linears [--dtype bfloat16] [--reps 30]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from collections.abc import Callable

import torch

from benchmarks.common import MemoryReader, interleaved_times, markdown_table
from benchmarks.provenance import header_lines, publish
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.kernels.cpu import cpu_kernels
from engine.sampling_params import SamplingParams

KINDS = ("qkv", "o", "gate_up", "down")
HEADER = ["pass", "calls", "MB", "median ms", "GB/s", "us per call", "share of step"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--reps", type=int, default=30)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if not 1 <= args.reps <= 700:
        sys.exit(f"--reps must be in [1, 700], got {args.reps}")
    kernels = cpu_kernels()
    if kernels is None:
        sys.exit("this needs the compiled CPU kernels")
    core = EngineCore(
        EngineConfig(model="smollm2-135m", dtype=args.dtype, max_model_len=1024),
        show_progress=False,
    )
    model = core.runner.model
    stack = model.model.decode_stack
    head = model.lm_head
    if stack is None or head.panels is None or any(p is None for p in stack.packed[4]):
        sys.exit("the engine runs no fused decode stack on panels here (see its kernel routes)")
    ops = kernels.ops
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    weights = dict(zip(KINDS, (stack.qkv, stack.o, stack.gate_up, stack.down), strict=True))
    widths = {w.shape[1] for ws in weights.values() for w in ws} | {head.weight.shape[1]}
    xs = {k: torch.randn((1, k), generator=gen).to(dtype) for k in widths}
    panels = dict(zip(KINDS, stack.packed[4:8], strict=True))

    def kind_pass(kind: str) -> Callable[[], None]:
        def run() -> None:
            for w, p in zip(weights[kind], panels[kind], strict=True):
                ops.linear_panels(xs[w.shape[1]], p, w.shape[0], None)

        return run

    def head_pass() -> None:
        ops.linear_panels(xs[head.weight.shape[1]], head.panels, head.weight.shape[0], None)

    def all_linears() -> None:
        for kind in KINDS:
            kind_pass(kind)()
        head_pass()

    sizes = {k: sum(w.numel() * w.element_size() for w in weights[k]) for k in KINDS}
    sizes["lm head"] = head.weight.numel() * head.weight.element_size()
    calls = {k: len(weights[k]) for k in KINDS} | {"lm head": 1}
    total = sum(sizes.values())
    # On the compute thread, like every pass: a second OpenMP team would throttle its.
    reader = core.runner.compute.call(MemoryReader, max(1, total // 2**20))
    prompt = [random.Random(0).randrange(1000, 40000) for _ in range(256)]
    params = SamplingParams(max_tokens=1024 - 256, ignore_eos=True)
    core.add_request(core.make_request("single", prompt, params))
    core.step()  # the prefill
    passes: dict[str, Callable[[], object]] = {
        "step": core.step,
        "linears": lambda: core.runner.compute.call(all_linears),
        **{k: (lambda k=k: core.runner.compute.call(kind_pass(k))) for k in KINDS},
        "lm head": lambda: core.runner.compute.call(head_pass),
        "read": lambda: core.runner.compute.call(lambda: reader.rates(1)),
    }
    load_before = os.getloadavg()
    with torch.inference_mode():
        times = interleaved_times(passes, args.reps)
    load_after = os.getloadavg()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    nbytes = {"step": total, "linears": total, "read": total} | sizes
    ncalls = {"step": 1, "linears": sum(calls.values()), "read": 1} | calls
    rows = [
        [
            name, str(ncalls[name]), f"{nbytes[name] / 1e6:.1f}", f"{med[name] * 1e3:.2f}",
            f"{nbytes[name] / med[name] / 1e9:.1f}", f"{med[name] / ncalls[name] * 1e6:.0f}",
            f"{med[name] / med['step']:.2f}",
        ]
        for name in passes
    ]  # fmt: skip
    command = "python -m benchmarks.step_linears " + " ".join(argv)
    lines = [
        f"# A batch-1 decode step against its linear layers and a plain read ({args.dtype})",
        "",
        *header_lines(command, torch.get_num_threads(), load_before, load_after),
        "",
        f"SmolLM2-135M (bundled) in the engine, one stream (256-token prompt); the engine's "
        f"kernel routes: {', '.join(f'{k}={v}' for k, v in core.stats().cpu_kernel_routes)}. "
        f"{args.reps} reps, every pass in turn each rep, on the runner's compute thread; "
        "medians. GB/s: the pass's weight bytes (all of them for step, linears and read) over "
        "its time.",
        "",
        markdown_table(HEADER, rows),
        "",
        f"step beside its linear layers: {(med['step'] - med['linears']) * 1e3:.2f} ms; "
        f"linears / read: {med['linears'] / med['read']:.2f}x the time; "
        f"step / read: {med['step'] / med['read']:.2f}x.",
        "",
    ]
    publish("\n".join(lines), "step_linears", f"_{args.dtype}")


if __name__ == "__main__":
    main()
