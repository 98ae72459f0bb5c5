"""baton's side of W1: one engine run inside a child process of the W1 harness.

``python -m benchmarks.baton_w1 --spec JSON --out PATH`` builds an ``EngineCore`` as the
spec says, runs W1 through ``EngineCore.step()`` (``sync``) or ``AsyncEngine`` (``async``,
all requests submitted at once), then, in sync mode, the single-stream figure, and writes
a ``RunResult``. Model load and one warm-up request are never timed. The busy fraction is
the runner's forward seconds (model and logits) over wall, the same probe in both modes.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks import common
from benchmarks.common import RunResult, RunSpec, W1Request

if TYPE_CHECKING:
    from engine.engine_core import EngineCore
    from engine.sampling_params import SamplingParams


# What a deterministic run's mode label ends with (sync-det, async-det).
DETERMINISTIC_SUFFIX = "-det"


def _baton_core(spec: RunSpec) -> EngineCore:
    # Imported here so that the harness process never loads torch for baton.
    from engine.config import EngineConfig
    from engine.engine_core import EngineCore

    cfg = EngineConfig(
        model=spec.model_dir,
        dtype=spec.dtype,
        kv_cache_bytes=int(spec.kv_cache_gib * 2**30),
        max_model_len=spec.max_model_len,
        num_threads=spec.threads,
        cpu_kernels=spec.cpu_kernels,
        deterministic=spec.deterministic,
    )
    return EngineCore(cfg, show_progress=False)


def _params(max_tokens: int) -> SamplingParams:
    from engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


# A request's sampling parameters in a timed pass; W1's own (greedy, EOS ignored, its
# output_len) unless a benchmark gives some requests more (a constraint, say).
ParamsFor = Callable[[W1Request], "SamplingParams"]


def w1_params(r: W1Request) -> SamplingParams:
    return _params(r.output_len)


@dataclass(slots=True)
class TimedPass:
    """One timed W1 pass: wall time, outputs, and the runner's work inside the window."""

    wall_s: float
    outputs: dict[str, list[int]]
    busy_s: float
    steps: int


def sync_w1(
    core: EngineCore, requests: list[W1Request], params_for: ParamsFor = w1_params
) -> TimedPass:
    """One W1 pass through ``EngineCore.step()``, after an untimed warm-up request."""
    core.generate([common.warmup_prompt()], _params(common.WARMUP_NEW_TOKENS))
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    busy0, steps0 = core.runner.busy_seconds, core.runner.num_steps
    t0 = time.perf_counter()
    for r in requests:
        core.add_request(core.make_request(r.request_id, r.prompt_token_ids, params_for(r)))
    while core.has_work():
        for out in core.step():
            outputs[out.request_id].extend(out.new_token_ids)
    wall = time.perf_counter() - t0
    return TimedPass(
        wall, outputs, core.runner.busy_seconds - busy0, core.runner.num_steps - steps0
    )


async def async_w1(
    core: EngineCore, requests: list[W1Request], params_for: ParamsFor = w1_params
) -> TimedPass:
    """One W1 pass through ``AsyncEngine``, every request submitted at once, after an
    untimed warm-up request."""
    from engine.async_engine import AsyncEngine

    engine = AsyncEngine(core)
    await engine.start()

    async def collect(rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
        ids: list[int] = []
        async for out in engine.generate(rid, prompt, params):
            ids.extend(out.new_token_ids)
        return ids

    try:
        # Warm up through the engine and runner threads: each new thread that calls into
        # torch pays its own first-parallel-region cost.
        await collect("warmup-async", common.warmup_prompt(), _params(common.WARMUP_NEW_TOKENS))
        # The engine thread is idle between requests, so these reads race nothing.
        busy0, steps0 = core.runner.busy_seconds, core.runner.num_steps
        t0 = time.perf_counter()
        got = await asyncio.gather(
            *(collect(r.request_id, r.prompt_token_ids, params_for(r)) for r in requests)
        )
        wall = time.perf_counter() - t0
        busy, steps = core.runner.busy_seconds - busy0, core.runner.num_steps - steps0
    finally:
        await engine.shutdown()
    outputs = {r.request_id: ids for r, ids in zip(requests, got, strict=True)}
    return TimedPass(wall, outputs, busy, steps)


# Plain reads of memory timed just before and just after the single stream, each side.
READS_AROUND_STREAM = 5


def _single_stream(
    core: EngineCore, prompt_len: int, new_tokens: int, read_mib: int
) -> tuple[float, float]:
    """Decode tokens/s of one sequence, first token to last (the prefill is excluded), and
    the median rate of plain reads of memory taken right before and right after it.

    The reads bracket the stream by a second or two, so a host whose memory bandwidth
    drifts during a long run (other tenants) gives the stream's own yardstick, where one
    read at the start of the run may come from another moment.

    They run on the engine's compute thread, as every torch op of an engine does: a read
    on this thread would give it an OpenMP team of its own, and with more OpenMP threads
    than CPUs libgomp puts the engine's team to sleep between parallel regions, which
    cost the stream a third of its rate (``engine.compute_thread``).
    """
    compute = core.runner.compute
    reader = compute.call(common.MemoryReader, read_mib)
    prompt = common.fixed_prompt(common.SINGLE_STREAM_SEED, prompt_len)
    reads = compute.call(reader.rates, READS_AROUND_STREAM)
    core.add_request(core.make_request("single-stream", prompt, _params(new_tokens)))
    times: list[float] = []
    while core.has_work():
        for out in core.step():
            times.extend(time.perf_counter() for _ in out.new_token_ids)
    reads += compute.call(reader.rates, READS_AROUND_STREAM)
    if len(times) != new_tokens:
        raise RuntimeError(f"single stream produced {len(times)} tokens, expected {new_tokens}")
    return (new_tokens - 1) / (times[-1] - times[0]), statistics.median(reads)


def run_baton(spec: RunSpec) -> RunResult:
    requests = common.load_workload(Path(spec.workload), spec.limit)
    core = _baton_core(spec)
    if spec.mode == "sync":
        timed = sync_w1(core, requests)
    elif spec.mode == "async":
        timed = asyncio.run(async_w1(core, requests))
    else:
        raise ValueError(f"baton mode must be 'sync' or 'async', got {spec.mode!r}")
    common.check_output_lengths(requests, timed.outputs)
    single = single_read = None
    if spec.mode == "sync" and spec.single_new_tokens > 1:
        single, single_read = _single_stream(
            core, spec.single_prompt_len, spec.single_new_tokens, spec.read_mib
        )
    stats = core.stats()
    return RunResult(
        engine="baton",
        mode=spec.mode + (DETERMINISTIC_SUFFIX if spec.deterministic else ""),
        dtype=spec.dtype,
        num_requests=len(requests),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        output_tokens=sum(r.output_len for r in requests),
        wall_s=timed.wall_s,
        generated_tokens=sum(len(v) for v in timed.outputs.values()),
        busy_fraction=timed.busy_s / timed.wall_s,
        single_decode_tok_s=single,
        single_read_bytes_per_s=single_read,
        self_peak_rss_bytes=common.self_peak_rss_bytes(),
        outputs_digest=common.outputs_digest(timed.outputs),
        extra={
            "steps": timed.steps,
            "busy_seconds": round(timed.busy_s, 3),
            # The W1 requests are the only ones that can be preempted (the rest run alone).
            "preemptions": stats.num_preemptions,
            "kv_blocks": stats.num_total_blocks,
            # The kernel each linear row class ran on (--cpu-kernels, measured or cached).
            "cpu_kernel_routes": dict(stats.cpu_kernel_routes),
            "cpu_kernels": spec.cpu_kernels,
        },
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="a RunSpec as JSON")
    parser.add_argument("--out", required=True, help="where to write the RunResult JSON")
    args = parser.parse_args(argv)
    common.write_result(args.out, run_baton(RunSpec.from_json(args.spec)))


if __name__ == "__main__":
    main()
