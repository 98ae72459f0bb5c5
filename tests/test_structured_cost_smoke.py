"""Smoke test of the structured-output benchmark: baton's two legs interleaved over two runs
on a tiny random model with SmolLM2's tokenizer, vLLM's legs skipped; the report's fields,
the judging of constrained outputs, and the leg-worker protocol with a plain Python child.
It asserts nothing about speed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import common, structured_cost, structured_schemas
from benchmarks.leg_worker import LegWorker
from tests.factories import make_tiny_model_dir, smollm2_files


def _workload(path: Path, n: int) -> Path:
    requests = [
        {
            "id": i,
            "prompt_len": 6 + i,
            "output_len": 4 + i,
            "prompt_token_ids": common.fixed_prompt(i, 6 + i),
        }
        for i in range(n)
    ]
    path.write_text(json.dumps({"name": "tiny", "requests": requests}))
    return path


def test_report_has_every_leg_the_costs_and_the_judged_outputs(tmp_path: Path) -> None:
    model = make_tiny_model_dir(tmp_path / "model", tokenizer_from=smollm2_files().path)
    workload = _workload(tmp_path / "w.json", 5)
    md = structured_cost.main(
        [
            "--model", str(model),
            "--workload", str(workload),
            "--runs", "2",
            "--dtype", "float32",
            "--threads", "1",
            "--kv-gib", "0.01",
            "--max-model-len", "128",
            "--vllm-python", str(tmp_path / "no-vllm" / "python"),
            "--results-dir", str(tmp_path / "results"),
        ]
    )  # fmt: skip

    assert md.name.startswith("structured_cost_") and md.name.endswith("_float32.md")
    text = md.read_text()
    assert "vLLM-CPU skipped: no interpreter" in text
    assert "git revision:" in text and "ISA: " in text and "Load average" in text
    assert "| engine | ratio of medians | per run | cost |" in text
    assert "| engine | constrained outputs | valid | invalid | unfinished |" in text
    assert "| mode | baton / vLLM-CPU |" in text and "| baton | free | 2 |" in text
    assert "Target: the constraint costs baton <= 10%: " in text
    raw = json.loads(md.with_suffix(".json").read_text())
    assert raw["host_kind"] and raw["git_revision"] and raw["num_requests"] == 5
    order = [(leg["engine"], leg["mode"], leg["run"]) for leg in raw["legs"]]
    assert order == [("baton", "free", 1), ("baton", "constrained", 1)] + [
        ("baton", "free", 2),
        ("baton", "constrained", 2),
    ]
    for leg in raw["legs"]:
        assert leg["tokens"] == leg["expected_tokens"] == 4 + 5 + 6 + 7 + 8
        assert leg["output_tok_s"] > 0 and leg["load"]["others_cores"] >= 0
    constrained = [leg for leg in raw["legs"] if leg["mode"] == "constrained"]
    for leg in constrained:
        # Requests 0 and 4 are constrained, under the first two schemas.
        assert leg["outcomes"]["constrained"] == 2
        assert leg["outcomes"]["invalid"] == 0  # the constraint held, finished or not
        assert leg["free_rows_same_as_free_pass"] == 3  # fp32: the free rows are untouched
        assert leg["probe"]["masks_s"] > 0 and leg["probe"]["accept_s"] >= 0
    for leg in raw["legs"]:
        probe = leg["probe"]
        assert 0 < probe["forward_s"] <= leg["wall_s"] and probe["steps"] > 0
        assert probe["prefix_hit_tokens"] == 0  # each pass prefills its prompts afresh
        assert probe["masks_s"] + probe["accept_s"] <= probe["sample_s"] + 1e-3  # rounding
    assert "| run | mode | wall | forward | sample | masks | accept | fill ahead | steps |" in text
    cost = raw["summary"]["constrained_over_free"]["baton"]
    assert cost["of_medians"] > 0 and len(cost["per_run"]) == 2
    assert raw["summary"]["baton_over_vllm"] == {}
    assert {s["mode"] for s in raw["summary"]["legs"]} == {"free", "constrained"}


def test_judging_tells_valid_invalid_and_unfinished_apart() -> None:
    requests = [common.W1Request(f"r{i}", [1], 8) for i in range(9)]
    texts = {
        "r0": '{"name": "Ada", "age": 36, "status": "active"}',  # person: valid
        "r4": '{"order_id": 0, "lines": []}',  # order_lines: out of bounds, empty array
        "r8": '{"label": "posi',  # sentiment: no EOS
    }
    eos = 1  # no character of the texts
    ids = {rid: [ord(c) for c in t] + ([eos] if rid != "r8" else []) for rid, t in texts.items()}
    outputs = {r.request_id: ids.get(r.request_id, [5]) for r in requests}
    verdicts = structured_cost.judge(
        requests, outputs, 4, [eos], lambda xs: "".join(chr(x) for x in xs)
    )
    assert [(v.request_id, v.schema, v.finished, v.valid) for v in verdicts] == [
        ("r0", "person", True, True),
        ("r4", "order_lines", True, False),
        ("r8", "sentiment", False, False),
    ]
    assert structured_schemas.outcome_counts(verdicts) == {
        "constrained": 3,
        "valid": 1,
        "invalid": 1,
        "unfinished": 1,
    }


def test_every_schema_is_a_valid_draft_and_taken_in_turn() -> None:
    import jsonschema

    for _, schema in structured_schemas.SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)
    picked = [structured_schemas.schema_for(i) for i in range(20)]
    names = [p[0] for p in picked if p is not None]
    assert names == ["person", "order_lines", "sentiment", "reading", "person"]
    assert structured_schemas.schema_for(3) is None and structured_schemas.schema_for(0, 0) is None


_CHILD = """
import sys
sys.path.insert(0, {root!r})
from benchmarks import leg_worker
print("engine log line", flush=True)
leg_worker.serve(lambda c: {{"twice": 2 * c["x"]}})
"""


def test_leg_worker_runs_legs_until_told_to_quit(tmp_path: Path) -> None:
    root = str(Path(structured_cost.REPO))
    argv = [sys.executable, "-c", _CHILD.format(root=root)]
    worker = LegWorker("toy", argv, {}, tmp_path, timeout_s=30)
    try:
        worker.ready()
        assert worker.run({"x": 3}) == {"twice": 6}
        assert worker.run({"x": 5}) == {"twice": 10}
    finally:
        worker.close()
    assert worker.proc.returncode == 0


def test_a_worker_that_dies_is_reported_with_its_last_lines(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "print('loading'); raise SystemExit('no engine')"]
    worker = LegWorker("dead", argv, {}, tmp_path, timeout_s=30)
    with pytest.raises(RuntimeError, match="dead worker exited"):
        worker.ready()
    worker.close()
