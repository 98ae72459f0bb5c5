"""Paged decode attention in Triton: one query token per sequence, K/V read through the
block table, no gather and no padding to the longest sequence.

One program serves one (sequence, KV head, context split): it loads the query rows of
every head in the KV head's group as one ``[GROUP_PAD, HEAD_DIM]`` tile, walks the
sequence's context ``BLOCK_N`` tokens at a time (the block table maps each token to its
page, so tiles need not align with pages), and keeps an online softmax in fp32. With
more than one split (flash-decoding, for small batches on long contexts) each split
writes a partial result and a second kernel merges them; the split count is a launch
constant, each sequence cuts its own context into that many pieces, so the launch shape
never depends on context lengths and the kernel can live in a CUDA graph.

A row whose context length is 0 (a CUDA-graph padding row) produces zeros. A sliding
window of W keeps the W most recent tokens (the query's own included); 0 keeps all.

On CPU tensors the kernels run under ``TRITON_INTERPRET=1`` only; that is how CI checks
them against the torch reference. The interpreter's bf16 ``tl.dot`` is wrong, so CPU
launches widen dot operands to fp32 (``DOT_FP32``); on a GPU, 16-bit operands go to the
tensor cores as they are and fp32 ones run in IEEE precision (no TF32), to keep fp32
parity with the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(
    out_ptr, part_o_ptr, part_ml_ptr,
    q_ptr, cache_ptr, tables_ptr, lens_ptr,
    scale_log2, window,
    stride_qb, stride_qh,
    stride_ob, stride_oh,
    stride_ck, stride_ch, stride_cb, stride_ct,
    stride_tb,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    start = 0
    if window > 0:
        start = tl.maximum(ctx - window, 0)
    span = ctx - start
    per_split = tl.cdiv(tl.cdiv(span, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, ctx)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kvh * GROUP + g
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    k_base = cache_ptr + kvh.to(tl.int64) * stride_ch
    v_base = k_base + stride_ck
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    n_offs = tl.arange(0, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + n_offs
        ok = pos < hi
        page = tl.load(tables_ptr + b * stride_tb + pos // PAGE, mask=ok, other=0)
        row = page.to(tl.int64) * stride_cb + (pos % PAGE) * stride_ct
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_mask = g_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=o_mask,
        )
    else:
        # part_o: [B, H, NUM_SPLITS, DIM_PAD] fp32; part_ml: [B, H, NUM_SPLITS, 2] fp32.
        row_id = (b * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split
        tl.store(part_o_ptr + row_id[:, None] * DIM_PAD + d[None, :], o, mask=o_mask)
        tl.store(part_ml_ptr + row_id * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + row_id * 2 + 1, l_i, mask=g_ok)


@triton.jit
def _merge_kernel(
    out_ptr, part_o_ptr, part_ml_ptr,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    s_ok = s < NUM_SPLITS
    row = (b * tl.num_programs(1) + h) * NUM_SPLITS + s
    m = tl.load(part_ml_ptr + row * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=s_ok, other=0.0)  # noqa: E741
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max) * l
    total = tl.sum(w, 0)
    total = tl.where(total > 0.0, total, 1.0)
    o = tl.load(part_o_ptr + row[:, None] * DIM_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    merged = tl.sum(o * (w / total)[:, None], 0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + d,
        merged.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def num_splits_for(batch: int, kv_heads: int, max_context: int, sm_count: int) -> int:
    """How many context splits keep every SM busy: enough programs for two waves, but
    never splits shorter than 256 tokens, where the merge would cost more than it saves."""
    programs = max(1, batch * kv_heads)
    wanted = -(-2 * sm_count // programs)
    return max(1, min(wanted, max_context // 256, 32))


def _pad(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def paged_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    num_splits: int = 1,
    block_n: int = 64,
) -> torch.Tensor:
    """Attention of one query token per row over its paged context; writes and returns out.

    out, q: [B, H, D] (rows may be strided, the head dim contiguous); kv_cache: the pool
    ``[layers, 2, kv_heads, blocks, block_size, D]``, contiguous; block_tables: [B, >=
    blocks needed] int32/int64 (entries past a row's context are never read);
    context_lens: [B] tokens of context including the query (0: output zeros).
    ``window``: keep only the most recent ``window`` tokens (None or 0: all).
    """
    b, h, d = q.shape
    _, two, kv_heads, _, page, cache_d = kv_cache.shape
    assert two == 2 and cache_d == d and h % kv_heads == 0, (q.shape, kv_cache.shape)
    assert q.stride(2) == 1 and out.stride(2) == 1 and kv_cache.is_contiguous()
    assert out.shape == q.shape and block_tables.shape[0] >= b and context_lens.shape[0] >= b
    if b == 0:
        return out
    group = h // kv_heads
    layer_cache = kv_cache[layer]
    dim_pad = _pad(d)
    dot_fp32 = q.device.type == "cpu"  # the interpreter's bf16 dot is wrong
    common = dict(
        GROUP=group, GROUP_PAD=_pad(group), HEAD_DIM=d, DIM_PAD=dim_pad, PAGE=page,
        BLOCK_N=max(16, block_n), DOT_FP32=dot_fp32,
        IEEE=dot_fp32 or q.dtype == torch.float32,
    )  # fmt: skip
    strides = (
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        layer_cache.stride(0), layer_cache.stride(1), layer_cache.stride(2),
        layer_cache.stride(3), block_tables.stride(0),
    )  # fmt: skip
    scale_log2 = float(scale) * _LOG2E
    win = int(window or 0)
    if num_splits <= 1:
        _decode_kernel[(b, kv_heads, 1)](
            out, out, out, q, layer_cache, block_tables, context_lens, scale_log2, win,
            *strides, NUM_SPLITS=1, **common,
        )  # fmt: skip
        return out
    part_o = torch.empty((b, h, num_splits, dim_pad), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((b, h, num_splits, 2), dtype=torch.float32, device=q.device)
    _decode_kernel[(b, kv_heads, num_splits)](
        out, part_o, part_ml, q, layer_cache, block_tables, context_lens, scale_log2, win,
        *strides, NUM_SPLITS=num_splits, **common,
    )  # fmt: skip
    _merge_kernel[(b, h)](
        out, part_o, part_ml, out.stride(0), out.stride(1),
        HEAD_DIM=d, DIM_PAD=dim_pad, NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
    )  # fmt: skip
    return out
