"""The compiled greedy argmax (csrc/argmax.h) gives torch.argmax(dim=-1)'s answer on
every row: the first index of the maximum, the first NaN where a row has one, infinities
and fully masked rows included."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import ops
from engine.kernels.cpu import cpu_kernels

KERNELS = cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="needs the compiled CPU kernels")


def _rows(vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn((12, vocab), generator=gen)
    x[1, 7] = x[1, vocab - 3] = x[1].max() + 1  # a tie: the first wins
    x[2, vocab // 2] = float("nan")
    x[2, vocab - 1] = float("nan")
    x[3, 5] = float("inf")
    x[4] = float("-inf")  # every token masked
    x[5, ::2] = float("-inf")  # half masked
    x[6, 3] = float("nan")
    x[6, 9] = float("inf")
    x[7] = 0.0
    x[7, 11] = -0.0
    x[8, vocab - 1] = 100.0  # the maximum in the tail past the last 16 columns
    x[9] = x[9].round()  # many ties
    return x


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [15, 16, 17, 49152, 49155])
def test_argmax_rows_equals_torch(vocab: int, dtype: torch.dtype) -> None:
    assert KERNELS is not None
    x = _rows(vocab).to(dtype)  # bf16: more ties once rounded; the first still wins
    assert torch.equal(KERNELS.ops.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(KERNELS.ops.argmax_rows(x), x.float().argmax(dim=-1))
    wide = torch.cat([x, torch.zeros((x.shape[0], 5), dtype=dtype)], dim=1)[:, :vocab]
    assert torch.equal(KERNELS.ops.argmax_rows(wide), x.argmax(dim=-1))
    assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))


@needs_kernels
def test_argmax_rows_of_a_one_token_vocabulary() -> None:
    assert KERNELS is not None
    x = torch.tensor([[0.5], [float("nan")], [float("-inf")]])
    assert KERNELS.ops.argmax_rows(x).tolist() == [0, 0, 0]


@needs_kernels
def test_argmax_rows_refuses_what_it_does_not_serve() -> None:
    assert KERNELS is not None
    with pytest.raises(RuntimeError, match="argmax_rows: x must be fp32 or bf16"):
        KERNELS.ops.argmax_rows(torch.zeros((2, 4), dtype=torch.float16))
    # The wrapper gives those to torch.
    x = torch.randn((3, 40)).to(torch.float16)
    assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))
    assert ops.argmax_rows(torch.zeros((0, 7))).shape == (0,)
