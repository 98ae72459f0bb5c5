"""Smoke test of the transport benchmark: shm, gloo and nixl on the same tiny leases, the
table and the JSON, the machine and its CPU flags named. Nothing about speed."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import transfer_transports
from benchmarks.provenance import isa_line
from engine.transfer.nixl_agent import nixl_available


def test_every_transport_moves_the_same_leases(tmp_path: Path) -> None:
    md = transfer_transports.main(
        ["--sizes", "4096,16384", "--leases", "2", "--rounds", "1", "--results-dir", str(tmp_path)]
    )
    text = md.read_text()
    assert md.name.startswith("transfer_transports_") and md.suffix == ".md"
    assert isa_line() in text
    raw = json.loads(md.with_suffix(".json").read_text())
    assert raw["cpu_flags"] == isa_line()
    rows = {(r["kind"], r["lease_bytes"]): r for r in raw["rows"]}
    assert set(rows) == {(k, s) for k in ("shm", "gloo", "nixl") for s in (4096, 16384)}
    for (kind, size), row in rows.items():
        if kind == "nixl" and not nixl_available():
            assert "error" in row and "could not run" in text
            continue
        assert row["leases"] == 2 and row["lease_gbps"] > 0, row
        assert row["lease_p50_ms"] <= row["lease_max_ms"]
        assert f"| {size // 1024} KiB | {kind} |" in text
