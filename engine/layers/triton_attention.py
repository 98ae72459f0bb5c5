"""The Triton backend of ``PagedAttention``: one layer's attention of a step on the GPU.

Three launches per layer, whatever the batch: the KV write (negative slots skipped), the
paged decode kernel over the decode rows, and one varlen prefill kernel over every
prefill chunk. Nothing is gathered and nothing is padded to the longest sequence. The
runner fills ``decode_context_lens``, ``decode_splits`` and ``packed_prefills`` once a
step; metadata without packed prefills (tests, other runners) gets them built here once
and kept for the other layers.

The kernels import Triton, so this module is imported only when Triton attention runs.
"""

from __future__ import annotations

import torch

from engine.forward_context import AttentionMetadata, ForwardContext, PackedPrefills
from engine.kernels.triton_decode_attention import paged_decode_attention
from engine.kernels.triton_kv_write import write_kv
from engine.kernels.triton_prefill_attention import paged_prefill_attention


def packed_prefills(meta: AttentionMetadata, device: torch.device) -> PackedPrefills:
    """``meta.packed_prefills``, built from ``meta.prefills`` on first use."""
    packed = meta.packed_prefills
    if packed is None:
        seqs = meta.prefills
        width = max(len(p.block_ids) for p in seqs)
        tables = torch.zeros((len(seqs), width), dtype=torch.int32, device=device)
        for i, p in enumerate(seqs):
            tables[i, : len(p.block_ids)] = p.block_ids
        columns = [[p.q_start for p in seqs], [p.q_len for p in seqs], [p.start for p in seqs]]
        q_start, q_len, ctx = torch.tensor(columns, dtype=torch.int32, device=device)
        packed = PackedPrefills(q_start, q_len, ctx, tables, max(p.q_len for p in seqs))
        meta.packed_prefills = packed
    return packed


def decode_lens(meta: AttentionMetadata) -> torch.Tensor:
    """Context lengths of the decode rows, derived from the mask once if the runner did not
    fill them."""
    if meta.decode_context_lens is None:
        assert meta.decode_mask is not None
        meta.decode_context_lens = (meta.decode_mask == 0).sum(-1)
    return meta.decode_context_lens


def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: ForwardContext,
    layer: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] of the step's new tokens. Returns [T, H*D]."""
    meta = ctx.attn
    cache = ctx.kv_cache
    t = q.shape[0]
    write_kv(cache, layer, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    n_dec = meta.num_decode
    if n_dec:
        assert meta.decode_block_tables is not None
        paged_decode_attention(
            out[:n_dec],
            q[:n_dec],
            cache,
            layer,
            meta.decode_block_tables,
            decode_lens(meta),
            scale,
            window=window,
            num_splits=meta.decode_splits,
        )
    if meta.prefills or (meta.packed_prefills is not None and t > n_dec):
        p = packed_prefills(meta, q.device)
        paged_prefill_attention(
            out,
            q,
            cache,
            layer,
            p.block_tables,
            p.q_start,
            p.q_len,
            p.ctx_start,
            p.max_q_len,
            scale,
            window=window,
        )
    return out.view(t, -1)
