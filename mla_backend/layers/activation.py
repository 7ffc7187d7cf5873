"""Gated activations for MLPs whose gate and up projections are merged into one matmul.

`forward` runs the triton kernel `mla_kernels.activation.silu_and_mul` for CUDA tensors (fp32
math, one rounding) and `forward_native` (pure torch, the form torch.compile traces) on CPU or
while compiling. Inference-only on CUDA (no autograd).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for x of last dim 2d (gate first, then up).

    Args of forward: x [..., 2d]. Returns [..., d], dtype of x.
    Raises: ValueError if the last dim is odd.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and not torch.compiler.is_compiling():
            return self.forward_cuda(x)
        return self.forward_native(x)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """`forward_native` through the triton kernel; returns a new contiguous tensor."""
        from mla_kernels.activation import silu_and_mul

        if x.shape[-1] % 2:
            raise ValueError(f"SiluAndMul: last dim must be even, got {x.shape[-1]}")
        two_d = x.shape[-1]
        x2 = x.reshape(-1, two_d)
        if x2.shape[0] and x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = torch.empty(x.shape[:-1] + (two_d // 2,), dtype=x.dtype, device=x.device)
        silu_and_mul(x2, out=out.view(-1, two_d // 2))
        return out

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """Pure torch."""
        if x.shape[-1] % 2:
            raise ValueError(f"SiluAndMul: last dim must be even, got {x.shape[-1]}")
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
