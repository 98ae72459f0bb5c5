"""The report of ``benchmarks.serving_openai``: its tables, its ratios and its plot.

A row per leg (server, rate) with throughput, TTFT and ITL percentiles and the machine's
load during the leg; then baton / vLLM at each rate, unless the machine was busy
(``busy_legs``) and ``--allow-busy`` was not given; and a PNG of the same figures
against the offered rate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.peers.vllm_cpu import VLLM_VERSION

VLLM_LABEL = f"vLLM-CPU {VLLM_VERSION}"
# (result key, column title, scale): what the tables show of each leg.
METRICS = (
    ("request_throughput", "req/s", 1.0),
    ("output_throughput", "output tok/s", 1.0),
    ("p50_ttft_ms", "TTFT p50 ms", 1.0),
    ("p99_ttft_ms", "TTFT p99 ms", 1.0),
    ("p50_itl_ms", "ITL p50 ms", 1.0),
    ("p99_itl_ms", "ITL p99 ms", 1.0),
)


def busy_legs(raw: dict[str, Any], busy_cores: float) -> list[str]:
    """The legs during which other processes took more than ``busy_cores`` cores."""
    return [
        f"{leg['server']} at {leg['rate']:g} req/s: {leg['load']['others_cores']:.2f} cores"
        for leg in raw["legs"]
        if leg["load"]["others_cores"] > busy_cores
    ]


def ratio_rows(raw: dict[str, Any]) -> list[list[str]]:
    """baton / vLLM per baton configuration and rate (throughput: higher is better for
    baton; latencies: lower is)."""
    peer = {leg["rate"]: leg for leg in raw["legs"] if leg["server"] == VLLM_LABEL}
    rows = []
    for leg in raw["legs"]:
        other = peer.get(leg["rate"])
        if leg["server"] == VLLM_LABEL or other is None:
            continue
        rows.append(
            [
                leg["server"],
                f"{leg['rate']:g}",
                *[common.ratio(leg[key], other[key]) for key, _, _ in METRICS],
            ]
        )
    return rows


def render(raw: dict[str, Any], limit: int, busy_cores: float, allow_busy: bool) -> str:
    """The markdown report: a row per leg, then the ratios (or why there are none)."""
    f = common.fmt
    lines = list(raw["header"])
    rows = [
        [
            leg["server"],
            f"{leg['rate']:g}",
            f"{leg['completed']}/{limit}",
            *[f(leg[key], 2 if key == "request_throughput" else 1) for key, _, _ in METRICS],
            f"{leg['load']['load1_first']:.2f}-{leg['load']['load1_max']:.2f}",
            f"{leg['load']['others_cores']:.2f}",
        ]
        for leg in raw["legs"]
    ]
    headers = [
        "server",
        "rate req/s",
        "completed",
        *[t for _, t, _ in METRICS],
        "load avg (1 min)",
        "others' cores",
    ]
    lines += ["", common.markdown_table(headers, rows), ""]
    phased = [leg for leg in raw["legs"] if leg.get("baton_phases")]
    if phased:
        names = ("queued", "prefill", "transfer", "first_token", "decode")
        rows = [
            [
                leg["server"],
                f"{leg['rate']:g}",
                str(leg["baton_phases"]["requests"]),
                *[f(leg["baton_phases"].get(f"{n}_s"), 3) for n in names],
            ]
            for leg in phased
        ]
        lines += [
            "Where baton's time went (medians over each leg's requests, in seconds, from"
            " the `baton_timings` of the gateway's per-request log lines):",
            "",
            common.markdown_table(["server", "rate req/s", "requests", *names], rows),
            "",
        ]
    ratios = ratio_rows(raw)
    busy = raw["busy_legs"]
    if not ratios:
        lines.append("No ratios: " + raw["no_ratio_reason"])
    elif busy and not allow_busy:
        lines.append(
            f"Ratios withheld: the machine was busy ({'; '.join(busy)}; the bound is"
            f" {busy_cores:g} cores). Re-run on a quiet machine, or pass"
            " --allow-busy to print them anyway."
        )
    else:
        if busy:
            lines.append(
                f"**BUSY MACHINE** ({'; '.join(busy)}): these ratios are not a"
                " comparison, only a check that the harness works."
            )
        lines += [
            "baton / vLLM at the same rate (throughput: > 1 is baton ahead; latency:"
            " < 1 is baton ahead):",
            "",
            common.markdown_table(["baton", "rate req/s", *[t for _, t, _ in METRICS]], ratios),
        ]
    return "\n".join(lines) + "\n"


def write_plot(raw: dict[str, Any], path: Path) -> Path:
    """Output tok/s, TTFT and ITL (p50 solid, p99 dashed) against the offered rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    servers = list(dict.fromkeys(leg["server"] for leg in raw["legs"]))
    for i, server in enumerate(servers):
        legs = sorted(
            (leg for leg in raw["legs"] if leg["server"] == server), key=lambda leg: leg["rate"]
        )
        rates = [leg["rate"] for leg in legs]
        axes[0].plot(
            rates, [leg["output_throughput"] for leg in legs], "o-", color=f"C{i}", label=server
        )
        for ax, metric in ((axes[1], "ttft"), (axes[2], "itl")):
            for q, style in (("p50", "o-"), ("p99", "s--")):
                ax.plot(
                    rates,
                    [leg[f"{q}_{metric}_ms"] for leg in legs],
                    style,
                    color=f"C{i}",
                    label=f"{server} {q}",
                )
    for ax, title, unit in (
        (axes[0], "output throughput", "tok/s"),
        (axes[1], "TTFT", "ms"),
        (axes[2], "ITL", "ms"),
    ):
        ax.set_title(title)
        ax.set_xlabel("offered rate, req/s (Poisson)")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[1:]:
        ax.set_yscale("log")
    fig.suptitle(raw["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
