"""Paged attention in plain torch: writes K/V by slot mapping, reads by block tables.

Two formulations, each where it measured fastest on CPU:
- prefill chunks: torch SDPA per sequence (causal; an explicit mask when the chunk
  follows cached context);
- single-token queries: one grouped matmul over the gathered blocks of the whole decode
  batch. The cache keeps heads outside blocks, so the gather already has the
  ``[kv_heads, seqs, tokens, head_dim]`` shape the matmul wants.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_context import get_forward_context


class PagedAttention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] for the batch's new tokens. Returns [T, H*D]."""
        ctx = get_forward_context()
        meta = ctx.attn
        k_cache = ctx.kv_cache[self.layer_idx, 0]  # [Hkv, NB, bs, D]
        v_cache = ctx.kv_cache[self.layer_idx, 1]
        hkv, nb, bs, d = k_cache.shape
        flat_k = k_cache.view(hkv, nb * bs, d)
        flat_v = v_cache.view(hkv, nb * bs, d)
        flat_k.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        flat_v.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))

        out = torch.empty_like(q)
        n_dec = meta.num_decode
        if n_dec:
            out[:n_dec] = self._decode(q[:n_dec], k_cache, v_cache, meta)
        for p in meta.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, p)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _decode(self, q, k_cache, v_cache, meta) -> torch.Tensor:
        tables = meta.decode_block_tables  # [B, M]
        b, m = tables.shape
        hkv, _, bs, d = k_cache.shape
        idx = tables.reshape(-1)
        keys = k_cache.index_select(1, idx).view(hkv, b, m * bs, d)
        values = v_cache.index_select(1, idx).view(hkv, b, m * bs, d)
        qg = q.view(b, hkv, self.group, d).transpose(0, 1)  # [Hkv, B, G, D]
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float()  # [Hkv, B, G, T]
        scores = scores * self.scale + meta.decode_mask[None, :, None, :]
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        o = torch.matmul(probs, values)  # [Hkv, B, G, D]
        return o.transpose(0, 1).reshape(b, self.num_heads, d)

    def _prefill(self, q, k, v, k_cache, v_cache, p) -> torch.Tensor:
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if p.start == 0:
            keys = k.transpose(0, 1).unsqueeze(0)
            values = v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qh, keys, values, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            total = p.start + p.q_len
            hkv, _, bs, d = k_cache.shape
            keys = k_cache.index_select(1, p.block_ids).view(hkv, -1, d)[:, :total].unsqueeze(0)
            values = v_cache.index_select(1, p.block_ids).view(hkv, -1, d)[:, :total].unsqueeze(0)
            qpos = torch.arange(p.start, total, device=q.device).unsqueeze(1)
            kpos = torch.arange(total, device=q.device).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qh, keys, values, attn_mask=kpos <= qpos, scale=self.scale, enable_gqa=True
            )
        return o.squeeze(0).transpose(0, 1)
