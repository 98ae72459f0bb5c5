"""Variable-length causal prefill attention in Triton over the paged cache.

One launch serves every prefill chunk of a step: the flat batch holds the chunks one
after another (``q_start``, ``q_len``), each after ``ctx_start`` tokens already cached
for its sequence (a prefix hit, an earlier chunk, or nothing). The chunk's own K/V are
written to the cache before this runs, so keys come from one place, the pool, read
through the sequence's block table: cached prefix and new tokens alike, no gather, no
per-sequence loop, no dense mask.

One program serves ``BLOCK_M`` query rows of one chunk for one query head; it walks
keys ``BLOCK_N`` at a time up to the tile's last query position (causal), from the
window's start when a sliding window is set. The softmax is online, in fp32; a tile
where a row sees no key yet leaves that row's running state untouched.

Operand precision follows ``triton_decode_attention``: CPU (interpreter) launches widen
dots to fp32, fp32 inputs use IEEE dots on a GPU, 16-bit inputs use the tensor cores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, cache_ptr, tables_ptr, q_start_ptr, q_len_ptr, ctx_ptr,
    scale_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_ck, stride_ch, stride_cb, stride_ct, stride_tb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    q_len = tl.load(q_len_ptr + s).to(tl.int32)
    if tile * BLOCK_M >= q_len:
        return
    q0 = tl.load(q_start_ptr + s).to(tl.int64)
    ctx = tl.load(ctx_ptr + s).to(tl.int32)
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, DIM_PAD)
    row_ok = i < q_len
    d_ok = d < HEAD_DIM
    qpos = ctx + i  # absolute position of each query row
    q = tl.load(
        q_ptr + (q0 + i)[:, None] * stride_qt + h * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    kvh = (h // GROUP).to(tl.int64)
    k_base = cache_ptr + kvh * stride_ch
    v_base = k_base + stride_ck
    last = ctx + tl.minimum(q_len, (tile + 1) * BLOCK_M)  # keys up to the tile's last row
    first = 0
    if window > 0:
        first = tl.maximum(ctx + tile * BLOCK_M - window + 1, 0)
        first = first // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    n_offs = tl.arange(0, BLOCK_N)
    for n0 in range(first, last, BLOCK_N):
        kpos = n0 + n_offs
        k_ok = kpos < last
        page = tl.load(tables_ptr + s * stride_tb + kpos // PAGE, mask=k_ok, other=0)
        row = page.to(tl.int64) * stride_cb + (kpos % PAGE) * stride_ct
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        seen = k_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        if window > 0:
            seen = seen & (kpos[None, :] > qpos[:, None] - window)
        sc = tl.where(seen, sc * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        # Rows that have seen no key yet keep m = -inf; subtract 0 there to avoid NaNs.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(sc - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(
        out_ptr + (q0 + i)[:, None] * stride_ot + h * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def paged_prefill_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    ctx_start: torch.Tensor,
    max_q_len: int,
    scale: float,
    *,
    window: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal attention of every prefill chunk of a step; writes rows of ``out`` and returns it.

    q, out: [T, H, D] flat batch (strided rows, contiguous head dim); chunk s owns rows
    ``q_start[s] : q_start[s] + q_len[s]`` at positions ``ctx_start[s] + i``, and its K/V
    (cached prefix and the chunk itself) are in the pool at ``block_tables[s]``.
    ``max_q_len`` (host int) sizes the launch. Rows outside every chunk are left as they are.
    """
    num_seqs = q_len.shape[0]
    t, h, d = q.shape
    _, two, kv_heads, _, page, cache_d = kv_cache.shape
    assert two == 2 and cache_d == d and h % kv_heads == 0, (q.shape, kv_cache.shape)
    assert q.stride(2) == 1 and out.stride(2) == 1 and kv_cache.is_contiguous()
    if num_seqs == 0 or max_q_len == 0:
        return out
    on_cpu = q.device.type == "cpu"
    bm = block_m or (16 if on_cpu else 64)
    bn = block_n or (16 if on_cpu else 64)
    layer_cache = kv_cache[layer]
    grid = (num_seqs, triton.cdiv(max_q_len, bm), h)
    _prefill_kernel[grid](
        out, q, layer_cache, block_tables, q_start, q_len, ctx_start,
        float(scale) * _LOG2E, int(window or 0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        layer_cache.stride(0), layer_cache.stride(1), layer_cache.stride(2),
        layer_cache.stride(3), block_tables.stride(0),
        GROUP=h // kv_heads, HEAD_DIM=d, DIM_PAD=max(16, triton.next_power_of_2(d)),
        PAGE=page, BLOCK_M=bm, BLOCK_N=bn,
        DOT_FP32=on_cpu, IEEE=on_cpu or q.dtype == torch.float32,
    )  # fmt: skip
    return out
