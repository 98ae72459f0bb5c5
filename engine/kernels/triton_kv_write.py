"""Writes a step's new K/V rows into the paged cache by slot mapping, in one Triton launch.

Slot ``s`` is block ``s // block_size``, offset ``s % block_size``. A negative slot
skips its row: CUDA-graph padding rows use it, so a padded replay never touches a block
a live sequence owns (a plain ``index_copy_`` has no such escape).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kernel(
    cache_ptr, k_ptr, v_ptr, slots_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ck, stride_ch, stride_cb, stride_ct,
    KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    hh = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    mask = (hh < KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + t * stride_kt + hh[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + hh[:, None] * stride_vh + d[None, :], mask=mask)
    dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct
    dst = dst + hh.to(tl.int64)[:, None] * stride_ch + d[None, :]
    tl.store(cache_ptr + dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + stride_ck + dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store k[t], v[t] ([T, kv_heads, D], head dim contiguous) at ``slots[t]`` of ``layer``."""
    t, kv_heads, d = k.shape
    assert v.shape == k.shape and k.stride(2) == 1 and v.stride(2) == 1
    assert kv_cache.is_contiguous() and kv_cache.shape[2] == kv_heads and kv_cache.shape[-1] == d
    if t == 0:
        return
    layer_cache = kv_cache[layer]
    _write_kernel[(t,)](
        layer_cache, k, v, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        layer_cache.stride(0), layer_cache.stride(1), layer_cache.stride(2),
        layer_cache.stride(3),
        KV_HEADS=kv_heads, HEADS_PAD=triton.next_power_of_2(kv_heads),
        HEAD_DIM=d, DIM_PAD=triton.next_power_of_2(d), PAGE=kv_cache.shape[4],
    )  # fmt: skip
