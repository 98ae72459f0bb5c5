"""A single stream's decode rate on each route the batch-of-1-4 class may take, in turn in
one engine process: the panels (the decode stack then runs in one OpenMP team,
``csrc/decode_team.h``) against the bf16 GEMV (layer by layer).

The start-up timer (``engine.kernels.route_bench``) times each route on the linear layers
alone; what a step gains from the team is outside its view. This loads the bundled model
in the engine, then, rep after rep and in alternating order, switches the class's route
(``LlamaForCausalLM.set_kernel_routes``, the rest of the engine's own table unchanged) and
decodes one greedy stream (a 256-token prompt), with plain reads of memory right before
and after it (``MemoryReader``, on the compute thread). Separate processes of the same
code differ by more than the routes do on the hosts measured so far, so only an
in-process, interleaved comparison tells them apart. Writes
``benchmarks/results/batch1_routes_<date>_<dtype>_<host>.md``.

    python -m benchmarks.batch1_routes [--dtype bfloat16] [--reps 6] [--tokens 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from benchmarks.common import MemoryReader, fixed_prompt, markdown_table
from benchmarks.provenance import header_lines, publish
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.kernels.cpu import cpu_kernels
from engine.kernels.route_table import GEMV, GEMV_ROWS, PANELS, RouteTable
from engine.sampling_params import SamplingParams

READS = 3  # plain reads on each side of a stream
PROMPT_SEED = 7


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=200)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if not 1 <= args.reps <= 100 or not 2 <= args.tokens <= 1500:
        sys.exit("--reps must be in [1, 100] and --tokens in [2, 1500]")
    kernels = cpu_kernels()
    if kernels is None:
        sys.exit("this needs the compiled CPU kernels")
    # The constants keep every weight copy, so each route finds what it runs on.
    cfg = EngineConfig(
        model="smollm2-135m", dtype=args.dtype, max_model_len=2048, cpu_kernels="default"
    )
    core = EngineCore(cfg, show_progress=False)
    runner, model = core.runner, core.runner.model
    base = dict(core.stats().cpu_kernel_routes)
    routes = [PANELS] + ([GEMV] if args.dtype == "bfloat16" and kernels.bf16_dot else [])
    tables = {
        route: RouteTable(routes={**base, GEMV_ROWS: route}, source="measured") for route in routes
    }
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    reader = runner.compute.call(MemoryReader, 256)
    prompt = fixed_prompt(PROMPT_SEED, 256)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    rates: dict[str, list[float]] = {r: [] for r in routes}
    ratios: dict[str, list[float]] = {r: [] for r in routes}
    teams = dict.fromkeys(routes, 0)
    load_before = os.getloadavg()
    for rep in range(args.reps):
        for route in routes if rep % 2 == 0 else routes[::-1]:
            runner.compute.call(model.set_kernel_routes, tables[route])
            before = kernels.ops.decode_team_runs()
            reads = runner.compute.call(reader.rates, READS)
            core.add_request(core.make_request(f"{route}-{rep}", prompt, params))
            times: list[float] = []
            while core.has_work():
                for out in core.step():
                    times.extend(time.perf_counter() for _ in out.new_token_ids)
            reads += runner.compute.call(reader.rates, READS)
            teams[route] += kernels.ops.decode_team_runs() - before
            rate = (args.tokens - 1) / (times[-1] - times[0])
            rates[route].append(rate)
            ratios[route].append(rate / (statistics.median(reads) / weight_bytes))
    load_after = os.getloadavg()
    first = routes[0]

    def against_first(route: str) -> float:
        return statistics.median(a / b for a, b in zip(rates[route], rates[first], strict=True))

    rows = [
        [
            route,
            "yes" if teams[route] else "no",
            f"{statistics.median(rates[route]):.1f}",
            " / ".join(f"{x:.1f}" for x in rates[route]),
            f"{statistics.median(ratios[route]):.3f}",
            f"{against_first(route):.3f}",
        ]
        for route in routes
    ]
    command = "python -m benchmarks.batch1_routes " + " ".join(argv)
    lines = [
        f"# A single stream on each batch-of-1-4 route, interleaved in one process ({args.dtype})",
        "",
        *header_lines(command, runner.compute.num_threads(), load_before, load_after),
        "",
        f"SmolLM2-135M (bundled) in the engine; one greedy stream of {args.tokens} tokens after "
        f"a 256-token prompt per pass, {args.reps} reps, the routes in alternating order. "
        f"The other classes as the constants route them: "
        f"{', '.join(f'{k}={v}' for k, v in sorted(base.items()) if k != GEMV_ROWS)}. "
        "read bound: the stream's tok/s against the median of plain reads of the weights' "
        f"{weight_bytes / 1e6:.1f} MB right before and after it.",
        "",
        markdown_table(
            [
                "route",
                "team stack",
                "tok/s (median)",
                "tok/s of the reps",
                "of the read bound",
                f"vs {first} (median of the reps' ratios)",
            ],
            rows,
        ),  # fmt: skip
        "",
    ]
    publish("\n".join(lines), "batch1_routes", f"_{args.dtype}")


if __name__ == "__main__":
    main()
