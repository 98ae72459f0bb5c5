"""Deterministic mode (``EngineConfig.deterministic``, ``--deterministic``) in bf16: a
request's tokens and logprobs are the same bits alone or in a batch of 63 others started
at other steps, at any prefill chunk size, and after preemption by recompute; without the
mode they are not. On the tiny random Llama, whose layers take the same kernels as
SmolLM2's (the bf16 GEMV linear kernel, the compiled attention)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.kernels import ops
from engine.kernels.cpu import cpu_kernels
from engine.kernels.route_table import GEMV, PANELS, deterministic_route
from engine.kv_layout import KVLayout
from engine.layers.attention import DETERMINISTIC_SPLIT
from engine.sampling_params import SamplingParams
from tests.engine_helpers import make_core
from tests.factories import make_tiny_model_dir

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="needs the compiled CPU kernels")

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(
    max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True, logprobs=3
)
# Longer than the 256-token KV split, so attention merges parts.
TARGET = [(7 * i + 3) % 4000 + 10 for i in range(300)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-determ"), vocab_size=4096)


Result = tuple[list[int], list[tuple[int, float, list[tuple[int, float]]]]]


def _run(core: Any, target: SamplingParams, others: int, target_step: int = 3) -> Result:
    """The target request's tokens and logprobs, added at ``target_step`` while
    ``others`` requests (prompts of 5-90 tokens, greedy and seeded, 4-40 tokens out)
    join at steps 0-8."""
    rng = random.Random(0)
    joins: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
    for i in range(others):
        prompt = [rng.randrange(10, 4000) for _ in range(rng.randrange(5, 90))]
        params = SamplingParams(
            max_tokens=rng.randrange(4, 40),
            temperature=rng.choice([0.0, 0.8]),
            seed=rng.randrange(1000),
            ignore_eos=True,
        )
        joins.setdefault(rng.randrange(0, 9), []).append((f"other-{i}", prompt, params))
    joins.setdefault(target_step, []).append(("target", TARGET, target))
    tokens: list[int] = []
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []
    step = 0
    while step <= max(joins) or core.has_work():
        for rid, prompt, params in joins.get(step, []):
            core.add_request(core.make_request(rid, prompt, params))
        for out in core.step():
            if out.request_id == "target":
                tokens.extend(out.new_token_ids)
                logprobs.extend((lp.token_id, lp.logprob, lp.top) for lp in out.logprobs or [])
        step += 1
    assert len(tokens) == target.max_tokens
    return tokens, logprobs


def _core(model: Path, deterministic: bool = True, **overrides: Any) -> Any:
    fields: dict[str, Any] = {
        "dtype": "bfloat16",
        "num_blocks": 1024,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 256,
        "deterministic": deterministic,
    }
    fields.update(overrides)
    return make_core(model, **fields)


@pytest.mark.parametrize(
    ("dtype", "params"),
    [("bfloat16", GREEDY), ("bfloat16", SEEDED), ("float32", SEEDED)],
    ids=["bf16-greedy", "bf16-seeded", "fp32-seeded"],
)
def test_alone_equals_in_a_batch_of_63(tiny: Path, dtype: str, params: SamplingParams) -> None:
    """fp32 runs on the other batch-invariant route, the panel kernel."""
    core = _core(tiny, dtype=dtype)
    route = GEMV if dtype == "bfloat16" and cpu_kernels().bf16_dot else PANELS
    assert {r for _, r in core.stats().cpu_kernel_routes} == {route}
    alone = _run(core, params, others=0)
    batched = _run(_core(tiny, dtype=dtype), params, others=63)
    assert batched == alone


def test_any_chunk_size_gives_the_same_bits(tiny: Path) -> None:
    results = {
        budget: _run(_core(tiny, max_num_batched_tokens=budget), SEEDED, others=0)
        for budget in (32, 128, 512)
    }
    # Unchunked: the whole prompt in one step.
    results[1024] = _run(_core(tiny, max_num_batched_tokens=1024), SEEDED, others=0)
    assert all(r == results[1024] for r in results.values()), {b: r[0] for b, r in results.items()}


def test_any_thread_count_gives_the_same_bits(tiny: Path) -> None:
    """The kernels split their work over the threads by output columns and by whole
    KV parts, never inside one dot product or one part."""
    one = _run(_core(tiny, num_threads=1), GREEDY, others=8)
    assert _run(_core(tiny, num_threads=2), GREEDY, others=8) == one


def test_preemption_by_recompute_gives_the_same_bits(tiny: Path) -> None:
    alone = _run(_core(tiny), SEEDED, others=0)
    # 48 blocks of 16 tokens cannot hold the target's 324 tokens beside 63 others.
    core = _core(tiny, num_blocks=48, kv_growth_tokens=0)
    assert _run(core, SEEDED, others=63) == alone
    assert core.stats().num_preemptions > 0


def test_default_mode_depends_on_the_batch(tiny: Path) -> None:
    """Documents the default: bf16 bits move with the batch (another linear kernel and
    another attention split for another batch shape). If this ever passes through, the
    default became batch-invariant and the README's Numerics section must say so."""
    alone = _run(_core(tiny, deterministic=False), GREEDY, others=0)
    batched = _run(_core(tiny, deterministic=False), GREEDY, others=63)
    assert batched[1] != alone[1]


def test_the_deterministic_linear_route_is_batch_invariant() -> None:
    """Row r of an M-row call is the same bits as row r alone, for every M the engine
    runs, on both batch-invariant routes (what ``deterministic_route`` picks among)."""
    torch.manual_seed(0)
    w = (torch.randn(320, 192) * 0.05).bfloat16()
    panels = ops.pack_panels(w)
    x = torch.randn(512, 192).bfloat16()
    routes = [PANELS] + ([GEMV] if cpu_kernels().bf16_dot else [])
    for route in routes:
        alone = torch.cat([ops.run_route(route, x[r : r + 1], w, None, None, None, panels)
                           for r in range(0, 512, 37)])  # fmt: skip
        for m in (1, 3, 4, 5, 17, 64, 65, 128, 512):
            out = ops.run_route(route, x[:m], w, None, None, None, panels)
            rows = list(range(0, m, 37))
            assert torch.equal(out[rows], alone[: len(rows)]), (route, m)


def test_deterministic_route_choice() -> None:
    assert deterministic_route("bfloat16", bf16_dot=True, gemv_fits=True) == GEMV
    assert deterministic_route("bfloat16", bf16_dot=False, gemv_fits=True) == PANELS
    assert deterministic_route("bfloat16", bf16_dot=True, gemv_fits=False) == PANELS
    assert deterministic_route("float32", bf16_dot=True, gemv_fits=True) == PANELS


def test_attention_split_ignores_the_batch() -> None:
    """A query's output over a 600-token context (three parts) is the same bits alone
    and beside shorter and longer rows, in any order, with the fixed split."""
    kernels = cpu_kernels()
    torch.manual_seed(1)
    bs, hkv, d, nb = 16, 2, 64, 128
    cache = (torch.randn(1, 2, hkv, nb, bs, d) * 0.5).bfloat16()
    q = torch.randn(3, 4, d).bfloat16()
    tables = torch.stack([torch.randperm(nb)[:64] for _ in range(3)])
    lens = torch.tensor([600, 40, 1000])

    def attend(rows: list[int], split: int) -> torch.Tensor:
        out = torch.empty(len(rows), 4, d, dtype=torch.bfloat16)
        kernels.ops.decode_attention(
            out, q[rows].contiguous(), cache, 0, tables[rows].contiguous(),
            lens[rows].contiguous(), d**-0.5, 0, split,
        )  # fmt: skip
        return out

    alone = attend([0], DETERMINISTIC_SPLIT)
    assert torch.equal(attend([0, 1, 2], DETERMINISTIC_SPLIT)[0], alone[0])
    assert torch.equal(attend([1, 0], DETERMINISTIC_SPLIT)[1], alone[0])


def test_a_model_the_kernels_cannot_run_deterministically_is_refused_at_start(
    tmp_path: Path,
) -> None:
    """Head dim 8 is outside the compiled attention kernel: the start fails naming why,
    rather than serving on a path whose bits move with the batch."""
    model = make_tiny_model_dir(tmp_path, vocab_size=512, hidden_size=32, head_dim=8)
    with pytest.raises(ValueError, match="compiled CPU attention kernel: head_dim 8"):
        _core(model)


def test_layout_handshake_refuses_mixed_modes() -> None:
    plain = KVLayout(2, 16, 2, 16, "bfloat16")
    determ = KVLayout(2, 16, 2, 16, "bfloat16", deterministic=True)
    assert plain.mismatch(determ) == "deterministic: False != True"
    assert determ.mismatch(KVLayout(2, 16, 2, 16, "bfloat16", deterministic=True)) is None
