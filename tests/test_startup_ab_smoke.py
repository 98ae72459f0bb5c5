"""Smoke test of the start-up A/B harness on a tiny GGUF and the tiny model: both trees
convert, start a decode worker, load a gateway and start a deployment, and the report has
a row per run and the medians. It asserts nothing about speed."""

from __future__ import annotations

from pathlib import Path

from benchmarks import startup_ab
from tests.factories import TINY_GGUF_VOCAB_SIZE, make_tiny_gguf, make_tiny_model_dir


def test_harness_times_both_trees_and_writes_the_table(tmp_path: Path, tiny_llama: Path) -> None:
    src = make_tiny_model_dir(tmp_path / "src", vocab_size=TINY_GGUF_VOCAB_SIZE)
    gguf = make_tiny_gguf(tmp_path / "tiny.gguf", src)
    out = tmp_path / "startup.md"
    startup_ab.main(
        ["--base", "HEAD", "--runs", "1", "--gguf", str(gguf), "--model", str(tiny_llama),
         "--out", str(out)]
    )  # fmt: skip
    text = out.read_text()
    assert "Command: `python -m benchmarks.startup_ab --base HEAD" in text
    assert "ISA: " in text and "Load average" in text
    rows = [line for line in text.splitlines() if line.startswith(("| base ", "| new "))]
    assert len(rows) == 2  # one run of each tree
    assert "| convert |" in text and "| decode worker to SERVING |" in text
    assert "| gateway to model ready |" in text and "| gateway CPU to model ready |" in text
    assert "| deployment to serving |" in text
