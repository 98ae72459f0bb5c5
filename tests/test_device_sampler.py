"""DeviceSampler: the same tokens as Sampler, with one read-back a step on the plain path."""

from __future__ import annotations

import random

import torch
from torch.overrides import TorchFunctionMode

from engine.device_sampler import DeviceSampler
from engine.sampler import Sampler, SamplingRow, position_generator
from engine.sampling_params import SamplingParams

V = 300
CPU = torch.device("cpu")
# Tensor methods that bring values back to Python (each one a sync on a GPU tensor).
_READ_BACKS = {
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__bool__, torch.Tensor.__index__,
}  # fmt: skip


class CountReadBacks(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in _READ_BACKS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _row(params: SamplingParams, position: int = 0) -> SamplingRow:
    gen = None
    if params.seed is not None and not params.greedy:
        gen = position_generator(CPU, params.seed, position)
    return SamplingRow(params=params, num_outputs=0, eos_token_ids=frozenset({2}), generator=gen)


def _plain_rows(n: int, seed: int, seeded: bool) -> list[SamplingRow]:
    """Random plain rows (fresh generators each call); some seeded when ``seeded``."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.0, 1.5]),
            top_k=rng.choice([0, 1, 5, 40, V + 10]),
            top_p=rng.choice([1.0, 0.9, 0.5]),
            min_p=rng.choice([0.0, 0.05]),
            seed=rng.choice([None, 11, 12]) if seeded else None,
        )
        rows.append(_row(params, position=i))
    return rows


def test_plain_rows_draw_the_same_tokens_as_sampler() -> None:
    for seed in range(6):
        logits = torch.randn((24, V), generator=torch.Generator().manual_seed(seed)) * 3
        seeded = seed % 2 == 1
        ours = DeviceSampler(CPU, seed)(logits, _plain_rows(24, seed, seeded))
        ref = Sampler(CPU, seed)(logits, _plain_rows(24, seed, seeded))
        assert ours == ref


def test_all_greedy_is_argmax() -> None:
    logits = torch.randn((6, V), generator=torch.Generator().manual_seed(1))
    out = DeviceSampler(CPU, 0)(logits, [_row(SamplingParams(temperature=0))] * 6)
    assert [t for t, _ in out] == logits.argmax(-1).tolist()


def test_plain_path_reads_back_once_where_sampler_reads_more() -> None:
    logits = torch.randn((8, V), generator=torch.Generator().manual_seed(2))
    rows = [_row(SamplingParams(temperature=0.8, top_k=7, top_p=0.9, min_p=0.01))] * 6
    rows += [_row(SamplingParams(temperature=0.8, seed=3), position=p) for p in (4, 5)]
    with CountReadBacks() as ours:
        DeviceSampler(CPU, 0)(logits, rows)
    with CountReadBacks() as ref:
        Sampler(CPU, 0)(logits, rows)
    assert ours.count == 1  # the chosen tokens
    assert ref.count > 1  # Sampler also reads back the largest top-k


def test_other_rows_go_to_sampler_unchanged() -> None:
    logits = torch.randn((4, V), generator=torch.Generator().manual_seed(3))
    for rows in (
        [_row(SamplingParams(temperature=0, logprobs=2))] * 2,
        [SamplingRow(SamplingParams(repetition_penalty=1.3), 0, frozenset({2}), None, [4, 4])],
        [_row(SamplingParams(temperature=0.5, min_tokens=2, stop_token_ids=(7,)))],
    ):
        n = len(rows)
        ours = DeviceSampler(CPU, 9)(logits[:n], rows)
        ref = Sampler(CPU, 9)(logits[:n], rows)
        assert ours == ref
