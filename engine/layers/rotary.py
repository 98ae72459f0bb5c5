"""Rotary position embeddings (default, linear and llama3 scaling), HF rotate-half style.

On CPU the compiled kernel (``engine/kernels``) rotates q and k in one op, rounding after
each multiply and add exactly as the torch ops below do, so the results are identical.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.kernels.cpu import cpu_kernels

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported")


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
    ):
        super().__init__()
        inv = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        # Plain attribute, so a benchmark or test can pin the torch path.
        self.use_kernel = cpu_kernels() is not None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D]; positions: [T]."""
        if (
            self.use_kernel
            and q.is_cpu
            and q.dtype in _KERNEL_DTYPES
            and k.dtype == q.dtype
            and self.cos.dtype in (q.dtype, torch.float32)
            and q.stride(-1) == 1
            and k.stride(-1) == 1
            and positions.dtype == torch.long
        ):
            kernels = cpu_kernels()
            if kernels is not None:
                return kernels.ops.rotary(q, k, self.cos, self.sin, positions)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
