"""The W1 report: repeated runs of each engine folded into medians, spreads and ratios.

Each engine runs several times, interleaved with the others, so noise from other work on
the machine hits every engine alike; the tables give the median output rate and its
spread (min-max) over an engine's runs, and ratios between engines' medians at the same
dtype. A ratio is printed only when the machine was quiet during every run it compares
(``machine_was_busy``), unless the harness was told to print it anyway.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.common import RunResult, fmt, markdown_table, mib

# Share of the machine's CPU time that other processes may take during a run before its
# figures stop counting as a quiet-machine measurement.
BUSY_OTHER_CPU_SHARE = 0.10


@dataclass(frozen=True, slots=True)
class SingleStream:
    """Batch-1 decode rates against the weight-read floor, for one dtype (medians)."""

    dtype: str
    baton_tok_s: float | None
    hf_tok_s: float | None
    weight_bytes: int
    memcpy_bytes_per_s: float
    read_bytes_per_s: float | None = None  # absent from runs before it was measured
    # Median over the runs of each run's reads around its own stream, and the median over
    # the runs of each stream's rate over its own reads' bound (absent before measured).
    around_read_bytes_per_s: float | None = None
    around_ratio: float | None = None

    @property
    def floor_tok_s(self) -> float:
        # Each batch-1 decode step reads every weight once, at the copy rate here.
        return self.memcpy_bytes_per_s / self.weight_bytes

    @property
    def read_bound_tok_s(self) -> float | None:
        """Steps per second if each did nothing but read every weight once at the rate a
        plain read of memory reaches: what no batch-1 decode on these cores can beat."""
        if self.read_bytes_per_s is None:
            return None
        return self.read_bytes_per_s / self.weight_bytes


@dataclass(frozen=True, slots=True)
class EngineSummary:
    """All runs of one (engine, mode, dtype)."""

    engine: str
    mode: str
    dtype: str
    runs: tuple[RunResult, ...]

    @property
    def key(self) -> tuple[str, str, str]:
        return self.engine, self.mode, self.dtype

    def _median(self, values: Sequence[float | None]) -> float | None:
        got = [v for v in values if v is not None]
        return statistics.median(got) if got else None

    @property
    def output_tok_s(self) -> float:
        return statistics.median(r.output_tok_s for r in self.runs)

    @property
    def spread(self) -> tuple[float, float]:
        rates = [r.output_tok_s for r in self.runs]
        return min(rates), max(rates)

    @property
    def total_tok_s(self) -> float:
        return statistics.median(r.total_tok_s for r in self.runs)

    @property
    def wall_s(self) -> float:
        return statistics.median(r.wall_s for r in self.runs)

    @property
    def busy_fraction(self) -> float | None:
        return self._median([r.busy_fraction for r in self.runs])

    @property
    def single_decode_tok_s(self) -> float | None:
        return self._median([r.single_decode_tok_s for r in self.runs])

    @property
    def peak_rss_bytes(self) -> int:
        return max(r.peak_rss_bytes for r in self.runs)

    @property
    def max_other_cpu_share(self) -> float | None:
        shares = [r.other_cpu_share for r in self.runs if r.other_cpu_share is not None]
        return max(shares) if shares else None

    @property
    def quiet(self) -> bool:
        share = self.max_other_cpu_share
        return share is not None and share <= BUSY_OTHER_CPU_SHARE


def summarize(results: Sequence[RunResult]) -> list[EngineSummary]:
    """Group runs by (engine, mode, dtype), in first-seen order."""
    groups: dict[tuple[str, str, str], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.engine, r.mode, r.dtype), []).append(r)
    return [EngineSummary(*key, runs=tuple(runs)) for key, runs in groups.items()]


def machine_was_busy(summaries: Sequence[EngineSummary]) -> bool:
    return not all(s.quiet for s in summaries)


def ratio_cell(a: EngineSummary | None, b: EngineSummary | None, allow_busy: bool) -> str:
    """``a``'s median output rate over ``b``'s, or why it is not printed."""
    if a is None or b is None:
        return "-"
    if not (a.quiet and b.quiet) and not allow_busy:
        return "busy"
    mark = "" if a.quiet and b.quiet else "*"
    return f"{a.output_tok_s / b.output_tok_s:.2f}{mark}"


RUN_HEADERS = (
    "engine", "mode", "dtype", "requests", "runs", "output tok/s (median)", "spread",
    "total tok/s", "wall s", "peak RSS MiB", "busy", "load before/after",
    "other CPU", "baton/HF", "baton/vLLM",
)  # fmt: skip
SINGLE_HEADERS = (
    "dtype", "baton decode tok/s", "HF decode tok/s", "weights MB", "memcpy GB/s",
    "floor tok/s", "baton/floor", "read GB/s", "read-bound tok/s", "baton/read-bound",
    "read around stream GB/s", "baton/read around stream", "baton/HF",
)  # fmt: skip


def _loads(s: EngineSummary) -> str:
    def pick(values: list[float | None]) -> str:
        got = [v for v in values if v is not None]
        return f"{max(got):.2f}" if got else "-"

    return f"{pick([r.load_before for r in s.runs])} / {pick([r.load_after for r in s.runs])}"


def run_table(summaries: Sequence[EngineSummary], allow_busy: bool = False) -> str:
    """One row per engine; baton rows carry ratios of medians to HF and vLLM at its dtype."""
    by_key = {(s.engine, s.dtype): s for s in summaries if s.engine != "baton"}
    rows = []
    for s in summaries:
        baton = s.engine == "baton"
        lo, hi = s.spread
        share = s.max_other_cpu_share
        rows.append([
            s.engine, s.mode, s.dtype, str(s.runs[0].num_requests), str(len(s.runs)),
            fmt(s.output_tok_s), f"{lo:.1f}-{hi:.1f}", fmt(s.total_tok_s), fmt(s.wall_s, 2),
            mib(s.peak_rss_bytes), fmt(s.busy_fraction, 3), _loads(s),
            "-" if share is None else f"{100 * share:.0f}%",
            ratio_cell(s, by_key.get(("hf", s.dtype)), allow_busy) if baton else "-",
            ratio_cell(s, by_key.get(("vllm", s.dtype)), allow_busy) if baton else "-",
        ])  # fmt: skip
    return markdown_table(RUN_HEADERS, rows)


def _plain_ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def single_table(singles: Sequence[SingleStream]) -> str:
    rows = [
        [
            s.dtype,
            fmt(s.baton_tok_s),
            fmt(s.hf_tok_s),
            f"{s.weight_bytes / 1e6:.0f}",
            f"{s.memcpy_bytes_per_s / 1e9:.1f}",
            fmt(s.floor_tok_s),
            _plain_ratio(s.baton_tok_s, s.floor_tok_s),
            "-" if s.read_bytes_per_s is None else f"{s.read_bytes_per_s / 1e9:.1f}",
            fmt(s.read_bound_tok_s),
            _plain_ratio(s.baton_tok_s, s.read_bound_tok_s),
            "-" if s.around_read_bytes_per_s is None else f"{s.around_read_bytes_per_s / 1e9:.1f}",
            fmt(s.around_ratio, 2),
            _plain_ratio(s.baton_tok_s, s.hf_tok_s),
        ]  # fmt: skip
        for s in singles
    ]
    return markdown_table(SINGLE_HEADERS, rows)


def async_over_sync(summaries: Sequence[EngineSummary], allow_busy: bool) -> list[str]:
    """One note per dtype: the asynchronous engine's median rate over the synchronous one's."""
    by_key = {s.key: s for s in summaries}
    notes = []
    for dtype in dict.fromkeys(s.dtype for s in summaries):
        sync = by_key.get(("baton", "sync", dtype))
        asyn = by_key.get(("baton", "async", dtype))
        if sync and asyn:
            cell = ratio_cell(asyn, sync, allow_busy)
            notes.append(f"{dtype}: baton async / sync output tok/s (medians) = {cell}.")
    return notes


def deterministic_over_default(
    summaries: Sequence[EngineSummary], allow_busy: bool, suffix: str = "-det"
) -> list[str]:
    """One note per baton mode and dtype run both ways: the deterministic mode's median
    output rate over the default's."""
    by_key = {s.key: s for s in summaries}
    notes = []
    for s in summaries:
        if s.engine != "baton" or not s.mode.endswith(suffix):
            continue
        default = by_key.get(("baton", s.mode.removesuffix(suffix), s.dtype))
        if default is not None:
            cell = ratio_cell(s, default, allow_busy)
            notes.append(
                f"{s.dtype}: baton {s.mode} / {default.mode} output tok/s (medians) = {cell}."
            )
    return notes


def render_report(
    header: Sequence[str],
    summaries: Sequence[EngineSummary],
    singles: Sequence[SingleStream],
    notes: Sequence[str],
    allow_busy: bool = False,
) -> str:
    """The whole report as markdown: header lines, both tables, then notes as a list."""
    parts = [*header, ""]
    if machine_was_busy(summaries):
        parts += [
            "**The machine was busy** (other processes took more than"
            f" {100 * BUSY_OTHER_CPU_SHARE:.0f}% of its CPU during at least one run):"
            + (
                " ratios marked * are printed on request (--allow-busy) and are not"
                " quiet-machine figures."
                if allow_busy
                else " ratios are withheld ('busy'); rerun on a quiet machine, or pass"
                " --allow-busy."
            ),
            "",
        ]
    parts += [run_table(summaries, allow_busy), "", "Single stream (batch 1, medians):", ""]
    parts += [single_table(singles), "", "Notes:", ""]
    parts += [f"- {n}" for n in [*async_over_sync(summaries, allow_busy), *notes]]
    return "\n".join(parts) + "\n"
