"""The HF parity verdict: a divergence is a tie only where HF's top two logits are close."""

from __future__ import annotations

import torch

from tests.engine_helpers import TIE_MARGIN, compare_greedy


def _logits(*rows: dict[int, float]) -> torch.Tensor:
    out = torch.full((len(rows), 10), -5.0)
    for i, row in enumerate(rows):
        for tok, value in row.items():
            out[i, tok] = value
    return out


def test_equal_and_length_difference() -> None:
    logits = _logits({1: 3.0}, {2: 3.0})
    assert compare_greedy([1, 2], [1, 2], logits) == "equal"
    assert compare_greedy([1], [1, 2], logits) == "mismatch"


def test_divergence_at_a_near_tie_is_a_tie() -> None:
    logits = _logits({1: 3.0}, {2: 7.0, 4: 7.0 - TIE_MARGIN / 2})
    assert compare_greedy([1, 4, 9], [1, 2, 3], logits) == "tie"


def test_divergence_to_a_top5_token_that_is_not_tied_fails() -> None:
    # Token 4 is HF's second choice, but by a clear margin: the old top-5 rule passed it.
    logits = _logits({1: 3.0}, {2: 7.0, 4: 6.9, 5: 6.8, 6: 6.7, 7: 6.6})
    assert compare_greedy([1, 4], [1, 2], logits) == "mismatch"


def test_divergence_to_a_far_token_at_a_tie_fails() -> None:
    # HF's top two tie, but we took a third token far below them.
    logits = _logits({2: 7.0, 4: 7.0, 5: 6.0})
    assert compare_greedy([5], [2], logits) == "mismatch"
