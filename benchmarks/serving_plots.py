"""PNG plots of a serving benchmark run, drawn from its raw JSON.

Owns the figures only; `benchmarks.serving` calls :func:`write_plots` after a run, and a
run's JSON can be re-plotted later:

    python -m benchmarks.serving_plots benchmarks/results/serving_<date>.json

Two files per run: ``<stem>_latency.png`` (empirical CDFs of online TTFT and TPOT, one
line per configuration) and ``<stem>_throughput.png`` (output tok/s bars, offline with the
in-process engine, and online). Needs matplotlib (the ``bench`` extra); without it the
command says so in one line and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.plotting import draw_or_explain


def _cdf(ax: Any, values: list[float], label: str) -> None:
    xs = sorted(1e3 * v for v in values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def _bars(ax: Any, labels: list[str], values: list[float], title: str) -> None:
    ax.bar(range(len(values)), values, color=[f"C{i}" for i in range(len(values))])
    ax.set_xticks(range(len(values)), labels, rotation=20, ha="right", fontsize=8)
    for i, v in enumerate(values):
        ax.annotate(f"{v:.0f}", (i, v), ha="center", va="bottom", fontsize=8)
    ax.set_title(title)
    ax.set_ylabel("output tok/s")


def write_plots(raw: dict[str, Any], stem: Path) -> list[Path]:
    """Draw the run in ``raw`` (the JSON `benchmarks.serving` writes) next to ``stem``;
    return the files written (none for phases the run skipped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    configs = raw["configs"]
    online = [c for c in configs if "online" in c]
    if online:
        fig, (ttft, tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
        for c in online:
            label = f"{c['key']}: {c['label']}"
            _cdf(ttft, c["online"]["ttft_s"], label)
            _cdf(tpot, c["online"]["tpot_s"], label)
        for ax, name in ((ttft, "TTFT"), (tpot, "TPOT")):
            ax.set_xlabel(f"{name} (ms)")
            ax.set_ylabel("fraction of requests")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            ax.set_title(f"{name} CDF, online at {raw['rate_req_s']:.2f} req/s")
        tpot.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        written.append(stem.with_name(stem.name + "_latency.png"))
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

    offline = [c for c in configs if "offline" in c]
    if offline or online:
        panels = [p for p in (offline, online) if p]
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
        col = 0
        if offline:
            labels = [f"{c['key']}: {c['label']}" for c in offline]
            values = [c["offline"]["output_tok_s"] for c in offline]
            if raw.get("in_process"):
                labels.append("in-process engine")
                values.append(raw["in_process"]["output_tok_s"])
            _bars(axes[0][col], labels, values, "Offline W1 (all at t = 0)")
            col += 1
        if online:
            _bars(
                axes[0][col],
                [f"{c['key']}: {c['label']}" for c in online],
                [c["online"]["output_tok_s"] for c in online],
                f"Online, {raw['rate_req_s']:.2f} req/s offered",
            )
        fig.tight_layout()
        written.append(stem.with_name(stem.name + "_throughput.png"))
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving_plots", description=__doc__)
    p.add_argument("json", type=Path, help="a serving_<date>.json written by the benchmark")
    args = p.parse_args(argv)
    raw = json.loads(args.json.read_text())
    written = draw_or_explain(
        lambda: write_plots(raw, args.json.with_suffix("")), f"nothing drawn from {args.json}"
    )
    if written is None:
        raise SystemExit(1)  # drawing is all this command does; the line above said why
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
