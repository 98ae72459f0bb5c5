"""``benchmarks.provenance.publish``: where the small benchmarks' reports land."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_a_small_benchmark_report_is_written_under_its_dated_and_host_kind_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import datetime as dt

    from benchmarks import provenance

    monkeypatch.setattr(provenance, "RESULTS", tmp_path)
    path = provenance.publish("# report", "gemv_read", "_bfloat16")
    slug = provenance.host_slug(provenance.host_kind(provenance.isa_flags()))
    assert path == tmp_path / f"gemv_read_{dt.date.today()}_bfloat16_{slug}.md"
    assert path.read_text() == "# report"
    assert provenance.publish("# other", "x", out=tmp_path / "given.md") == tmp_path / "given.md"
    assert capsys.readouterr().out.count("wrote ") == 2
