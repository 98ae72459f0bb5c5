"""Interleaved A/B of baton's engine: an earlier git revision against the working tree.

Exports ``--base`` (a git revision) with ``git archive`` into a temporary directory and
runs W1 (or its first ``--limit`` requests) through the synchronous and the asynchronous
engine of both trees, alternating base and new, sync and async, ``--runs`` times, each
run in its own child process. Noise from other work on the machine then hits both trees
alike, and the medians compare them. The sync runs also give the single-stream figure.
Writes ``benchmarks/results/w1_ab_<date>_<dtype>[_limitN].md`` headed by the command,
date, both revisions, machine and load, with one row per run and the medians.

    python -m benchmarks.w1_ab --base REV [--limit 12] [--runs 3] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from benchmarks import common, provenance
from benchmarks.common import RunResult, RunSpec
from engine.config import CPU_KERNEL_MODES

REPO = Path(__file__).resolve().parent.parent


def export_tree(rev: str, dest: Path) -> str:
    """Writes revision ``rev`` of this repository into ``dest``; returns its short sha."""
    sha = subprocess.run(
        ["git", "rev-parse", "--short=12", rev], cwd=REPO, capture_output=True, text=True,
        check=True,
    ).stdout.strip()  # fmt: skip
    data = subprocess.run(
        ["git", "archive", "--format=tar", sha], cwd=REPO, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    return sha


def child_module(tree: Path) -> str:
    """The module that runs one baton engine in ``tree`` (it moved out of w1_offline)."""
    if (tree / "benchmarks" / "baton_w1.py").exists():
        return "benchmarks.baton_w1"
    return "benchmarks.w1_offline"


def run_tree(tree: Path, spec: RunSpec, out: Path) -> RunResult:
    env = dict(os.environ, PYTHONPATH=str(tree))
    argv = [sys.executable, "-m", child_module(tree), "--spec", spec.to_json(), "--out", str(out)]
    return common.run_child(argv, out, env=env, cwd=tree, timeout_s=3600.0)


def _row(name: str, r: RunResult) -> list[str]:
    share = "-" if r.other_cpu_share is None else f"{100 * r.other_cpu_share:.0f}%"
    return [
        name, r.mode, str(r.extra.get("run", "")), f"{r.output_tok_s:.1f}", f"{r.wall_s:.2f}",
        common.fmt(r.busy_fraction, 3), common.fmt(r.single_decode_tok_s),
        f"{r.load_before:.2f} / {r.load_after:.2f}", share,
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.w1_ab", description=__doc__)
    ap.add_argument("--base", required=True, help="git revision to compare against")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--single-new-tokens", type=int, default=64)
    ap.add_argument(
        "--cpu-kernels",
        default="auto",
        choices=CPU_KERNEL_MODES,
        help="both trees' EngineConfig.cpu_kernels (default: ops' constants, no timing)",
    )
    ap.add_argument("--tag", default="", help="appended to the results file's name")
    ap.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)
    if args.tag and not all(c.isalnum() or c in "-_" for c in args.tag):
        ap.error(f"--tag may hold letters, digits, '-' and '_' only, got {args.tag!r}")
    from engine.model_files import resolve_model

    model = str(resolve_model("smollm2-135m").path)
    now = dt.datetime.now()
    load0 = os.getloadavg()
    results: list[tuple[str, RunResult]] = []
    with tempfile.TemporaryDirectory(prefix="w1-ab-") as tmp:
        base_dir = Path(tmp) / "base"
        base_sha = export_tree(args.base, base_dir)
        trees = {f"base {base_sha}": base_dir, f"new {provenance.git_revision()}": REPO}
        for rep in range(args.runs):
            for mode in ("sync", "async"):
                for name, tree in trees.items():
                    spec = RunSpec(
                        engine="baton", mode=mode, dtype=args.dtype, model_dir=model,
                        workload=str(common.DEFAULT_WORKLOAD), limit=args.limit,
                        threads=args.threads, kv_cache_gib=1.0, max_model_len=1024,
                        single_new_tokens=args.single_new_tokens if mode == "sync" else 0,
                        cpu_kernels=args.cpu_kernels,
                    )  # fmt: skip
                    r = run_tree(tree, spec, Path(tmp) / f"{rep}-{mode}-{len(results)}.json")
                    r.extra["run"] = rep + 1
                    print(f"{name} {mode} run {rep + 1}: {r.output_tok_s:.1f} tok/s", flush=True)
                    results.append((name, r))
    command = "python -m benchmarks.w1_ab " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        f"# W1 A/B, {args.dtype}, base against this tree, {now:%Y-%m-%d %H:%M}",
        "",
        *provenance.header_lines(command, args.threads, load0, os.getloadavg(), now),
        "",
        common.markdown_table(
            (
                "tree",
                "mode",
                "run",
                "output tok/s",
                "wall s",
                "busy",
                "single tok/s",
                "load before / after",
                "other CPU",
            ),
            [_row(name, r) for name, r in results],
        ),  # fmt: skip
        "",
        "Medians (output tok/s; single stream):",
        "",
    ]
    for name in trees:
        for mode in ("sync", "async"):
            rates = [r.output_tok_s for n, r in results if n == name and r.mode == mode]
            singles = [
                r.single_decode_tok_s
                for n, r in results
                if n == name and r.mode == mode and r.single_decode_tok_s
            ]
            single = f"; single {statistics.median(singles):.1f}" if singles else ""
            lines.append(
                f"- {name} {mode}: {statistics.median(rates):.1f}"
                f" ({min(rates):.1f}-{max(rates):.1f}){single}"
            )
    for name in trees:
        digests = {r.outputs_digest for n, r in results if n == name}
        same = "identical" if len(digests) == 1 else "DIFFERENT"
        lines.append(f"- {name}: output ids {same} across modes and runs.")
    lines += [
        "- other CPU: share of the machine's CPU time that processes outside the run took.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    suffix = (f"_limit{args.limit}" if args.limit else "") + args.tag
    out = args.results_dir / f"w1_ab_{now:%Y-%m-%d}_{args.dtype}{suffix}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
