"""Paged attention: writes K/V by slot mapping, reads by block tables.

Two backends give the same result (fp32 summation order aside):

- the compiled CPU kernel (``engine/kernels``), used on CPU tensors when it loads: it
  writes the batch's K/V and runs every single-token query straight from the paged
  blocks through the block table, in fp32 with an exact softmax, parallel over
  (sequence, kv head), with no gather copy and no padding;
- plain torch, the portable backend (CPU and GPU). Single-token queries run as one
  grouped matmul over the gathered blocks of the whole decode batch; the cache keeps heads
  outside blocks, so the gather already has the ``[kv_heads, seqs, tokens, head_dim]``
  shape the matmul wants. Scores are scaled, masked and widened to fp32 in one op.

Prefill chunks take the route the host measured fastest (``prefill_route``, a class of
``engine.kernels.route_table``, timed at start-up by ``prefill_probe``): the compiled
flash-style kernel (``csrc/prefill_attention.h``), which reads every key, the chunk's
own included, from the paged pool, or torch SDPA per sequence (causal; the context
gathered and an explicit mask when the chunk follows cached context or a sliding window
cuts it), whose bf16 path runs on AMX tiles where the CPU has them.

Deterministic mode (``split`` > 0, ``--deterministic``) trades that for bits that do not
depend on the batch: every token of the step, prefill chunks included, runs as a
single-token query of the compiled kernel over the cache through its sequence's block
table, with the context reduced in parts of ``split`` tokens merged in one fixed order.
A position then gets the same attention output whether it was prefilled whole, in
chunks of any size, or decoded, and whatever else shares the step.

A layer with a sliding window of W tokens lets a query at position i see positions
(i - W, i] only (HF's ``sliding_window``); both backends apply it. Blocks outside the
window stay allocated: the window changes what is read, not what is kept.

On the GPU the Triton kernels (``engine.layers.triton_attention``) take the whole step
instead, for layers whose runner sets ``use_triton`` (``engine.cuda_runner``). Whether they
build is checked once at start-up (``choose_gpu_attention``): Triton compiles each kernel's
launcher with a C compiler and writes its cache directory at first use, so an image without
a compiler or a read-only cache fails there, before the worker says SERVING, with an error
that says what to fix. Only ``--attention-fallback torch`` turns that failure into the
plain-torch path, logged as an error and shown by the ``baton_attention_fallback`` metric:
never a silent slow path.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_context import (
    AttentionMetadata,
    ForwardContext,
    PrefillSeq,
    forward_context,
    get_forward_context,
)
from engine.huge_pages import zeros_on_huge_pages
from engine.kernels.cpu import cpu_kernels
from engine.kernels.route_table import FLASH, TORCH

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
logger = logging.getLogger(__name__)


# Deterministic mode's KV split, in tokens (whole blocks): every context is reduced in
# parts of this many tokens, merged in context order. Part of what peers must agree on
# (the next layer's K/V depend on it); long enough that a part amortizes its merge,
# short enough that one long decode row still spreads over the threads.
DETERMINISTIC_SPLIT = 256

# What a GPU worker does when the Triton kernels do not build (--attention-fallback).
ATTENTION_FALLBACKS = ("none", "torch")


class AttentionBuildError(RuntimeError):
    """The Triton attention kernels did not import or build on this device."""


@functools.cache
def triton_attention_backend() -> Callable[..., torch.Tensor] | None:
    """The Triton backend, or None (warned once) where Triton does not import."""
    try:
        from engine.layers.triton_attention import triton_attention
    except ImportError as exc:
        logger.warning("Triton is unavailable (%s)", exc)
        return None
    return triton_attention


def build_triton_attention(
    device: torch.device,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> None:
    """Run the Triton attention of one tiny step (a decode row and a two-token prefill
    chunk over a two-block cache, in the model's head shape and dtype) on ``device``.

    The first launch compiles the KV-write, decode and prefill kernels and their
    launchers, so whatever stops them building (no Triton, no C compiler, an unwritable
    cache directory) raises here. Blocks until the device finished.
    """
    attention = triton_attention_backend()
    if attention is None:
        raise ImportError("Triton does not import (install baton[gpu])")
    cache = torch.zeros((1, 2, num_kv_heads, 2, block_size, head_dim), dtype=dtype, device=device)
    q = torch.randn((3, num_heads, head_dim), device=device).to(dtype)
    k = torch.randn((3, num_kv_heads, head_dim), device=device).to(dtype)
    v = torch.randn((3, num_kv_heads, head_dim), device=device).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([0, block_size, block_size + 1], device=device),
        num_decode=1,
        decode_block_tables=torch.zeros((1, 1), dtype=torch.long, device=device),
        decode_mask=None,
        prefills=[PrefillSeq(1, 2, 0, torch.ones(1, dtype=torch.long, device=device))],
        decode_context_lens=torch.ones(1, dtype=torch.long, device=device),
    )
    ctx = ForwardContext(meta, cache)
    with forward_context(ctx):
        out = attention(q, k, v, ctx, 0, head_dim**-0.5, 0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if not bool(torch.isfinite(out.float()).all()):
        raise RuntimeError("the Triton attention of the build check returned non-finite values")


def choose_gpu_attention(fallback: str, build: Callable[[], None]) -> str:
    """``"triton"`` when ``build`` (``build_triton_attention`` bound to the model's shape)
    succeeds. When it fails: ``AttentionBuildError`` naming the cause and the fix, or with
    ``fallback="torch"`` an error logged and ``"torch"`` (the caller runs the plain-torch
    runner and reports ``attention_fallback``)."""
    if fallback not in ATTENTION_FALLBACKS:
        raise ValueError(
            f"attention_fallback must be one of {ATTENTION_FALLBACKS}, got {fallback!r}"
        )
    try:
        build()
    except Exception as exc:
        cache_dir = os.environ.get("TRITON_CACHE_DIR") or "~/.triton/cache (TRITON_CACHE_DIR unset)"
        cause = (
            f"the Triton attention kernels did not build: {type(exc).__name__}: {exc}. Triton "
            "compiles each kernel's launcher with a C compiler (CC, else cc/gcc/clang on PATH: "
            "the CUDA image ships gcc) and writes its cache directory, which must be writable: "
            f"{cache_dir}"
        )
        if fallback == "torch":
            logger.error(
                "%s. --attention-fallback torch: serving on the plain-torch attention path, "
                "slower, without Triton kernels or CUDA graphs (baton_attention_fallback is 1)",
                cause,
            )
            return "torch"
        raise AttentionBuildError(
            f"{cause}. Fix the image or the cache volume, or start with --attention-fallback "
            "torch to serve on the slower plain-torch path"
        ) from exc
    return "triton"


def decode_attention_backend() -> str:
    """``"cpu-kernel"`` when the compiled kernel loads here, else ``"torch"``.

    Trying the kernel may build it (once per machine); a failure is logged as a warning
    by ``engine.kernels.cpu`` and the plain-torch path runs. The kernel only ever serves
    CPU tensors in float32 or bfloat16; everything else runs plain torch either way.
    """
    return "cpu-kernel" if cpu_kernels() is not None else "torch"


def decode_context_lens(meta: AttentionMetadata) -> torch.Tensor:
    """Context length (tokens including the query) of each decode row, int64.

    Taken from the metadata when the runner filled it; otherwise derived from the decode
    mask once per step and kept on the metadata for the other layers.
    """
    lens = meta.decode_context_lens
    if lens is None:
        assert meta.decode_mask is not None
        lens = (meta.decode_mask == 0).sum(-1)
        meta.decode_context_lens = lens
    return lens


def row_tables(meta: AttentionMetadata, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row of a ``rows``-token step as a single-token query: its block table
    [rows, max blocks] (0-padded) and its context length [rows] (its token included).
    Built once a step and kept on the metadata for the other layers."""
    if meta.row_block_tables is not None and meta.row_context_lens is not None:
        return meta.row_block_tables, meta.row_context_lens
    n_dec = meta.num_decode
    dec_tables = meta.decode_block_tables if n_dec else None
    width = max(
        [dec_tables.shape[1] if dec_tables is not None else 1]
        + [p.block_ids.numel() for p in meta.prefills]
    )
    device = meta.slot_mapping.device
    tables = torch.zeros((rows, width), dtype=torch.long, device=device)
    lens = torch.empty(rows, dtype=torch.long, device=device)
    if dec_tables is not None:
        tables[:n_dec, : dec_tables.shape[1]] = dec_tables
        lens[:n_dec] = decode_context_lens(meta)
    for p in meta.prefills:
        run = slice(p.q_start, p.q_start + p.q_len)
        tables[run, : p.block_ids.numel()] = p.block_ids
        lens[run] = torch.arange(p.start + 1, p.start + p.q_len + 1, device=device)
    meta.row_block_tables, meta.row_context_lens = tables, lens
    return tables, lens


def decode_mask(meta: AttentionMetadata, block_size: int) -> torch.Tensor:
    """The additive mask of the decode rows [num_decode, max blocks x block_size]: 0 for
    context, -inf for padding. The runner's, or built from the block tables and context
    lengths once a step and kept on the metadata: only the plain-torch attention reads
    it, so the CPU runner does not build one for the compiled kernels."""
    mask = meta.decode_mask
    if mask is None:
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        assert tables is not None and lens is not None
        cols = torch.arange(tables.shape[1] * block_size, device=tables.device)
        mask = torch.zeros(
            (tables.shape[0], cols.numel()), dtype=torch.float32, device=tables.device
        )
        mask.masked_fill_(cols.unsqueeze(0) >= lens.unsqueeze(1), float("-inf"))
        meta.decode_mask = mask
    return mask


def decode_window_mask(meta: AttentionMetadata, window: int, block_size: int) -> torch.Tensor:
    """The decode mask with every column before each row's window also at -inf."""
    mask = meta.decode_window_masks.get(window)
    if mask is None:
        full = decode_mask(meta, block_size)
        lens = decode_context_lens(meta)
        cols = torch.arange(full.shape[1], device=full.device)
        outside = cols.unsqueeze(0) < (lens - window).unsqueeze(1)
        mask = full.masked_fill(outside, float("-inf"))
        meta.decode_window_masks[window] = mask
    return mask


class PagedAttention(nn.Module):
    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        sliding_window: int = 0,
    ):
        super().__init__()
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {sliding_window}")
        self.sliding_window = sliding_window
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        fits_kernel = head_dim % 16 == 0 and head_dim <= 256 and self.group <= 16
        # Plain attribute, so a benchmark or test can pin the torch path per layer.
        self.use_kernel = fits_kernel and decode_attention_backend() == "cpu-kernel"
        # Deterministic mode: the fixed KV split in tokens (DETERMINISTIC_SPLIT); 0: off.
        self.split = 0
        # The kernel of prompt chunks on the compiled path: FLASH or TORCH (SDPA), set from
        # the model's measured route table.
        self.prefill_route = FLASH
        # Triton kernels for every tensor (CPU ones under TRITON_INTERPRET=1, in tests):
        # set by the runner that checked they build (engine.cuda_runner); the plain
        # runner on a GPU (--attention-fallback torch) leaves it off.
        self.use_triton = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] for the batch's new tokens. Returns [T, H*D]."""
        ctx = get_forward_context()
        if self.split:
            return self._forward_split(q, k, v, ctx)
        if self.use_triton:
            triton_attention = triton_attention_backend()
            assert triton_attention is not None, "use_triton set where Triton does not import"
            return triton_attention(q, k, v, ctx, self.layer_idx, self.scale, self.sliding_window)
        if (
            self.use_kernel
            and q.is_cpu
            and q.dtype in _KERNEL_DTYPES
            and ctx.kv_cache.dtype == q.dtype
            and ctx.kv_cache.is_contiguous()
        ):
            kernels = cpu_kernels()
            if kernels is not None:
                return self._forward_kernel(kernels.ops, q, k, v, ctx)
        return self._forward_torch(q, k, v, ctx)

    def _forward_split(self, q, k, v, ctx: ForwardContext) -> torch.Tensor:
        """Deterministic mode: every row through the compiled kernel, one query each."""
        kernels = cpu_kernels()
        if not (
            self.use_kernel
            and kernels is not None
            and q.is_cpu
            and q.dtype in _KERNEL_DTYPES
            and ctx.kv_cache.dtype == q.dtype
            and ctx.kv_cache.is_contiguous()
        ):
            raise RuntimeError(
                "deterministic mode needs the compiled CPU attention kernel for a "
                f"{q.dtype} step on {q.device} (layer {self.layer_idx})"
            )
        ops = kernels.ops
        meta = ctx.attn
        t = q.shape[0]
        ops.write_kv(ctx.kv_cache, self.layer_idx, k, v, meta.slot_mapping)
        tables, lens = row_tables(meta, t)
        out = torch.empty_like(q)
        ops.decode_attention(
            out, q, ctx.kv_cache, self.layer_idx, tables, lens, self.scale,
            self.sliding_window, self.split,
        )  # fmt: skip
        return out.view(t, self.num_heads * self.head_dim)

    def _forward_kernel(self, ops, q, k, v, ctx: ForwardContext) -> torch.Tensor:
        meta = ctx.attn
        t = q.shape[0]
        n_dec = meta.num_decode
        ops.write_kv(ctx.kv_cache, self.layer_idx, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        if n_dec:
            qd, od = (q, out) if n_dec == t else (q[:n_dec], out[:n_dec])
            ops.decode_attention(
                od,
                qd,
                ctx.kv_cache,
                self.layer_idx,
                meta.decode_block_tables,
                decode_context_lens(meta),
                self.scale,
                self.sliding_window,
            )
        for p in meta.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            self._prefill_chunk(ops, out[rows], q[rows], k[rows], v[rows], ctx.kv_cache, p)
        return out.view(t, self.num_heads * self.head_dim)

    def _prefill_chunk(self, ops, out, q, k, v, kv_cache, p) -> None:
        """One prompt chunk's attention into ``out`` on ``prefill_route``, its K/V already
        in the pool. FLASH reads the context, the chunk's own tokens included, straight
        from the pool: no gather, no mask tensor."""
        if self.prefill_route == FLASH:
            ops.prefill_attention(
                out, q, kv_cache, self.layer_idx, p.block_ids, p.start, self.scale,
                self.sliding_window,
            )  # fmt: skip
            return
        k_cache, v_cache = kv_cache[self.layer_idx, 0], kv_cache[self.layer_idx, 1]
        out.copy_(self._prefill(q, k, v, k_cache, v_cache, p))

    def _forward_torch(self, q, k, v, ctx: ForwardContext) -> torch.Tensor:
        meta = ctx.attn
        k_cache = ctx.kv_cache[self.layer_idx, 0]  # [Hkv, NB, bs, D]
        v_cache = ctx.kv_cache[self.layer_idx, 1]
        t = q.shape[0]
        n_dec = meta.num_decode
        self._write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if n_dec == t:  # decode-only step: no output copy
            return self._decode(q, k_cache, v_cache, meta).view(t, -1)
        out = torch.empty_like(q)
        if n_dec:
            out[:n_dec] = self._decode(q[:n_dec], k_cache, v_cache, meta)
        for p in meta.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, p)
        return out.view(t, self.num_heads * self.head_dim)

    @staticmethod
    def _write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
        hkv, nb, bs, d = k_cache.shape
        k_cache.view(hkv, nb * bs, d).index_copy_(1, slot_mapping, k.transpose(0, 1))
        v_cache.view(hkv, nb * bs, d).index_copy_(1, slot_mapping, v.transpose(0, 1))

    def _decode(self, q, k_cache, v_cache, meta) -> torch.Tensor:
        """Plain-torch single-token attention of the decode rows; returns [B, H, D]."""
        tables = meta.decode_block_tables  # [B, M]
        b, m = tables.shape
        hkv, _, bs, d = k_cache.shape
        idx = tables.reshape(-1)
        keys = k_cache.index_select(1, idx).view(hkv, b, m * bs, d)
        values = v_cache.index_select(1, idx).view(hkv, b, m * bs, d)
        qg = q.view(b, hkv, self.group, d).transpose(0, 1)  # [Hkv, B, G, D]
        scores = torch.matmul(qg, keys.transpose(-1, -2))  # [Hkv, B, G, T], q's dtype
        if self.sliding_window:
            mask = decode_window_mask(meta, self.sliding_window, bs)
        else:
            mask = decode_mask(meta, bs)
        # One op scales, masks and widens to fp32 (the mask is fp32).
        scores = torch.add(mask[None, :, None, :], scores, alpha=self.scale)
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        o = torch.matmul(probs, values)  # [Hkv, B, G, D]
        return o.transpose(0, 1).reshape(b, self.num_heads, d)

    def _prefill(self, q, k, v, k_cache, v_cache, p) -> torch.Tensor:
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        window = self.sliding_window
        if p.start == 0:
            keys = k.transpose(0, 1).unsqueeze(0)
            values = v.transpose(0, 1).unsqueeze(0)
            if not window or p.q_len <= window:
                o = F.scaled_dot_product_attention(
                    qh, keys, values, is_causal=True, scale=self.scale, enable_gqa=True
                )
                return o.squeeze(0).transpose(0, 1)
        else:
            hkv, _, bs, d = k_cache.shape
            total = p.start + p.q_len
            keys = k_cache.index_select(1, p.block_ids).view(hkv, -1, d)[:, :total].unsqueeze(0)
            values = v_cache.index_select(1, p.block_ids).view(hkv, -1, d)[:, :total].unsqueeze(0)
        qpos = torch.arange(p.start, p.start + p.q_len, device=q.device).unsqueeze(1)
        kpos = torch.arange(keys.shape[2], device=q.device).unsqueeze(0)
        allowed = kpos <= qpos
        if window:
            allowed &= kpos > qpos - window
        o = F.scaled_dot_product_attention(
            qh, keys, values, attn_mask=allowed, scale=self.scale, enable_gqa=True
        )
        return o.squeeze(0).transpose(0, 1)


def prefill_probe(
    attn: PagedAttention,
    route: str,
    rows: int,
    block_size: int,
    dtype: torch.dtype,
    cached: int | None = None,
) -> Callable[[], object] | None:
    """One call of ``attn``'s prompt-chunk attention on ``route`` (FLASH or TORCH) for the
    kernel route timer (``engine.kernels.route_bench``) and ``benchmarks.prefill_attention``:
    a chunk of ``rows`` tokens after ``cached`` ones (default three times as many), in
    shuffled blocks of a huge-page pool of its own, as the engine's is; the call returns
    the chunk's output. The same arguments give the same data on either route. None where
    the route cannot run this layer here."""
    kernels = cpu_kernels()
    if route not in (FLASH, TORCH) or dtype not in _KERNEL_DTYPES:
        return None
    if kernels is None or not attn.use_kernel:
        return None
    probe = PagedAttention(
        0, attn.num_heads, attn.num_kv_heads, attn.head_dim, sliding_window=attn.sliding_window
    )
    probe.prefill_route = route
    cached = 3 * rows if cached is None else cached
    hkv, d = attn.num_kv_heads, attn.head_dim
    blocks = -(-(cached + rows) // block_size)
    gen = torch.Generator().manual_seed(0)
    shape = (1, 2, hkv, 2 * blocks + 1, block_size, d)
    pool = zeros_on_huge_pages(shape, dtype)
    pool.copy_(torch.randn(shape, generator=gen))
    ids = torch.randperm(2 * blocks, generator=gen)[:blocks] + 1
    q = torch.randn((rows, attn.num_heads, d), generator=gen).to(dtype)
    # The chunk's own K/V, as write_kv leaves them in the pool.
    own = slice(cached, cached + rows)
    k, v = (
        pool[0, i].index_select(1, ids).view(hkv, -1, d)[:, own].transpose(0, 1).contiguous()
        for i in (0, 1)
    )
    out = torch.empty_like(q)
    seq = PrefillSeq(q_start=0, q_len=rows, start=cached, block_ids=ids)

    def run() -> torch.Tensor:
        probe._prefill_chunk(kernels.ops, out, q, k, v, pool, seq)
        return out

    return run
