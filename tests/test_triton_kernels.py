"""The Triton kernels (paged decode attention, varlen prefill attention, KV write) against
a float64 reference over the un-paged K/V.

Without CUDA they run under Triton's interpreter (``TRITON_INTERPRET=1``, set by
conftest), on tiny shapes: ragged contexts inside a block, on block edges and over many
blocks; pages shuffled through the block table; grouped-query heads, including a group
that is not a power of two and a head dim that needs padding; split contexts; sliding
windows; fp32 and bf16. With CUDA the same cases run on the GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.kernels.triton_decode_attention import num_splits_for, paged_decode_attention
from engine.kernels.triton_kv_write import write_kv
from engine.kernels.triton_prefill_attention import paged_prefill_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


class PagedCase:
    """Random K/V of several sequences, scattered into a paged pool in shuffled blocks."""

    def __init__(
        self,
        totals: list[int],
        *,
        kv_heads: int,
        head_dim: int,
        page: int,
        dtype: torch.dtype,
        seed: int,
        layers: int = 2,
        layer: int = 1,
    ) -> None:
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        self.page, self.layer = page, layer
        self.num_pages = [-(-t // page) for t in totals]
        num_blocks = sum(self.num_pages) + 3
        ids = list(range(num_blocks))
        rng.shuffle(ids)
        it = iter(ids)
        self.tables = [[next(it) for _ in range(n)] for n in self.num_pages]
        self.keys = [torch.randn((t, kv_heads, head_dim), generator=gen) for t in totals]
        self.values = [torch.randn((t, kv_heads, head_dim), generator=gen) for t in totals]
        shape = (layers, 2, kv_heads, num_blocks, page, head_dim)
        self.cache = torch.randn(shape, generator=gen).to(dtype)
        for tab, k, v in zip(self.tables, self.keys, self.values, strict=True):
            for p in range(k.shape[0]):
                self.cache[layer, 0, :, tab[p // page], p % page] = k[p].to(dtype)
                self.cache[layer, 1, :, tab[p // page], p % page] = v[p].to(dtype)
        self.cache = self.cache.to(DEVICE)

    def table_tensor(self, rows: list[int], width: int | None = None) -> torch.Tensor:
        width = width or max(self.num_pages[r] for r in rows)
        # Entries past a row's pages point at a real block: the kernel must not read them.
        padded = [self.tables[r] + [0] * (width - len(self.tables[r])) for r in rows]
        return torch.tensor(padded, dtype=torch.int32, device=DEVICE)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: list[int], window: int, scale: float
) -> torch.Tensor:
    """Dense causal attention in float64: q [n, H, D] at positions qpos over k, v [L, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), kk) * scale
    kpos = torch.arange(k.shape[0])[None]
    qp = torch.tensor(qpos)[:, None]
    hidden = kpos > qp
    if window:
        hidden |= kpos <= qp - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vv)


def run_decode(
    contexts: list[int],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page: int,
    dtype: torch.dtype,
    num_splits: int = 1,
    window: int = 0,
    seed: int = 0,
    block_n: int = 16,
) -> float:
    case = PagedCase(
        contexts, kv_heads=kv_heads, head_dim=head_dim, page=page, dtype=dtype, seed=seed
    )
    gen = torch.Generator().manual_seed(seed + 1)
    # q as a strided view of a wider packed row, like the model's qkv split.
    packed = torch.randn((len(contexts), heads * head_dim + 8), generator=gen).to(dtype)
    q = packed.to(DEVICE)[:, : heads * head_dim].view(-1, heads, head_dim)
    out = torch.full_like(q, float("nan"))
    lens = torch.tensor(contexts, dtype=torch.int64, device=DEVICE)
    scale = head_dim**-0.5
    paged_decode_attention(
        out,
        q,
        case.cache,
        case.layer,
        case.table_tensor(list(range(len(contexts)))),
        lens,
        scale,
        window=window,
        num_splits=num_splits,
        block_n=block_n,
    )
    err = 0.0
    for i, ctx in enumerate(contexts):
        got = out[i].cpu().double()
        if ctx == 0:
            assert torch.equal(got, torch.zeros_like(got)), "an empty row must give zeros"
            continue
        ref = reference(q[i : i + 1].cpu(), case.keys[i], case.values[i], [ctx - 1], window, scale)[
            0
        ]
        err = max(err, (got - ref).abs().max().item())
    return err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_ragged_contexts_gqa(dtype: torch.dtype, num_splits: int) -> None:
    # Inside one page, on page edges, many pages; one row shorter than the splits.
    contexts = [1, 3, 4, 5, 16, 17, 45]
    err = run_decode(
        contexts, heads=4, kv_heads=2, head_dim=16, page=4, dtype=dtype, num_splits=num_splits
    )
    assert err < TOL[dtype], err


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(3, 3, 32), (6, 2, 48), (8, 1, 16)])
def test_decode_head_shapes(heads: int, kv_heads: int, head_dim: int) -> None:
    err = run_decode(
        [2, 19, 33],
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        page=8,
        dtype=torch.float32,
        seed=heads,
    )
    assert err < TOL[torch.float32], err


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_sliding_window(num_splits: int) -> None:
    err = run_decode(
        [3, 7, 8, 30, 41],
        heads=4,
        kv_heads=2,
        head_dim=16,
        page=4,
        dtype=torch.float32,
        window=7,
        num_splits=num_splits,
        seed=5,
    )
    assert err < TOL[torch.float32], err


def test_decode_padding_rows_give_zeros_and_real_rows_stay_right() -> None:
    err = run_decode(
        [0, 9, 0, 21],
        heads=4,
        kv_heads=2,
        head_dim=16,
        page=4,
        dtype=torch.float32,
        num_splits=2,
        seed=9,
    )
    assert err < TOL[torch.float32], err


def test_num_splits_fill_the_gpu_only_for_small_batches_on_long_contexts() -> None:
    assert num_splits_for(batch=1, kv_heads=8, max_context=8192, sm_count=132) == 32
    assert num_splits_for(batch=64, kv_heads=8, max_context=8192, sm_count=132) == 1
    assert num_splits_for(batch=1, kv_heads=8, max_context=300, sm_count=132) == 1


def run_prefill(
    chunks: list[tuple[int, int]],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page: int,
    dtype: torch.dtype,
    window: int = 0,
    seed: int = 0,
) -> float:
    """chunks: (cached context, new tokens) per sequence; their K/V are all in the pool."""
    totals = [c + n for c, n in chunks]
    case = PagedCase(
        totals, kv_heads=kv_heads, head_dim=head_dim, page=page, dtype=dtype, seed=seed
    )
    gen = torch.Generator().manual_seed(seed + 1)
    t = sum(n for _, n in chunks) + 2  # two extra rows that belong to no chunk
    q = torch.randn((t, heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    out = torch.full_like(q, 7.0)
    starts, row = [], 2  # chunks start after the two foreign rows
    for _, n in chunks:
        starts.append(row)
        row += n
    meta = [
        torch.tensor(x, dtype=torch.int32, device=DEVICE)
        for x in (starts, [n for _, n in chunks], [c for c, _ in chunks])
    ]
    scale = head_dim**-0.5
    paged_prefill_attention(
        out,
        q,
        case.cache,
        case.layer,
        case.table_tensor(list(range(len(chunks)))),
        *meta,
        max(n for _, n in chunks),
        scale,
        window=window,
    )
    assert torch.equal(out[:2].cpu(), torch.full_like(out[:2].cpu(), 7.0)), "foreign rows"
    err = 0.0
    for i, ((ctx, n), start) in enumerate(zip(chunks, starts, strict=True)):
        ref = reference(
            q[start : start + n].cpu(),
            case.keys[i],
            case.values[i],
            list(range(ctx, ctx + n)),
            window,
            scale,
        )
        err = max(err, (out[start : start + n].cpu().double() - ref).abs().max().item())
    return err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_ragged_chunks_with_cached_prefixes(dtype: torch.dtype) -> None:
    # A prompt from scratch, chunks after cached context (on and off page edges), a
    # single-token chunk, and one longer than a query tile.
    chunks = [(0, 13), (8, 5), (5, 1), (3, 37)]
    err = run_prefill(chunks, heads=4, kv_heads=2, head_dim=16, page=4, dtype=dtype)
    assert err < TOL[dtype], err


def test_prefill_gqa_odd_group_and_padded_head_dim() -> None:
    err = run_prefill(
        [(0, 9), (6, 20)], heads=6, kv_heads=2, head_dim=48, page=8, dtype=torch.float32, seed=3
    )
    assert err < TOL[torch.float32], err


def test_prefill_sliding_window() -> None:
    err = run_prefill(
        [(0, 30), (11, 17)],
        heads=4,
        kv_heads=2,
        head_dim=16,
        page=4,
        dtype=torch.float32,
        window=6,
        seed=4,
    )
    assert err < TOL[torch.float32], err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_lands_in_slots_and_skips_negative_ones(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn((2, 2, 3, 6, 4, 16), generator=gen).to(dtype).to(DEVICE)
    before = cache.clone()
    packed = torch.randn((5, 2 * 3 * 16 + 4), generator=gen).to(dtype).to(DEVICE)
    k = packed[:, : 3 * 16].view(5, 3, 16)
    v = packed[:, 3 * 16 : 6 * 16].view(5, 3, 16)
    slots = torch.tensor([9, -1, 0, 23, -1], dtype=torch.int64, device=DEVICE)
    write_kv(cache, 1, k, v, slots)
    expected = before.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[1, 0, :, slot // 4, slot % 4] = k[t]
            expected[1, 1, :, slot // 4, slot % 4] = v[t]
    assert torch.equal(cache, expected)
