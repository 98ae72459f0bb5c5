"""Batched sampler semantics on hand-made logits."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, SamplingRow
from engine.sampling_params import SamplingParams

V = 50


def _row(
    params: SamplingParams,
    *,
    n_out: int = 5,
    seed_gen: int | None = None,
    eos: int = 2,
    ids: list[int] | None = None,
) -> SamplingRow:
    gen = None
    if seed_gen is not None:
        gen = torch.Generator().manual_seed(seed_gen)
    return SamplingRow(params, n_out, frozenset({eos}), gen, ids, 0)


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = _logits(4)
    out = Sampler(torch.device("cpu"), 0)(logits, [_row(SamplingParams(temperature=0))] * 4)
    assert [t for t, _ in out] == logits.argmax(-1).tolist()


def test_bf16_logits_sample_as_their_fp32_widening() -> None:
    """A bf16 model's logits reach the sampler in bf16: plain greedy rows take their
    argmax as they are; a row that wants logprobs, a bias, penalties or a draw makes the
    sampler widen them first (exactly), so every row gets what fp32 logits would give."""
    logits = _logits(4, seed=3).to(torch.bfloat16)
    wide = logits.float()
    greedy = [_row(SamplingParams(temperature=0))] * 4
    assert Sampler(torch.device("cpu"), 0)(logits, greedy) == Sampler(torch.device("cpu"), 0)(
        wide, greedy
    )

    def mixed() -> list[SamplingRow]:  # fresh rows: a seeded row's generator advances
        return [
            _row(SamplingParams(temperature=0)),
            _row(SamplingParams(temperature=0, logprobs=2)),
            _row(SamplingParams(temperature=0, logit_bias=((7, 50.0),))),
            _row(SamplingParams(temperature=0.8, seed=11), seed_gen=11),
        ]

    got = Sampler(torch.device("cpu"), 0)(logits, mixed())
    assert got == Sampler(torch.device("cpu"), 0)(wide, mixed())
    assert got[2][0] == 7  # the bias applied


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
    ],
)
def test_degenerate_filters_reduce_to_greedy(params: SamplingParams) -> None:
    logits = _logits(6, seed=1)
    out = Sampler(torch.device("cpu"), 0)(logits, [_row(params)] * 6)
    assert [t for t, _ in out] == logits.argmax(-1).tolist()


def test_top_k_never_leaves_the_top_k() -> None:
    logits = _logits(1, seed=2).repeat(200, 1)
    top3 = set(logits[0].topk(3).indices.tolist())
    out = Sampler(torch.device("cpu"), 0)(
        logits, [_row(SamplingParams(temperature=5.0, top_k=3))] * 200
    )
    picked = {t for t, _ in out}
    assert picked <= top3 and len(picked) > 1


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.full((300, V), -20.0)
    logits[:, 7] = 2.0  # p ~ 0.73
    logits[:, 9] = 1.0  # p ~ 0.27
    out = Sampler(torch.device("cpu"), 0)(
        logits, [_row(SamplingParams(temperature=1.0, top_p=0.7))] * 300
    )
    assert {t for t, _ in out} == {7}
    out = Sampler(torch.device("cpu"), 0)(
        logits, [_row(SamplingParams(temperature=1.0, top_p=0.9))] * 300
    )
    assert {t for t, _ in out} == {7, 9}


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(2, V)
    logits[:, 2] = 100.0  # eos
    logits[:, 4] = 90.0  # stop token
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(4,))
    out = Sampler(torch.device("cpu"), 0)(logits, [_row(params, n_out=1), _row(params, n_out=3)])
    assert out[0][0] not in (2, 4)
    assert out[1][0] == 2


def test_seeded_rows_do_not_depend_on_batch_company() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    logits = _logits(1, seed=3)
    alone = Sampler(torch.device("cpu"), 0)(logits, [_row(params, seed_gen=7)])[0][0]
    crowd_logits = torch.cat([_logits(3, seed=4), logits])
    crowd_rows = [_row(SamplingParams(temperature=1.0))] * 3 + [_row(params, seed_gen=7)]
    crowd = Sampler(torch.device("cpu"), 123)(crowd_logits, crowd_rows)[3][0]
    assert alone == crowd


def test_logprobs_report_chosen_rank_and_top_n() -> None:
    logits = _logits(2, seed=5)
    out = Sampler(torch.device("cpu"), 0)(
        logits, [_row(SamplingParams(temperature=0, logprobs=3))] * 2
    )
    ref = torch.log_softmax(logits, -1)
    for i, (tok, lp) in enumerate(out):
        assert lp is not None and lp.token_id == tok and lp.rank == 1
        assert lp.logprob == pytest.approx(ref[i, tok].item(), abs=1e-5)
        assert [t for t, _ in lp.top] == ref[i].topk(3).indices.tolist()


def test_penalties_push_seen_tokens_down() -> None:
    logits = torch.zeros(1, V)
    logits[0, 10] = 1.0
    logits[0, 11] = 0.9
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    out = Sampler(torch.device("cpu"), 0)(logits, [_row(params, ids=[10, 10])])
    assert out[0][0] == 11
    params = SamplingParams(temperature=0, frequency_penalty=1.0)
    out = Sampler(torch.device("cpu"), 0)(logits, [_row(params, ids=[10])])
    assert out[0][0] == 11
