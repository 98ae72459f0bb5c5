"""Smoke test of the decode fail-over benchmark: the harness end to end on the tiny model.

Six long greedy requests through one prefill and two decode workers (real processes on
loopback), three times: undisturbed, with kill -9 of the busier decode worker, with
SIGTERM on it. Checks the tables and the JSON, and that the disturbed phases lost no
request. Nothing about speed.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import common, decode_failover, provenance

OUTPUT_TOKENS = 400


def _workload(path: Path) -> Path:
    requests = [
        {
            "id": i,
            "prompt_len": 24,
            "output_len": OUTPUT_TOKENS,
            "prompt_token_ids": common.fixed_prompt(100 + i, 24),
        }
        for i in range(6)
    ]
    path.write_text(json.dumps({"name": "tiny", "requests": requests}))
    return path


def test_failover_harness_end_to_end(tmp_path: Path, tiny_llama: Path) -> None:
    md = decode_failover.main([
        "--model", str(tiny_llama), "--workload", str(_workload(tmp_path / "w.json")),
        "--requests", "6", "--rate", "20", "--at", "0.9", "--dtype", "float32",
        "--max-model-len", "512", "--results-dir", str(tmp_path / "results"),
    ])  # fmt: skip
    text = md.read_text()
    assert md.name.startswith("decode_failover_") and md.name.endswith("_float32.md")
    assert "Command: `python -m benchmarks.decode_failover --model" in text
    assert provenance.isa_line() in text
    for phase in decode_failover.PHASES:
        assert f"| {phase} | 6/6 | 0 |" in text, text
    raw = json.loads(md.with_suffix(".json").read_text())
    phases = raw["phases"]
    assert set(phases) == set(decode_failover.PHASES)
    assert phases["undisturbed"]["moves"] == 0
    assert phases["kill -9"]["moves"] >= 1, phases["kill -9"]
    for p in phases.values():
        assert p["output_tokens"] == 6 * OUTPUT_TOKENS
