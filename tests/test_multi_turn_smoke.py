"""Smoke test of the multi-turn benchmark on the tiny model: the workload is what its
spec says, the driver replays real conversations through baton's OpenAI endpoint under
``--routing kv``, follow-up turns find their history cached, and the report's tables
and verdict come out of the record. Nothing about speed; vLLM is left out."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import multi_turn, multi_turn_report, provenance
from benchmarks import multi_turn_workload as workload


def test_workload_is_deterministic_and_tokenizes_to_the_drawn_sizes(tiny_llama: Path) -> None:
    tok = workload.load_tokenizer(tiny_llama)
    spec = workload.WorkloadSpec(conversations=6, turns=3, group_size=3, rate=2.0, seed=5)
    convs = workload.build(spec, tok)
    assert convs == workload.build(spec, tok)
    assert [c.start_s for c in convs] == [i / 2.0 for i in range(6)]
    assert [c.group for c in convs] == [0, 0, 0, 1, 1, 1]
    assert convs[0].system == convs[2].system != convs[3].system
    for c in convs:
        n = len(tok.encode(c.system, add_special_tokens=False).ids)
        assert n == c.system_tokens and 1000 <= n <= 2000
        assert len(c.turns) == 3
        for t in c.turns:
            assert len(tok.encode(t.user, add_special_tokens=False).ids) == t.user_tokens
            assert 50 <= t.user_tokens <= 200 and 64 <= t.max_tokens <= 128


def test_harness_end_to_end_under_kv_routing(tmp_path: Path, tiny_llama: Path) -> None:
    # Two conversations in groups of their own: only a follow-up turn can find its
    # prompt's blocks cached, so any cache hit is a follow-up's. Replies long enough that
    # the workers' KV events of a turn reach the gateway before the next turn is routed.
    md = multi_turn.main([
        "--model", str(tiny_llama), "--dtype", "float32", "--deployments", "kv",
        "--conversations", "2", "--turns", "2", "--group-size", "1",
        "--system-tokens", "48,64", "--user-tokens", "8,16", "--reply-tokens", "24,32",
        "--rate", "20", "--max-model-len", "512", "--results-dir", str(tmp_path),
    ])  # fmt: skip
    text = md.read_text()
    assert md.name.startswith("multi_turn_") and provenance.isa_line() in text
    assert "| **kv** | `--routing kv --local-prefill-tokens 0` |" in text
    assert "Target: not judged" in text and "others' cores" in text
    raw = json.loads(md.with_suffix(".json").read_text())
    (leg,) = raw["legs"]["kv"]
    assert leg["completed"] == leg["expected_turns"] == 4 and leg["failed"] == 0
    assert [t["turn"] for t in leg["turns"]].count(1) == 2
    assert all(24 <= t["output_tokens"] <= 32 for t in leg["turns"])
    follow, first = ([t["prompt_tokens"] for t in leg["turns"] if t["turn"] == k] for k in (1, 0))
    assert min(follow) > max(first)  # a follow-up carries the history
    assert 0 < leg["p50_ttft_ms"] <= leg["p99_ttft_ms"]
    assert leg["output_throughput"] > 0
    assert leg["routed_prompt_tokens"] >= sum(follow) + sum(first)
    assert 0 < leg["routing_hit_rate"] < 1  # the follow-ups' history, found where routed
    assert leg["engine_hit_rate"] > 0
    assert leg["remote_prefills"] == 4 and leg["local_prefills"] == 0  # the warm-up not counted
    assert leg["transfer_bytes"] > 0
    assert set(leg["phases"]) == {t["id"] for t in leg["turns"]}


def _leg(p99: float, tok_s: float) -> dict:
    return {"p99_ttft_ms": p99, "output_throughput": tok_s}


def test_verdict_needs_double_the_tail_at_equal_throughput() -> None:
    s = {"load": _leg(1000, 100), "kv+cond": _leg(400, 101), "vllm": _leg(500, 120)}
    text = multi_turn_report.verdict(s)
    assert "2.50x" in text and "**met**." in text.split("  \n")[0]
    assert "400 against 500 ms (1.25x): **met**." in text
    s["kv+cond"] = _leg(800, 100)
    assert "**missed** (by 1.60x)" in multi_turn_report.verdict(s)
    s["kv+cond"] = _leg(400, 80)  # faster first tokens bought with throughput: no verdict
    assert "**not judged** (throughputs differ)" in multi_turn_report.verdict(s)


def test_the_no_lending_leg_differs_from_kv_cond_only_by_core_lending() -> None:
    opts = multi_turn._parser().parse_args(["--deployments", "kv+cond,kv+cond-nolend"])
    opts.model_dir = Path("unused")
    lend, keep = (multi_turn.baton_spec(n, opts) for n in ("kv+cond", "kv+cond-nolend"))
    assert lend.core_lending and not keep.core_lending
    assert lend.gateway_args == keep.gateway_args
    assert (lend.num_prefill, lend.num_decode) == (keep.num_prefill, keep.num_decode) == (2, 2)
    assert "kv+cond-nolend" not in multi_turn.DEFAULT_DEPLOYMENTS
