"""Smoke test of benchmarks.workers_on_one_host: a tiny model, two configurations' worth
of deployments (core plan on and off), one short burst each. It proves the code path,
the results file's provenance, ISA and table; it asserts nothing about speed."""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks import workers_on_one_host


def test_runs_plan_on_and_off_and_writes_the_table(tiny_llama: Path, tmp_path: Path) -> None:
    md = workers_on_one_host.main(
        [
            "--model",
            str(tiny_llama),
            "--dtype",
            "float32",
            "--configs",
            "decode2",
            "--plans",
            "on,off",
            "--streams",
            "2",
            "--max-tokens",
            "4",
            "--prompt-len",
            "8",
            "--runs",
            "1",
            "--start-timeout-s",
            "180",
            "--results-dir",
            str(tmp_path),
        ]
    )
    text = md.read_text()
    assert md.parent == tmp_path and md.name.startswith("workers_on_one_host_")
    assert "Command: `python -m benchmarks.workers_on_one_host --model" in text
    assert "CPU flags:" in text and "git revision:" in text and "Load average" in text
    assert "| `--decode-workers 2` | on, lending |" in text
    assert "| `--decode-workers 2` | off |" in text
    raw = json.loads(md.with_suffix(".json").read_text())
    on, off = raw["results"]
    assert (on["core_plan"], off["core_plan"]) == ("on", "off")
    # Three workers on a CI host of 2 cores own the cores in turn and lend them; on one
    # CPU there is nothing to lend.
    assert on["lending"] == (len(os.sched_getaffinity(0)) >= 2) and not off["lending"]
    assert [w["kind"] for w in on["workers"]] == ["prefill", "decode", "decode"]
    # Plan on: every worker has CPUs and a team; off: none (each sizes from the host).
    assert all(w["cpus"] and w["threads"] >= 1 for w in on["workers"])
    assert all(w["cpus"] is None for w in off["workers"])
    for r in raw["results"]:
        assert r["median_wall_s"] > 0 and r["others_cores"] >= 0
        assert r["median_output_tok_s"] == 2 * 4 / r["median_wall_s"]
