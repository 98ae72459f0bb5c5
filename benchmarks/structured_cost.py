"""What constrained decoding costs the engine: W1 with a quarter of its requests under a
JSON schema, against the same requests all free, on one ``EngineCore`` (SmolLM2-135M).

Every request ignores EOS and runs its W1 ``output_len``, so both modes generate the
same number of tokens (a constrained request whose JSON is complete may only write EOS
until then): the difference in output tok/s is the constraint's cost (masks, matcher
steps, the sampler's masked rows), not a change in work. Modes alternate, ``--runs``
times each, in one process after one untimed warm-up of each; the report gives medians
and the machine's load average, and is written to ``benchmarks/results/``.

    python -m benchmarks.structured_cost [--limit N] [--runs 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
from pathlib import Path

from benchmarks import common, provenance
from benchmarks.grammar_choice import SCHEMA
from engine.config import EngineConfig
from engine.constraint import Constraint, ConstraintKind
from engine.engine_core import EngineCore
from engine.model_files import resolve_model
from engine.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parent.parent
CONSTRAINT = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))


def _params(max_tokens: int, constrained: bool) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0,
        ignore_eos=True,
        constraint=CONSTRAINT if constrained else None,
    )


def run_w1(core: EngineCore, requests: list[common.W1Request], every: int, tag: str) -> float:
    """Output tok/s of one W1 pass; request i is constrained when ``every`` divides i."""
    t0 = time.perf_counter()
    for i, r in enumerate(requests):
        constrained = every > 0 and i % every == 0
        params = _params(r.output_len, constrained)
        core.add_request(core.make_request(f"{tag}-{r.request_id}", r.prompt_token_ids, params))
    tokens = 0
    while core.has_work():
        for out in core.step():
            tokens += len(out.new_token_ids)
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--workload", type=Path, default=common.DEFAULT_WORKLOAD)
    args = parser.parse_args()
    requests = common.load_workload(args.workload, args.limit)
    load_before = os.getloadavg()
    files = resolve_model("smollm2-135m")
    core = EngineCore(
        EngineConfig(model=str(files.path), dtype=args.dtype, kv_cache_bytes=2 * 2**30),
        show_progress=False,
    )
    modes = {"free": 0, "quarter constrained": 4}
    for name, every in modes.items():  # warm-up: first calls, the schema's compile
        run_w1(core, requests[:8], every, f"warm-{name}")
    results: dict[str, list[float]] = {name: [] for name in modes}
    loads = []
    for run in range(args.runs):
        for name, every in modes.items():
            results[name].append(run_w1(core, requests, every, f"{run}-{name}"))
            loads.append(os.getloadavg()[0])
    free = statistics.median(results["free"])
    rows = []
    for name, values in results.items():
        median = statistics.median(values)
        spread = f"{min(values):.1f}–{max(values):.1f}"
        rows.append([name, str(len(values)), f"{median:.1f}", spread, f"{median / free:.3f}"])
    guided = core.runner.guided
    today = dt.date.today().isoformat()
    command = "python -m benchmarks.structured_cost " + " ".join(
        f"--{k} {v}"
        for k, v in (("limit", args.limit), ("runs", args.runs), ("dtype", args.dtype))
        if v is not None
    )
    lines = [
        f"# Constrained decoding cost, W1 ({len(requests)} requests), {args.dtype}",
        "",
        *provenance.header_lines(
            command, core.runner.compute.num_threads(), load_before, os.getloadavg()
        ),
        f"Load average (1 min) after each run: {', '.join(f'{x:.1f}' for x in loads)}.",
        f"Schema: `benchmarks/grammar_choice.py` SCHEMA; every 4th request constrained; "
        f"masked rows {guided.num_masked_rows}, of which filled ahead {guided.num_masks_ahead}.",
        "",
        common.markdown_table(["mode", "runs", "output tok/s (median)", "spread", "vs free"], rows),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    out = REPO / "benchmarks" / "results" / f"structured_cost_{today}_{args.dtype}.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
