"""Where W1's time goes, step by step, in the synchronous and the asynchronous engine.

Runs W1 (or its first ``--limit`` requests) through ``EngineCore.step()`` and through
``AsyncEngine`` in one process, alternating the modes ``--repeats`` times so that noise
from other work on the machine hits both alike, with ``benchmarks.step_probe`` timing
every phase of every step. With ``--breakdown`` one more run per mode splits the forward
into attention, linear layers, logits and the rest (module hooks: shares, not totals).

It prints a markdown report and writes it to ``--out`` (default
``benchmarks/results/w1_profile_<date>[_limitN].md``) with the command, date, git revision,
machine and load average.

    python -m benchmarks.w1_profile [--limit 24] [--dtype bfloat16] [--repeats 2]
        [--breakdown] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import common, provenance
from benchmarks.step_probe import SPLITS, StepProbe, StepRecord, thread_cpu_seconds

REPO = Path(__file__).resolve().parent.parent


@dataclass(slots=True)
class ProfiledRun:
    mode: str
    wall_s: float
    output_tokens: int
    steps: list[StepRecord]
    thread_cpu_s: dict[str, float]
    load_before: float
    load_after: float


def _params(max_tokens: int) -> Any:
    from engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _run_sync(core: Any, requests: list[common.W1Request], probe: StepProbe) -> float:
    probe.attach(core)
    try:
        t0 = time.perf_counter()
        for r in requests:
            core.add_request(
                core.make_request(r.request_id, r.prompt_token_ids, _params(r.output_len))
            )
        while core.has_work():
            core.step()
        return time.perf_counter() - t0
    finally:
        probe.detach()


async def _run_async(
    core: Any,
    requests: list[common.W1Request],
    probe: StepProbe,
    cpu_end: dict[str, float],
    overlap: bool,
) -> float:
    from engine.async_engine import AsyncEngine

    engine = AsyncEngine(core, overlap=overlap)
    await engine.start()

    async def collect(rid: str, prompt: list[int], max_tokens: int) -> int:
        n = 0
        async for out in engine.generate(rid, prompt, _params(max_tokens)):
            n += len(out.new_token_ids)
        return n

    try:
        await collect("warmup-async", common.warmup_prompt(), common.WARMUP_NEW_TOKENS)
        probe.attach(core, engine if overlap else None)
        t0 = time.perf_counter()
        await asyncio.gather(
            *(collect(r.request_id, r.prompt_token_ids, r.output_len) for r in requests)
        )
        wall = time.perf_counter() - t0
        cpu_end.update(thread_cpu_seconds())  # before shutdown ends the engine's threads
        return wall
    finally:
        probe.detach()
        await engine.shutdown()


def profile_once(
    core: Any, mode: str, requests: list[common.W1Request], breakdown: bool
) -> ProfiledRun:
    """One timed W1 pass in ``mode`` on a warmed-up core whose prefix cache is empty."""
    core.pool.reset_prefix_cache()
    probe = StepProbe(breakdown=breakdown)
    load0 = os.getloadavg()[0]
    cpu0 = thread_cpu_seconds()
    cpu1: dict[str, float] = {}
    if mode == "sync":
        wall = _run_sync(core, requests, probe)
        cpu1 = thread_cpu_seconds()
    else:
        wall = asyncio.run(_run_async(core, requests, probe, cpu1, overlap=mode == "async"))
    threads = {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items() if v - cpu0.get(k, 0.0) > 0.01}
    steps = sorted((s for s in probe.steps.values() if s.num_seqs), key=lambda s: s.step_id)
    return ProfiledRun(
        mode=mode,
        wall_s=wall,
        output_tokens=sum(r.output_len for r in requests),
        steps=steps,
        thread_cpu_s=threads,
        load_before=load0,
        load_after=os.getloadavg()[0],
    )


# -- the report -----------------------------------------------------------------------

STEP_PHASES = ("schedule", "prepare", "forward", "sample", "update", "publish", "wait")


def in_flight_seconds(steps: list[StepRecord]) -> float:
    """Wall seconds with some forward running (the union of the forward spans)."""
    spans = sorted(s.forward_span for s in steps if s.forward_span)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _kind_rows(run: ProfiledRun) -> list[list[str]]:
    rows = []
    kinds = (("with prefill", True), ("decode only", False))
    for name, prefill in kinds:
        steps = [s for s in run.steps if s.has_prefill == prefill]
        if not steps:
            continue
        row = [
            run.mode, name, str(len(steps)), str(sum(s.num_tokens for s in steps)),
            f"{statistics.mean(s.num_seqs for s in steps):.1f}",
        ]  # fmt: skip
        for phase in STEP_PHASES:
            total = sum(s.wall.get(phase, 0.0) for s in steps)
            row.append(f"{total:.2f}" if total else "-")
        fwd = [s.wall.get("forward", 0.0) for s in steps]
        row.append(f"{1e3 * statistics.mean(fwd):.1f}")
        row.append(str(sum(s.forward_preempted for s in steps)))
        rows.append(row)
    return rows


KIND_HEADERS = (
    "mode",
    "steps",
    "count",
    "tokens",
    "seqs/step",
    *(f"{p} s" for p in STEP_PHASES),
    "forward ms/step",
    "forward preempted",
)
SUMMARY_HEADERS = (
    "mode",
    "wall s",
    "output tok/s",
    "busy (forward in flight / wall)",
    "runner idle s",
    "engine CPU s",
    "runner CPU s",
    "asyncio CPU s",
    "other threads CPU s",
    "process CPU / (2 x wall)",
    "load before/after",
)


def _thread_groups(run: ProfiledRun) -> dict[str, float]:
    groups = {"engine": 0.0, "runner": 0.0, "main": 0.0, "other": 0.0}
    for key, cpu in run.thread_cpu_s.items():
        name = key.rsplit(":", 1)[0]
        if name == "engine":
            groups["engine"] += cpu
        elif name.startswith("runner"):
            groups["runner"] += cpu
        elif name == "MainThread":
            groups["main"] += cpu
        else:
            groups["other"] += cpu
    return groups


def summary_row(run: ProfiledRun) -> list[str]:
    busy = in_flight_seconds(run.steps)
    runner_work = sum(
        s.wall.get(p, 0.0) for s in run.steps for p in ("prepare", "forward", "sample")
    )
    g = _thread_groups(run)
    # The forward runs on the runner's compute thread in every mode; in sync mode the
    # main thread is the engine loop.
    runner_cpu = f"{g['runner']:.2f}"
    if run.mode == "sync":
        engine_cpu, loop_cpu = f"{g['main']:.2f}", "-"
    else:
        engine_cpu, loop_cpu = f"{g['engine']:.2f}", f"{g['main']:.2f}"
    total_cpu = sum(g.values())
    return [
        run.mode, f"{run.wall_s:.2f}", f"{run.output_tokens / run.wall_s:.1f}",
        f"{busy / run.wall_s:.3f}", f"{run.wall_s - runner_work:.2f}", engine_cpu, runner_cpu,
        loop_cpu, f"{g['other']:.2f}", f"{total_cpu / (2 * run.wall_s):.2f}",
        f"{run.load_before:.2f} / {run.load_after:.2f}",
    ]  # fmt: skip


def breakdown_rows(run: ProfiledRun) -> list[list[str]]:
    rows = []
    for name, prefill in (("with prefill", True), ("decode only", False)):
        steps = [s for s in run.steps if s.has_prefill == prefill]
        fwd = sum(s.wall.get("forward", 0.0) for s in steps)
        if not fwd:
            continue
        parts = {p: sum(s.wall.get(p, 0.0) for s in steps) for p in SPLITS}
        rest = fwd - sum(parts.values())
        rows.append([
            run.mode, name, f"{fwd:.2f}",
            *(f"{parts[p]:.2f} ({100 * parts[p] / fwd:.0f}%)" for p in SPLITS),
            f"{rest:.2f} ({100 * rest / fwd:.0f}%)",
        ])  # fmt: skip
    return rows


BREAKDOWN_HEADERS = ("mode", "steps", "forward s", *(f"{p} s" for p in SPLITS), "rest s")


def render(runs: list[ProfiledRun], breakdowns: list[ProfiledRun], header: list[str]) -> str:
    parts = [*header, "", "Whole runs (each line one pass; modes alternate):", ""]
    parts.append(common.markdown_table(SUMMARY_HEADERS, [summary_row(r) for r in runs]))
    parts += ["", "Per step kind, summed over the step (seconds of wall time per phase):", ""]
    rows = [row for r in runs for row in _kind_rows(r)]
    parts.append(common.markdown_table(KIND_HEADERS, rows))
    if breakdowns:
        parts += ["", "Forward split by module hooks (a separate pass per mode):", ""]
        rows = [row for r in breakdowns for row in breakdown_rows(r)]
        parts.append(common.markdown_table(BREAKDOWN_HEADERS, rows))
    parts += [
        "",
        "- busy: wall seconds with a forward (model + logits) running, over wall; the same"
        " probe in both modes.",
        "- runner idle: wall minus the runner's prepare + forward + sample: in sync mode the"
        " loop's own schedule/update time, in async mode the runner waiting for the engine"
        " thread.",
        "- wait: the engine thread blocked on the runner's future (async).",
        "- forward preempted: involuntary context switches of the forward's thread during"
        " forwards (another thread took its core).",
        "- CPU columns: per-thread user + system seconds from /proc; 'other' is torch's"
        " OpenMP workers and the thread pools.",
    ]
    return "\n".join(parts) + "\n"


def _core(model: str, dtype: str, threads: int, kv_gib: float, max_model_len: int) -> Any:
    from engine.config import EngineConfig
    from engine.engine_core import EngineCore
    from engine.model_files import resolve_model

    cfg = EngineConfig(
        model=str(resolve_model(model).path),
        dtype=dtype,
        kv_cache_bytes=int(kv_gib * 2**30),
        max_model_len=max_model_len,
        num_threads=threads,
    )
    core = EngineCore(cfg, show_progress=False)
    core.warm_up()
    return core


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.w1_profile", description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workload", type=Path, default=common.DEFAULT_WORKLOAD)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--kv-gib", type=float, default=4.0)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2, help="passes per mode, alternating")
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["sync", "async"],
        choices=["sync", "async", "async-serial"],
        help="async-serial: AsyncEngine(overlap=False), the loop on the compute thread",
    )
    ap.add_argument("--breakdown", action="store_true", help="one more pass with module hooks")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    requests = common.load_workload(args.workload, args.limit)
    started = dt.datetime.now()
    load0 = os.getloadavg()
    core = _core(args.model, args.dtype, args.threads, args.kv_gib, args.max_model_len)
    runs = [
        profile_once(core, mode, requests, breakdown=False)
        for _ in range(args.repeats)
        for mode in args.modes
    ]
    breakdowns = (
        [profile_once(core, mode, requests, breakdown=True) for mode in args.modes]
        if args.breakdown
        else []
    )
    command = "python -m benchmarks.w1_profile " + " ".join(sys.argv[1:] if argv is None else argv)
    header = [
        f"# W1 step profile, {args.dtype}, {len(requests)} requests, {started:%Y-%m-%d %H:%M}",
        "",
        *provenance.header_lines(command, args.threads, load0, os.getloadavg()),
    ]
    text = render(runs, breakdowns, header)
    print(text, flush=True)
    suffix = f"_limit{args.limit}" if args.limit else ""
    out = args.out or REPO / "benchmarks" / "results" / (
        f"w1_profile_{started:%Y-%m-%d}_{args.dtype}{suffix}.md"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return text


if __name__ == "__main__":
    main()
