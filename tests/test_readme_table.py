"""The README's performance tables are exactly what benchmarks.readme_table writes from the
committed result files, so no figure there lacks a results file behind it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import readme_table


def test_readme_tables_are_generated_from_committed_results() -> None:
    assert readme_table.main(["--check"]) == 0, "run: python -m benchmarks.readme_table"


def test_rewrite_replaces_only_the_marked_block() -> None:
    readme = f"intro\n{readme_table.BEGIN}\nold 391 tok/s\n{readme_table.END}\noutro\n"
    block = f"{readme_table.BEGIN}\nnew\n{readme_table.END}"
    assert readme_table.rewrite(readme, block) == f"intro\n{block}\noutro\n"
    with pytest.raises(ValueError, match="markers"):
        readme_table.rewrite("no markers here", block)


def test_one_w1_table_per_host_kind_from_the_newest_run_of_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kernel speed depends on the CPU, so a run on one kind of host never replaces the
    table of another; runs that do not record their kind, and partial runs, make none."""

    def result(name: str, date: str, kind: str | None) -> Path:
        raw: dict[str, object] = {"date": date, "results": []}
        if kind is not None:
            raw["host_kind"] = kind
        (tmp_path / name).write_text(json.dumps(raw))
        return tmp_path / name

    result("w1_2026-12-03.json", "2026-12-03T10:00:00", None)
    old_avx512 = result("w1_2026-12-04.json", "2026-12-04T10:00:00", "AVX512-BF16 (no AMX)")
    avx512 = result("w1_2026-12-06.json", "2026-12-06T13:00:00", "AVX512-BF16 (no AMX)")
    avx2 = result("w1_2026-12-06_avx2.json", "2026-12-06T16:00:00", "AVX2")
    result("w1_2026-12-07_limit16.json", "2026-12-07T10:00:00", "AVX2")
    result("w1_deterministic_2026-12-07.json", "2026-12-07T10:00:00", "AVX2")
    monkeypatch.setattr(readme_table, "RESULTS", tmp_path)
    assert readme_table.newest_w1_per_kind() == [avx512, avx2]
    assert old_avx512 not in readme_table.newest_w1_per_kind()
