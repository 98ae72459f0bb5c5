"""A picture of the engine timeline: one short W1 run, disaggregated, with the timeline on.

Starts a disaggregated deployment (prefill and decode workers pinned to their own cores,
KV over shm) with ``--timeline-file`` on both workers, sends the first ``--limit`` W1
requests at t = 0 through the gateway, stops the deployment (which writes the files),
merges the two Chrome traces into one (open it in https://ui.perfetto.dev) and draws a
PNG: a row per track of each worker, a bar per span, coloured by span; the whole run
above and a ``--zoom-s`` window below, where single steps and the KV sends between them
can be seen. The merged trace and a markdown report are written before the PNG, which
needs matplotlib (the ``bench`` extra): without it one line says so and the rest stays.
Files already written can be drawn again with ``--from-files``.

    python -m benchmarks.timeline_plot [--limit 16] [--zoom-s 0.5]
    python -m benchmarks.timeline_plot --from-files prefill.json decode.json --out x.png
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.plotting import draw_or_explain
from gateway.core_plan import WorkerCores
from gateway.launcher import ClusterSpec, LocalCluster, LocalProcess

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
COLORS = {
    "schedule": "tab:blue",
    "wait": "lightgray",
    "update": "tab:cyan",
    "prepare": "tab:olive",
    "forward": "tab:orange",
    "sample": "tab:red",
    "send": "tab:green",
    "verify": "tab:purple",
    "lease": "tab:pink",
}


class TimelineCluster(LocalCluster):
    """A LocalCluster whose prefill and decode workers each write their own timeline
    (the launcher gives every worker the same flags; this adds per-kind ones)."""

    def __init__(self, spec: ClusterSpec, files: dict[str, Path]) -> None:
        super().__init__(spec)
        self._files = files

    def _spawn(
        self,
        kind: str,
        index: int,
        argv: list[str],
        port: int = 0,
        cores: WorkerCores | None = None,
        lending: Path | None = None,
    ) -> LocalProcess:
        extra = ["--timeline-file", str(self._files[kind])] if kind in self._files else []
        if kind == "decode":  # its own shm segment name (the default one is shared)
            extra += ["--transport-address", f"baton-tl-{uuid.uuid4().hex[:16]}"]
        return super()._spawn(kind, index, [*argv, *extra], port, cores=cores, lending=lending)


def run_w1(model: str, limit: int, dtype: str, workdir: Path) -> tuple[list[Path], dict]:
    """The short W1 run; returns the two timeline files and what was run."""
    from benchmarks.serving import run_phase
    from protos.client import AsyncClient

    cpus = sorted(os.sched_getaffinity(0))
    files = [workdir / "prefill.json", workdir / "decode.json"]
    pinned = {"prefill": frozenset(cpus[:1]), "decode": frozenset(cpus[-1:])}
    spec = ClusterSpec(
        model=model,
        mode="disaggregated",
        transport="shm",
        dtype=dtype,
        worker_args=("--kv-cache-bytes", str(1 << 30), "--max-model-len", "1024"),
        cpus=pinned,
        start_timeout_s=900.0,
    )
    requests = common.load_workload(common.DEFAULT_WORKLOAD, limit)
    cluster = TimelineCluster(spec, {"prefill": files[0], "decode": files[1]})
    with cluster:

        async def drive() -> float:
            async with AsyncClient(cluster.gateway_address) as client:
                warm = common.W1Request("warmup", common.warmup_prompt(), 8)
                await run_phase(client, "warmup", [warm], None, 0, 600.0, "tl")
                phase = await run_phase(client, "w1", requests, None, 0, 3600.0, "tl")
                return phase.wall_s

        wall_s = asyncio.run(drive())
    info = {
        "requests": limit,
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
        "wall_s": wall_s,
        "cpus": {k: sorted(v) for k, v in pinned.items()},
    }
    return files, info


def merge(files: list[Path]) -> dict[str, Any]:
    """One Chrome trace of several workers' files (their clocks are the host's)."""
    events: list[dict[str, Any]] = []
    for path in files:
        events += json.loads(path.read_text())["traceEvents"]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _rows(trace: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """(label, events) per row: each worker's complete-event tracks, then its leases."""
    names: dict[int, str] = {}
    tracks: dict[tuple[int, int], str] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "M" and e["name"] == "process_name":
            names[e["pid"]] = e["args"]["name"]
        elif e["ph"] == "M" and e["name"] == "thread_name":
            tracks[(e["pid"], e["tid"])] = e["args"]["name"]
    rows: dict[str, list[dict[str, Any]]] = {}
    begins: dict[tuple[int, str], dict[str, Any]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            label = f"{names.get(e['pid'], e['pid'])}: {tracks.get((e['pid'], e['tid']), '?')}"
            rows.setdefault(label, []).append(e)
        elif e["ph"] == "b":
            begins[(e["pid"], e["id"])] = e
        elif e["ph"] == "e" and (b := begins.pop((e["pid"], e["id"]), None)) is not None:
            label = f"{names.get(e['pid'], e['pid'])}: leases"
            rows.setdefault(label, []).append({**b, "dur": e["ts"] - b["ts"]})
    order = ["engine loop", "runner", "kv send", "kv receive", "leases"]
    return sorted(
        rows.items(),
        key=lambda kv: (
            kv[0].split(":")[0],
            order.index(kv[0].split(": ")[1]) if kv[0].split(": ")[1] in order else 99,
        ),
    )


def draw(trace: dict[str, Any], out: Path, title: str, zoom_s: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = _rows(trace)
    t0 = min(e["ts"] for _, events in rows for e in events)
    t1 = max(e["ts"] + e["dur"] for _, events in rows for e in events)
    # The zoom window: where the prefill runner is busiest alongside KV sends.
    sends = sorted(e["ts"] for label, events in rows if label.endswith("kv send") for e in events)
    mid = sends[len(sends) // 2] if sends else (t0 + t1) / 2
    window = (mid - zoom_s * 5e5, mid + zoom_s * 5e5)
    fig, axes = plt.subplots(2, 1, figsize=(16, 2.2 + 0.55 * len(rows) * 2))
    for ax, (lo, hi), label in (
        (axes[0], (t0, t1), "whole run"),
        (axes[1], window, f"{zoom_s:g} s window"),
    ):
        for y, (_, events) in enumerate(rows):
            shown = [e for e in events if e["ts"] + e["dur"] >= lo and e["ts"] <= hi]
            bars = [((e["ts"] - t0) / 1e6, max(e["dur"], 1.0) / 1e6) for e in shown]
            colors = [COLORS.get(e["name"], "black") for e in shown]
            leases = bool(events) and events[0].get("ph") == "b"
            ax.broken_barh(
                bars, (y - 0.35, 0.7), facecolors=colors, linewidth=0, alpha=0.5 if leases else 1.0
            )
        ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.invert_yaxis()
        ax.set_xlim((lo - t0) / 1e6, (hi - t0) / 1e6)
        ax.set_xlabel("seconds from the first recorded span")
        ax.set_title(label, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=c, label=n) for n, c in COLORS.items()]
    fig.legend(handles=handles, ncol=len(handles), fontsize=8, loc="lower center")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> Path:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.timeline_plot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--limit", type=int, default=16, help="the first N W1 requests")
    p.add_argument("--zoom-s", type=float, default=0.5, help="width of the zoomed window")
    p.add_argument("--from-files", nargs="+", type=Path, help="draw these timeline files")
    p.add_argument("--out", type=Path, default=None, help="the PNG (default: results dir)")
    a = p.parse_args(argv)
    now = dt.datetime.now()
    results = REPO / "benchmarks" / "results"
    stem = results / f"timeline_w1_{now:%Y-%m-%d}_limit{a.limit}"
    out = a.out or stem.with_suffix(".png")
    command = " ".join(sys.argv[1:] if argv is None else argv)
    if a.from_files:
        trace = merge(a.from_files)
        title = f"engine timeline: {', '.join(map(str, a.from_files))}"
        drawn = draw_or_explain(lambda: draw(trace, out, title, a.zoom_s), "nothing drawn")
        if drawn is None:
            raise SystemExit(1)  # drawing is all this mode does; the line above said why
        return drawn
    from engine.model_files import resolve_model

    model_dir = resolve_model(a.model).path
    load = os.getloadavg()[0]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="timeline-") as tmp:
        files, info = run_w1(str(model_dir), a.limit, a.dtype, Path(tmp))
        trace = merge(files)
    title = (
        f"baton engine timeline, disaggregated over shm (prefill on CPU"
        f" {info['cpus']['prefill']}, decode on {info['cpus']['decode']}), {model_dir.name}"
        f" {a.dtype}: first {a.limit} W1 requests at t = 0, {info['wall_s']:.1f} s;"
        f" load average {load:.2f} before"
    )
    # The trace and the report first: a picture that fails (no matplotlib) must not cost
    # the run; the report gains its picture once the PNG exists.
    trace_path = Path(tempfile.gettempdir()) / f"{stem.name}.trace.json"
    trace_path.write_text(json.dumps(trace))
    md = out.with_suffix(".md")
    head = (
        f"# Engine timeline of a short W1 run, {now:%Y-%m-%d %H:%M}\n\n"
        f"Command: `python -m benchmarks.timeline_plot {command}` ({time.monotonic() - started:.0f}"
        f" s in all).  \n{title}.  \n{info['prompt_tokens']} prompt tokens,"
        f" {info['output_tokens']} output tokens.\n\n"
    )
    rows = (
        "Rows: each worker's engine loop (schedule / wait / update), runner (prepare / forward"
        " / sample), the prefill worker's KV sends and the decode worker's verifies, and the"
        " decode worker's leases (granted to ended, one per request, overlapping).\n"
    )
    md.write_text(head + rows)
    written = f"the trace is in {trace_path} (open in ui.perfetto.dev), the report in {md}"
    png = draw_or_explain(lambda: draw(trace, out, title, a.zoom_s), written)
    if png is None:
        return md
    md.write_text(f"{head}![timeline]({out.name})\n\n{rows}")
    print(f"wrote {out} and {md}; merged trace (open in ui.perfetto.dev): {trace_path}")
    return png


if __name__ == "__main__":
    main()
