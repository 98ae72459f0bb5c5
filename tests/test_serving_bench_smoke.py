"""Smoke test of the serving benchmark: the harness end to end on three tiny requests.

Runs single-process and pinned disaggregated deployments of the tiny random Llama (real
processes on loopback), the in-process baseline child and the shm transfer measurement,
then checks the structure of the tables, the JSON and the plots. Nothing about speed.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from benchmarks import common, serving, serving_plots

REQUESTS = [(common.fixed_prompt(11, 20), 5), (common.fixed_prompt(12, 9), 3),
            (common.fixed_prompt(13, 33), 4)]  # fmt: skip


def _tiny_workload(path: Path) -> Path:
    requests = [
        {"id": i, "prompt_len": len(ids), "output_len": out, "prompt_token_ids": ids}
        for i, (ids, out) in enumerate(REQUESTS)
    ]
    path.write_text(json.dumps({"name": "tiny", "requests": requests}))
    return path


def test_serving_harness_end_to_end(tmp_path: Path, tiny_llama: Path) -> None:
    plots = importlib.util.find_spec("matplotlib") is not None
    results_dir = tmp_path / "results"
    md = serving.main([
        "--model", str(tiny_llama), "--workload", str(_tiny_workload(tmp_path / "w.json")),
        "--configs", "a,c", "--dtype", "float32", "--rate", "4",
        "--kv-cache-bytes", str(4 << 20), "--max-model-len", "128",
        "--bw-kinds", "shm", "--bw-blocks-per-job", "2", "--bw-repeats", "2",
        "--bw-rounds", "1", "--results-dir", str(results_dir),
        *([] if plots else ["--no-plots"]),
    ])  # fmt: skip

    text = md.read_text()
    assert md.parent == results_dir and md.name.startswith("serving_")
    for heading in ("Offline W1", "Online (Poisson arrivals, 4.00 req/s", "KV transfer",
                    "Targets:", "in-process AsyncEngine"):  # fmt: skip
        assert heading in text
    assert text.count("PASS") + text.count("FAIL") == 3  # overhead, c vs a, shm vs memcpy
    assert "Offline output ids are identical in a, c, in-process." in text

    raw = json.loads(md.with_suffix(".json").read_text())
    assert [c["key"] for c in raw["configs"]] == ["a", "c"]
    assert raw["configs"][1]["cpus"] == {"prefill": [0], "decode": [1]}
    prompt_tokens = sum(len(ids) for ids, _ in REQUESTS)
    for c in raw["configs"]:
        for phase in ("offline", "online"):
            p = c[phase]
            assert p["num_requests"] == 3 and p["output_tokens"] == 12
            assert p["prompt_tokens"] == prompt_tokens
            assert p["wall_s"] > 0 and p["output_tok_s"] > 0
            assert len(p["ttft_s"]) == 3 and len(p["tpot_s"]) == 3
            assert 0 < p["ttft_p50_s"] <= p["ttft_p99_s"]
            assert 0 < p["tpot_p50_s"] <= p["tpot_p99_s"]
        assert c["online"]["rate_req_s"] == 4.0 and c["offline"]["rate_req_s"] is None
    assert raw["in_process"]["num_requests"] == 3 and raw["in_process"]["output_tokens"] == 12
    (bw,) = raw["bandwidth"]
    assert bw["kind"] == "shm" and bw["tokens_per_job"] == 32 and bw["jobs"] == 2
    assert bw["transport_gbps"] > 0 and bw["memcpy_gbps"] > 0
    assert {t["passed"] for t in raw["targets"]} <= {True, False} and len(raw["targets"]) == 3
    if plots:
        for suffix in ("_latency.png", "_throughput.png"):
            png = md.with_name(md.stem + suffix)
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_tables_are_written_and_one_line_says_why(
    tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as without the bench extra
    # A made-up run: what matters here is what happens after it.
    monkeypatch.setattr(serving, "run_all", lambda opts: {"configs": []})
    monkeypatch.setattr(serving, "render", lambda raw, header: "\n".join(header) + "\n| t |\n")
    argv = ["--model", str(tiny_llama), "--configs", "a", "--results-dir", str(tmp_path)]
    md = serving.main(argv)
    assert "| t |" in md.read_text() and "Plots:" not in md.read_text()
    assert json.loads(md.with_suffix(".json").read_text())["configs"] == []
    assert not list(tmp_path.glob("*.png"))
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("no plot: matplotlib is not installed") and str(md) in line
    # Re-plotting a run's JSON is all serving_plots does: one line, and a failing status.
    with pytest.raises(SystemExit) as exited:
        serving_plots.main([str(md.with_suffix(".json"))])
    assert exited.value.code == 1 and not list(tmp_path.glob("*.png"))
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("no plot: matplotlib is not installed")


def test_percentile_interpolates_like_numpy() -> None:
    assert serving.percentile([], 50) is None
    assert serving.percentile([3.0], 99) == 3.0
    assert serving.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert serving.percentile([0.0, 10.0], 99) == 9.9


def test_online_prompts_differ_from_offline_in_the_first_id_only() -> None:
    reqs = [common.W1Request("w1-0", [1000, 5, 6], 4), common.W1Request("w1-1", [39999, 7], 2)]
    online = serving.online_requests(reqs, 2)
    assert [r.prompt_token_ids for r in online] == [[1001, 5, 6], [1000, 7]]
    assert [(r.request_id, r.output_len) for r in online] == [("w1-0", 4), ("w1-1", 2)]
