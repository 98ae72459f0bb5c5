"""More workers on one host: throughput of ``baton serve`` configurations, core plan on/off.

    python -m benchmarks.workers_on_one_host                     # issue 16's table
    python -m benchmarks.workers_on_one_host --configs defaults,decode2 --runs 1

Each configuration is a set of ``baton serve`` flags (``CONFIGS``: ``--single-process``,
the defaults, ``--decode-workers 2``, ``--prefill-workers 2 --decode-workers 2``), run
with the launcher's core plan (``gateway.core_plan``) and lending (``engine.core_lending``),
the defaults, with the plan but ``--no-core-lending``, and with ``--no-core-plan``, one
after the other, so that they see the same machine. A
deployment is started as ``baton serve`` starts it (the same flag parser and
``ClusterSpec``), warmed up with one request, then sent ``--runs`` bursts of
``--streams`` concurrent greedy streams of ``--max-tokens`` tokens each (ignore_eos, so
every stream is that long); wall is the burst's start to its last token, output tok/s
is streams x max tokens / wall, and the table gives the median over the bursts.

The results file (``benchmarks/results/workers_on_one_host_<date>.md`` and ``.json``)
starts with the command, revision, machine, CPU flags that decide kernel speed and load
average (``benchmarks.provenance``), and lists each worker's CPUs and threads under the
plan. On a busy machine (load above ``provenance.BUSY_LOAD_PER_CPU`` per CPU before the
run, or other processes taking more than ``BUSY_CORES`` cores during a deployment, as
``benchmarks.machine_load.LoadWatch`` measures) the file says so: such figures are not
for the README.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common, provenance
from benchmarks.common import W1Request
from benchmarks.machine_load import LoadWatch

# Name -> the `baton serve` flags of that configuration (issue 16's rows).
CONFIGS: dict[str, tuple[str, ...]] = {
    "single": ("--single-process",),
    "defaults": (),
    "decode2": ("--decode-workers", "2"),
    "p2d2": ("--prefill-workers", "2", "--decode-workers", "2"),
}
# Core plan values: the default (plan and lending), the plan without lending
# (--no-core-lending), no plan (--no-core-plan).
PLANS = ("on", "nolend", "off")
PLAN_FLAGS = {"on": (), "nolend": ("--no-core-lending",), "off": ("--no-core-plan",)}
PLAN_NAMES = {"on": "on, lending", "nolend": "on, no lending", "off": "off"}
# Other processes' mean cores during a deployment past which the figures are not quoted.
BUSY_CORES = 0.1
PROMPT_SEED = 1600  # stream i's prompt is fixed_prompt(PROMPT_SEED + i, prompt_len)


def serve_spec(flags: tuple[str, ...], plan: str, opts: argparse.Namespace) -> Any:
    """The ClusterSpec ``baton serve <flags>`` would start (its own parser), on any port."""
    from gateway import cli

    argv = ["serve", "--model", opts.model, "--dtype", opts.dtype, *flags, *PLAN_FLAGS[plan]]
    args = cli._parser().parse_args(argv)
    spec = cli._spec(args, gateway_port=0)
    return dataclasses.replace(spec, start_timeout_s=opts.start_timeout_s)


def burst(opts: argparse.Namespace) -> list[W1Request]:
    return [
        W1Request(f"s{i}", common.fixed_prompt(PROMPT_SEED + i, opts.prompt_len), opts.max_tokens)
        for i in range(opts.streams)
    ]


def run_one(name: str, plan: str, opts: argparse.Namespace) -> dict[str, Any]:
    """Start one deployment, warm it up, time its bursts, stop it."""
    from benchmarks.serving import run_phase
    from engine.cpu_budget import format_cpu_list
    from gateway.launcher import LocalCluster
    from protos.client import AsyncClient

    flags = CONFIGS[name]
    started = time.monotonic()
    with LoadWatch() as watch, LocalCluster(serve_spec(flags, plan, opts)) as cluster:
        startup_s = time.monotonic() - started
        lending = cluster.core_shares is not None
        workers = [
            {
                "kind": p.kind,
                "cpus": format_cpu_list(p.cores.cpus) if p.cores else None,
                "threads": p.cores.threads if p.cores else None,
            }
            for p in cluster.procs
            if p.kind != "gateway"
        ]

        async def drive() -> list[dict[str, Any]]:
            out = []
            async with AsyncClient(cluster.gateway_address) as client:
                warm = W1Request("warmup", common.warmup_prompt(), common.WARMUP_NEW_TOKENS)
                await run_phase(client, "warmup", [warm], None, 0, opts.timeout_s, "warm")
                for run in range(opts.runs):
                    phase = await run_phase(
                        client,
                        "burst",
                        burst(opts),
                        None,
                        0,
                        opts.timeout_s,
                        f"{name}-{plan}-{run}",
                    )
                    out.append(phase.summary())
            return out

        phases = asyncio.run(drive())
    assert watch.summary is not None
    walls = [p["wall_s"] for p in phases]
    wall = statistics.median(walls)
    return {
        "config": name,
        "flags": " ".join(flags) or "(defaults)",
        "core_plan": plan,
        "lending": lending,
        "workers": workers,
        "startup_s": round(startup_s, 1),
        "wall_s": walls,
        "median_wall_s": wall,
        "median_output_tok_s": opts.streams * opts.max_tokens / wall,
        "ttft_p50_s": [p["ttft_p50_s"] for p in phases],
        "outputs_digest": [p["outputs_digest"] for p in phases],
        "others_cores": round(watch.summary.others_cores, 3),
    }


def render(raw: dict[str, Any]) -> str:
    rows = []
    for r in raw["results"]:
        shares = ", ".join(
            f"{w['kind']} {w['cpus']}x{w['threads']}" if w["cpus"] else f"{w['kind']} (all)"
            for w in r["workers"]
        )
        rows.append(
            [
                f"`{r['flags']}`",
                PLAN_NAMES.get(r["core_plan"], r["core_plan"]),
                shares,
                f"{r['median_wall_s']:.1f} s",
                f"{r['median_output_tok_s']:.1f}",
                " / ".join(f"{w:.1f}" for w in r["wall_s"]),
                f"{r['others_cores']:.2f}" if "others_cores" in r else "-",
            ]
        )
    headers = ["`baton serve` flags", "core plan", "workers: cpus x threads", "wall (median)"]
    headers += ["output tok/s", "walls of the runs (s)", "others' cores"]
    lines = [
        "# More workers on one host",
        "",
        *raw["header"][:-1],
        raw["header"][-1] + "  ",
        f"CPU flags: {raw['isa']}  ",
        f"Workload: {raw['streams']} concurrent greedy streams of {raw['max_tokens']} tokens"
        f" (prompts of {raw['prompt_len']} tokens, ignore_eos) through the gateway,"
        f" {raw['dtype']}, model {raw['model']}; median of {raw['runs']} bursts after one"
        " warm-up request.",
        "",
    ]
    if raw["busy"]:
        lines += [
            "**The machine was busy during this run (load average above"
            f" {provenance.BUSY_LOAD_PER_CPU} per CPU before it, or other processes took"
            f" more than {BUSY_CORES} cores during a deployment): not a figure to quote.**",
            "",
        ]
    lines += [common.markdown_table(headers, rows), ""]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.workers_on_one_host", description=__doc__
    )
    p.add_argument("--model", default="smollm2-135m", help="bundled name or checkpoint dir")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"among {list(CONFIGS)}")
    p.add_argument(
        "--plans",
        default=",".join(PLANS),
        help="among on (plan and lending), nolend (plan, --no-core-lending), off",
    )
    p.add_argument("--streams", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--results-dir", type=Path, default=provenance.REPO / "benchmarks" / "results")
    p.add_argument("--tag", default="", help="appended to the results file's name")
    return p


def main(argv: list[str] | None = None) -> Path:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = _parser().parse_args(argv)
    configs = [c.strip() for c in opts.configs.split(",") if c.strip()]
    plans = [p.strip() for p in opts.plans.split(",") if p.strip()]
    if not configs or set(configs) - set(CONFIGS):
        raise ValueError(f"--configs must be among {list(CONFIGS)}, got {opts.configs!r}")
    if not plans or set(plans) - set(PLANS):
        raise ValueError(f"--plans must be among {list(PLANS)}, got {opts.plans!r}")
    for name in ("streams", "max_tokens", "prompt_len", "runs"):
        if getattr(opts, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(opts, name)}")
    command = "python -m benchmarks.workers_on_one_host " + shlex.join(argv)
    load_before = os.getloadavg()
    results = [run_one(c, p, opts) for c in configs for p in plans]
    load_after = os.getloadavg()
    cpus = len(os.sched_getaffinity(0))
    raw = {
        "command": command,
        "header": [
            # Each worker's threads are in the table (the core plan's, or the whole host's).
            line.replace("; 0 torch threads", "")
            for line in provenance.header_lines(command, 0, load_before, load_after)
        ],
        "git_revision": provenance.git_revision(),
        "machine": provenance.machine(),
        "isa": provenance.isa_line(),
        "cpus": cpus,
        # The load average after counts this benchmark's own workers: the load before,
        # and the cores other processes took during each deployment, tell.
        "busy": provenance.is_busy(load_before[0], cpus)
        or any(r["others_cores"] > BUSY_CORES for r in results),
        "load_before": load_before,
        "load_after": load_after,
        **{k: getattr(opts, k) for k in ("model", "dtype", "streams", "max_tokens", "prompt_len")},
        "runs": opts.runs,
        "results": results,
    }
    opts.results_dir.mkdir(parents=True, exist_ok=True)
    slug = provenance.results_slug()
    stem = f"workers_on_one_host_{dt.date.today():%Y-%m-%d}_{opts.dtype}{opts.tag}_{slug}"
    md = opts.results_dir / f"{stem}.md"
    md.write_text(render(raw))
    md.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    print(md.read_text())
    return md


if __name__ == "__main__":
    common.stop_on_sigterm()
    main()
