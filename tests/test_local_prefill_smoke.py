"""Smoke test of the local-against-remote prefill benchmark on the tiny model: both
deployments run, and the tables and JSON have every length and both modes. Nothing
about speed."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import local_prefill, provenance


def test_local_prefill_harness_end_to_end(tmp_path: Path, tiny_llama: Path) -> None:
    md = local_prefill.main([
        "--model", str(tiny_llama), "--lengths", "16,48", "--repeats", "2", "--rounds", "1",
        "--dtype", "float32", "--results-dir", str(tmp_path),
    ])  # fmt: skip
    text = md.read_text()
    assert md.name.startswith("local_prefill_") and provenance.isa_line() in text
    assert "| 16 |" in text and "| 48 |" in text
    assert "Local prefill was faster at:" in text
    raw = json.loads(md.with_suffix(".json").read_text())
    for mode in ("remote", "local"):
        assert sorted(raw[mode]["ttft_s"]) == ["16", "48"]
        assert all(len(v) == 2 for v in raw[mode]["ttft_s"].values())
        assert raw[mode]["itl_s"], mode  # the background stream decoded throughout
