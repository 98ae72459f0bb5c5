"""Prompt logprobs (``echo`` + ``logprobs``): each prompt token's log-probability under the
model given the tokens before it, computed by prefill chunk by chunk, equal to HF's in fp32,
and computed even when the prompt's KV is in the prefix cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.engine_core import EngineCore
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from tests.engine_helpers import hf_model, make_core

PROMPT = [(i * 7919 + 13) % 49000 + 3 for i in range(45)]


def _first_outputs(
    core: EngineCore, requests: dict[str, SamplingParams]
) -> dict[str, RequestOutput]:
    for rid, params in requests.items():
        core.add_request(core.make_request(rid, PROMPT, params))
    first: dict[str, RequestOutput] = {}
    while core.has_work():
        for o in core.step():
            first.setdefault(o.request_id, o)
    return first


@torch.inference_mode()
def test_prompt_logprobs_equal_hf_across_chunks(tiny_llama: Path) -> None:
    # 16-token chunks: the prompt's positions come from three steps, beside another request.
    core = make_core(tiny_llama, max_num_batched_tokens=16)
    wanted = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    first = _first_outputs(core, {"p": wanted, "q": SamplingParams(max_tokens=2, temperature=0)})
    got = first["p"].prompt_logprobs
    assert got is not None and len(got) == len(PROMPT) - 1
    assert first["q"].prompt_logprobs is None
    ref = torch.log_softmax(hf_model(tiny_llama)(torch.tensor([PROMPT])).logits[0].float(), -1)
    for j, lp in enumerate(got):
        expect = ref[j]  # position j predicts prompt token j + 1
        assert lp.token_id == PROMPT[j + 1]
        assert lp.logprob == pytest.approx(expect[PROMPT[j + 1]].item(), abs=1e-4)
        # The rank, up to near-ties (a random model's logits are close together).
        chosen = expect[PROMPT[j + 1]]
        assert (
            int((expect > chosen + 1e-4).sum()) < lp.rank <= int((expect > chosen - 1e-4).sum()) + 1
        )
        assert [t for t, _ in lp.top] == expect.topk(3).indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(expect.topk(3).values.tolist(), abs=1e-4)


def test_a_prefix_cache_hit_does_not_skip_the_prompt_logprobs(tiny_llama: Path) -> None:
    core = make_core(tiny_llama)
    greedy = SamplingParams(max_tokens=1, temperature=0)
    _first_outputs(core, {"warm": greedy})
    hit = _first_outputs(core, {"hit": greedy})["hit"]
    assert hit.num_cached_tokens >= 32  # the prompt's full blocks are cached
    wanted = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    out = _first_outputs(core, {"lp": wanted})["lp"]
    assert out.num_cached_tokens == 0
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(PROMPT) - 1
    fresh = _first_outputs(make_core(tiny_llama), {"lp": wanted})["lp"]
    assert fresh.prompt_logprobs is not None
    assert [lp.logprob for lp in out.prompt_logprobs] == pytest.approx(
        [lp.logprob for lp in fresh.prompt_logprobs], abs=1e-5
    )
    assert all(lp.top == [] for lp in out.prompt_logprobs)
