"""RMSNorm, computed in float32 like the HF reference so results match bit for bit.

On CPU the compiled kernel (``engine/kernels``) does the same arithmetic in one pass
instead of eight ops; only the fp32 sum of squares may round differently.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.cpu import cpu_kernels

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        # Plain attribute, so a benchmark or test can pin the torch path.
        self.use_kernel = cpu_kernels() is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.use_kernel
            and x.is_cpu
            and x.dim() == 2
            and x.dtype in _KERNEL_DTYPES
            and self.weight.dtype == x.dtype
        ):
            kernels = cpu_kernels()
            if kernels is not None:
                return kernels.ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)
