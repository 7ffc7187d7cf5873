"""RMSNorm, with an optional fused residual add (vLLM/SGLang `fused_add_rms_norm` semantics).

Used by every decoder layer of `models/`. Math in fp32, result in the input dtype, weight applied
after the cast back (as Hugging Face's `LlamaRMSNorm`), so fp32 runs match HF bit-for-bit up to
reduction order.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps).

    Args:
        hidden_size: size of the last dim (the `weight` parameter, HF name `weight`).
        eps: variance epsilon.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Args:
            x: [..., hidden_size], any float dtype.
            residual: same shape/dtype as x, or None.
        Returns:
            residual None: normed x, shape/dtype of x.
            else: (norm(x + residual), x + residual) — the sum is the next residual stream.
        """
        if residual is None:
            return self._norm(x)
        s = x + residual
        return self._norm(s), s

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"
