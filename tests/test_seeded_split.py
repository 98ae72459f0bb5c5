"""Seeded sampling is a function of (seed, output position): any split of the work draws
the tokens one engine would.

Driven without gRPC: one ``EngineCore`` plays the prefill worker (samples position 0 and
holds the prompt's KV), its blocks are copied into a second core that plays the decode
worker (``reserve_remote`` + ``remote_kv_ready``), which samples the rest.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.engine_core import EngineCore
from engine.sampler import position_generator, position_seed
from engine.sampling_params import SamplingParams
from tests.engine_helpers import make_core

PROMPT = [5, 17, 923, 4401, 12, 77, 3001, 8, 64, 1000, 2, 9, 31, 4, 88, 19, 7, 6]


def _run(core: EngineCore, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    core.add_request(core.make_request(rid, prompt, params))
    out: list[int] = []
    while core.has_work():
        for o in core.step():
            if o.request_id == rid:
                out.extend(o.new_token_ids)
    return out


def _split(
    prefill: EngineCore, decode: EngineCore, rid: str, prompt: list[int], params: SamplingParams
) -> list[int]:
    first_params = SamplingParams(**{**_fields(params), "max_tokens": 1})
    prefill.add_request(prefill.make_request(rid, prompt, first_params, hold_kv=True))
    first = held = None
    while prefill.has_work():
        for o in prefill.step():
            if o.request_id == rid and o.finished:
                first, held = o.new_token_ids[0], o.held_block_ids
    assert first is not None and held is not None
    req = decode.make_request(rid, prompt, params)
    dst = decode.scheduler.reserve_remote(req)
    src_kv = prefill.runner.kv_cache
    dst_kv = decode.runner.kv_cache
    dst_kv[:, :, :, dst] = src_kv[:, :, :, held]  # the transfer, in one copy
    prefill.scheduler.release_held(rid)
    assert decode.scheduler.remote_kv_ready(rid, first) is None
    rest: list[int] = []
    while decode.has_work():
        for o in decode.step():
            if o.request_id == rid:
                rest.extend(o.new_token_ids)
    return [first, *rest]


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__dataclass_fields__}


def test_split_draws_the_same_tokens_as_one_engine(tiny_llama: Path) -> None:
    params = SamplingParams(max_tokens=24, temperature=1.3, top_p=0.95, seed=2024, ignore_eos=True)
    whole = _run(make_core(tiny_llama), "a", PROMPT, params)
    # Different seeds of the engines themselves: only the request's seed may matter.
    split = _split(
        make_core(tiny_llama, seed=1), make_core(tiny_llama, seed=2), "a", PROMPT, params
    )
    assert split == whole
    # Sampled for real: another seed gives another continuation.
    other = _run(
        make_core(tiny_llama), "b", PROMPT, SamplingParams(**{**_fields(params), "seed": 7})
    )
    assert other != whole


def test_preemption_redraws_the_same_tokens(tiny_llama: Path) -> None:
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=99, ignore_eos=True)
    roomy = make_core(tiny_llama)
    alone = _run(roomy, "a", PROMPT, params)
    # Five blocks of 16 tokens for four requests of 58 tokens each: they preempt each other.
    tight = make_core(tiny_llama, num_blocks=8, max_num_batched_tokens=64)
    for i in range(3):
        tight.add_request(tight.make_request(f"x{i}", PROMPT[i:] + [i], params))
    crowded = _run(tight, "a", PROMPT, params)
    assert tight.stats().num_preemptions > 0
    assert crowded == alone


def test_position_streams_are_distinct_and_reproducible() -> None:
    seeds = {position_seed(s, p) for s in range(50) for p in range(50)}
    assert len(seeds) == 2500 and all(0 <= x < 2**63 for x in seeds)
    cpu = torch.device("cpu")
    a = torch.empty(8).exponential_(generator=position_generator(cpu, 3, 4))
    b = torch.empty(8).exponential_(generator=position_generator(cpu, 3, 4))
    c = torch.empty(8).exponential_(generator=position_generator(cpu, 4, 3))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_moved_request_draws_the_same_tokens_as_an_undisturbed_one(tiny_llama: Path) -> None:
    """What the gateway sends when a request moves to another decode worker
    (``gateway.routing.migration``): the prompt followed by the outputs already streamed, what is
    left of max_tokens/min_tokens, and ``output_offset``. Seeded draws and the output-only
    penalties count from the original output's start, so the continuation is the one the
    undisturbed request produced (fp32)."""
    params = SamplingParams(
        max_tokens=30,
        min_tokens=12,
        temperature=1.1,
        top_k=50,
        seed=31,
        presence_penalty=0.8,
        frequency_penalty=0.6,
        repetition_penalty=1.2,
    )
    whole = _run(make_core(tiny_llama), "a", PROMPT, params)
    assert len(whole) == 30
    for done in (1, 9, 17):
        resumed = SamplingParams(
            **{
                **_fields(params),
                "max_tokens": params.max_tokens - done,
                "min_tokens": max(0, params.min_tokens - done),
                "output_offset": done,
            }
        )
        rest = _run(make_core(tiny_llama, seed=5), f"m{done}", PROMPT + whole[:done], resumed)
        assert whole[:done] + rest == whole, done
    # Without the offset the move would draw other tokens: the test can tell.
    naive = SamplingParams(**{**_fields(params), "max_tokens": 21, "min_tokens": 3})
    assert whole[:9] + _run(make_core(tiny_llama), "n", PROMPT + whole[:9], naive) != whole


def test_an_offset_reaching_into_the_prompt_is_refused(tiny_llama: Path) -> None:
    core = make_core(tiny_llama)
    with pytest.raises(ValueError, match="output_offset"):
        core.make_request("x", [1, 2, 3], SamplingParams(output_offset=3))
