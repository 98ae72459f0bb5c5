"""Interleaved A/B of start-up: an earlier git revision against the working tree.

What a user waits for before the first token, timed on the bundled model:

- ``convert``: the first start's GGUF -> safetensors conversion (``convert_gguf`` into a
  fresh directory, so the cache never answers);
- ``decode worker``: ``python -m decode_service`` at its defaults (bf16, one compute
  thread) from the process's start to its "is SERVING" log line, the moment its health
  service answers SERVING;
- ``gateway``: ``python -m gateway`` from the process's start to its "model ... ready"
  log line (its tokenizer and model card loaded; it then waits for decode workers), with
  the CPU seconds the process spent until then;
- ``deployment``: what ``baton serve`` waits for, ``LocalCluster(...).start()`` at its
  defaults (a gateway, a prefill and a decode worker) until the gateway serves, timed in
  a child process of the tree (its imports excluded).

Exports ``--base`` with ``git archive`` (as ``benchmarks.w1_ab`` does), then runs each
measurement in a child process of each tree in turn, ``--runs`` times, so noise from
other work hits both alike; the medians and their ratio are the result. Both trees load
the checkpoint that this tree's ``resolve_model`` converted, and the same kernel-route
cache. Writes ``benchmarks/results/startup_ab_<date>_<host kind>.md``.

    python -m benchmarks.startup_ab --base REV [--runs 3] [--gguf F] [--model DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common, provenance
from benchmarks.w1_ab import export_tree

REPO = Path(__file__).resolve().parent.parent
SERVING = "is SERVING"
GATEWAY_READY = " ready in "
CONVERT = (
    "import sys; from pathlib import Path; from engine.model_files import convert_gguf; "
    "convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))"
)


def _cpu_s(usage: object) -> float:
    return usage.ru_utime + usage.ru_stime  # type: ignore[attr-defined]


def time_conversion(tree: Path, gguf: Path, out: Path) -> tuple[float, float]:
    """(wall s, CPU s) of one conversion of ``gguf`` by ``tree``'s code into ``out``."""
    began = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", CONVERT, str(gguf), str(out)],
        cwd=tree,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - began
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"conversion in {tree} exited {proc.returncode}")
    return wall, _cpu_s(usage)


def _cpu_of(pid: int) -> float:
    """CPU seconds process ``pid`` has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _until_logged(
    tree: Path, argv: list[str], line: str, log: Path, timeout_s: float
) -> tuple[float, float]:
    """(wall s, CPU s) from spawning ``python -m argv`` in ``tree`` until its log holds
    ``line``; it is then stopped."""
    began = time.perf_counter()
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", *argv], cwd=tree, stdout=sink, stderr=subprocess.STDOUT
        )
    try:
        while line not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.perf_counter() - began > timeout_s:
                raise RuntimeError(f"{argv[0]} of {tree} never logged {line!r}:\n{log.read_text()}")
            time.sleep(0.02)
        return time.perf_counter() - began, _cpu_of(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def time_worker_start(tree: Path, model: str, workdir: Path, timeout_s: float = 300.0) -> float:
    """Seconds from spawning ``tree``'s decode worker to its SERVING line."""
    argv = ["decode_service", "--model", model,
            "--host", "127.0.0.1", "--port", "0", "--port-file", str(workdir / "port")]  # fmt: skip
    return _until_logged(tree, argv, SERVING, workdir / "decode.log", timeout_s)[0]


def time_gateway_start(
    tree: Path, model: str, workdir: Path, timeout_s: float = 300.0
) -> tuple[float, float]:
    """(wall s, CPU s) from spawning ``tree``'s gateway to its "model ... ready" line. It
    is pointed at a decode address nobody serves: loading the model does not wait for
    workers."""
    argv = ["gateway", "--model", model, "--log-level", "INFO",
            "--decode", "127.0.0.1:9", "--prefill", "127.0.0.1:9", "--host", "127.0.0.1",
            "--port", "0", "--port-file", str(workdir / "gw-port")]  # fmt: skip
    return _until_logged(tree, argv, GATEWAY_READY, workdir / "gateway.log", timeout_s)


DEPLOY = (
    "import sys, time; from gateway.launcher import ClusterSpec, LocalCluster; "
    "cluster = LocalCluster(ClusterSpec(model=sys.argv[1])); began = time.perf_counter(); "
    "cluster.start(); print('STARTED', time.perf_counter() - began, flush=True); cluster.stop()"
)


def time_deployment(tree: Path, model: str) -> float:
    """Seconds ``tree``'s ``LocalCluster.start`` takes to serve ``model`` at its defaults."""
    done = subprocess.run(
        [sys.executable, "-c", DEPLOY, model], cwd=tree, capture_output=True, text=True, timeout=600
    )
    for line in done.stdout.splitlines():
        if line.startswith("STARTED "):
            return float(line.split()[1])
    raise RuntimeError(f"deployment of {tree} did not start:\n{done.stdout}\n{done.stderr}")


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.startup_ab", description=__doc__)
    ap.add_argument("--base", required=True, help="git revision to compare against")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gguf", type=Path, help="GGUF to convert (default: the bundled one)")
    ap.add_argument("--model", help="checkpoint the worker serves (default: the bundled one)")
    ap.add_argument("--out", type=Path, help="results file (default: benchmarks/results/)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        raise ValueError(f"--runs must be at least 1, got {args.runs}")
    from engine.model_files import find_bundled_gguf, resolve_model

    model = args.model or str(resolve_model("smollm2-135m").path)
    bundled = find_bundled_gguf("smollm2-135m")
    gguf = args.gguf or (bundled[1] if bundled else None)
    if gguf is None:
        raise ValueError("no --gguf given and the bundled model is not installed")
    now = dt.datetime.now()
    load0 = os.getloadavg()
    rows: list[list[str]] = []
    convert: dict[str, list[float]] = {}
    start: dict[str, list[float]] = {}
    gateway: dict[str, list[float]] = {}
    gateway_cpu: dict[str, list[float]] = {}
    deploy: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="startup-ab-") as tmp:
        base_dir = Path(tmp) / "base"
        base_sha = export_tree(args.base, base_dir)
        trees = {f"base {base_sha}": base_dir, f"new {provenance.git_revision()}": REPO}
        for rep in range(args.runs):
            for name, tree in trees.items():
                work = Path(tempfile.mkdtemp(dir=tmp))
                wall, cpu = time_conversion(tree, gguf, work / "converted")
                serving = time_worker_start(tree, model, work)
                gw_wall, gw_cpu = time_gateway_start(tree, model, work)
                deployed = time_deployment(tree, model)
                deploy.setdefault(name, []).append(deployed)
                convert.setdefault(name, []).append(wall)
                start.setdefault(name, []).append(serving)
                gateway.setdefault(name, []).append(gw_wall)
                gateway_cpu.setdefault(name, []).append(gw_cpu)
                rows.append(
                    [name, str(rep + 1), f"{wall:.2f}", f"{cpu:.2f}", f"{serving:.2f}",
                     f"{gw_wall:.2f}", f"{gw_cpu:.2f}", f"{deployed:.2f}"]
                )  # fmt: skip
                print(
                    f"{name} run {rep + 1}: convert {wall:.2f} s, serving after {serving:.2f} s,"
                    f" gateway ready after {gw_wall:.2f} s ({gw_cpu:.2f} CPU s),"
                    f" deployment serving after {deployed:.2f} s"
                )
    base, new = trees
    medians = {
        "convert": {n: statistics.median(v) for n, v in convert.items()},
        "decode worker to SERVING": {n: statistics.median(v) for n, v in start.items()},
        "gateway to model ready": {n: statistics.median(v) for n, v in gateway.items()},
        "gateway CPU to model ready": {n: statistics.median(v) for n, v in gateway_cpu.items()},
        "deployment to serving": {n: statistics.median(v) for n, v in deploy.items()},
    }
    command = "python -m benchmarks.startup_ab " + " ".join(sys.argv[1:] if argv is None else argv)
    threads = len(os.sched_getaffinity(0))
    lines = [
        f"# Start-up A/B, base against this tree, {now:%Y-%m-%d %H:%M}",
        "",
        *provenance.header_lines(command, threads, load0, os.getloadavg(), now),
        "",
        common.markdown_table(
            (
                "tree",
                "run",
                "convert wall s",
                "convert CPU s",
                "decode worker to SERVING s",
                "gateway to model ready s",
                "gateway CPU s",
                "deployment to serving s",
            ),  # fmt: skip
            rows,
        ),
        "",
        "Medians (seconds) and new / base:",
        "",
        common.markdown_table(
            ("what", base, new, "new / base"),
            [
                [what, f"{m[base]:.2f}", f"{m[new]:.2f}", f"{m[new] / m[base]:.2f}"]
                for what, m in medians.items()
            ],
        ),
        "",
        f"- convert: {gguf.name} into a fresh directory (no cache), in a child process"
        " of the tree (its imports included).",
        f"- decode worker: `python -m decode_service --model {Path(model).name}` at its"
        " defaults, spawn to the 'is SERVING' log line; the kernel-route cache is warm.",
        f"- gateway: `python -m gateway --model {Path(model).name}`, spawn to its 'model"
        " ... ready' log line (tokenizer and model card loaded), and its CPU seconds by then.",
        "- deployment: `LocalCluster(ClusterSpec(model=...)).start()` at its defaults (gateway,"
        " prefill and decode worker, bf16), until it returns with the gateway serving.",
    ]
    return provenance.publish("\n".join(lines) + "\n", "startup_ab", out=args.out)


if __name__ == "__main__":
    common.stop_on_sigterm()
    main()
