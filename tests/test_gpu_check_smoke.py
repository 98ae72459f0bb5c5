"""The GPU check's measuring code, run on the CPU on the tiny model: every section
produces its table, parity holds in fp32, and W1 regenerated from its stated generator
is the workload file. The figures themselves mean nothing here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import common, gpu_check


def test_w1_regenerated_from_its_generator_is_the_workload_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not common.DEFAULT_WORKLOAD.is_file():  # it lives outside the repository
        pytest.skip(f"no W1 workload file at {common.DEFAULT_WORKLOAD} to compare with")
    from_file = gpu_check.w1_requests()
    monkeypatch.setattr(common, "DEFAULT_WORKLOAD", Path("/nonexistent/workload.json"))
    assert gpu_check.w1_requests() == from_file
    assert sum(r.output_len for r in from_file) == 7423


def test_sections_run_and_report_on_the_cpu(tiny_llama: Path, tmp_path: Path) -> None:
    sections = [
        gpu_check.parity(tiny_llama, "cpu", ("float32",), num_prompts=3, new_tokens=5),
        gpu_check.decode_step(
            tiny_llama, "cpu", "float32", batches=(1, 2), context=20, steps=4, bandwidth_mib=16
        ),
        gpu_check.w1(tiny_llama, "cpu", ("float32",), hf_batches=(2,), limit=3, max_output=4),
    ]
    for s in sections:
        assert s.error is None and s.markdown.startswith("|"), s
    verdicts = [v for v, _ in sections[0].raw["float32"]["verdicts"]]
    assert "mismatch" not in verdicts, verdicts
    decode = sections[1].raw
    assert decode["bandwidth_bytes_per_s"] > 0 and decode["batch_2"]["floor_s"] > 0
    assert {"baton-float32", "hf2-float32"} <= set(sections[2].raw)
    text = gpu_check.render(sections, "cpu")
    assert text.count("### ") == 3 and "FAILED" not in text
    (tmp_path / "raw.json").write_text(json.dumps([s.raw for s in sections], default=str))
    print(text)


def test_a_failing_section_is_reported_and_the_rest_still_run(tiny_llama: Path) -> None:
    sections = gpu_check.run_sections(["parity", "decode"], tiny_llama, "cpu", ("int4",))
    assert all(s.error is not None for s in sections)
    assert "FAILED" in gpu_check.render(sections, "cpu")
