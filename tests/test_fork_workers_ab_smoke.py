"""Smoke test of the forked-against-fresh workers A/B on the tiny model: both legs start
a deployment (one with forked workers, one with fresh ones), serve the long prompt and
the streams, and the report has a row per leg and the medians. Nothing about speed."""

from __future__ import annotations

from pathlib import Path

from benchmarks import fork_workers_ab


def test_both_legs_serve_and_the_table_is_written(tmp_path: Path, tiny_llama: Path) -> None:
    out = tmp_path / "fork.md"
    fork_workers_ab.main(
        ["--runs", "1", "--long", "200", "--streams", "2", "--model", str(tiny_llama),
         "--dtype", "float32", "--out", str(out)]
    )  # fmt: skip
    text = out.read_text()
    assert "Command: `python -m benchmarks.fork_workers_ab --runs 1" in text
    assert "| forked | 1 | ForkedProcess |" in text
    assert "| fresh | 1 | Popen |" in text
    assert "| 200-token prompt, s |" in text and "| 2 streams x 64 tokens, output tok/s |" in text
