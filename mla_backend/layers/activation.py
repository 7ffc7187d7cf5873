"""Gated activations for MLPs whose gate and up projections are merged into one matmul."""

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
        if x.shape[-1] % 2:
            raise ValueError(f"SiluAndMul: last dim must be even, got {x.shape[-1]}")
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
