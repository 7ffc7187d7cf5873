"""RMSNorm, with an optional fused residual add (vLLM/SGLang `fused_add_rms_norm` semantics).

Used by every decoder layer of `models/`. Math in fp32, result in the input dtype, weight applied
after the cast back (as Hugging Face's `LlamaRMSNorm`), so fp32 runs match HF bit-for-bit up to
reduction order.

Dispatch: `forward` runs the triton kernels of `mla_kernels.rmsnorm` for CUDA tensors (math in
fp32, the weight multiplied in fp32 and the result rounded once — within one output-dtype
rounding of `forward_native`, identical in fp32) and `forward_native` (pure torch, the form
torch.compile traces) on CPU, while compiling, or when x/residual/weight dtypes differ. The
kernel path is inference-only (no autograd) and never modifies its inputs.
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

    def _use_kernel(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
        """Whether the triton kernels run (CUDA, not tracing, one dtype throughout)."""
        return (x.is_cuda and not torch.compiler.is_compiling() and x.dtype == self.weight.dtype
                and (residual is None or residual.dtype == x.dtype))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Triton kernels on CUDA, else `forward_native` (same args and results)."""
        if self._use_kernel(x, residual):
            return self.forward_cuda(x, residual)
        return self.forward_native(x, residual)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`forward_native` through the triton kernels (x, residual and weight of one dtype).

        Returns new tensors; x and residual are left unchanged.
        """
        from mla_kernels.rmsnorm import fused_add_rmsnorm, rmsnorm

        d = self.weight.shape[0]
        x2 = _rows(x, d)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if residual is None:
            rmsnorm(x2, self.weight, self.variance_epsilon, out=out.view(-1, d))
            return out
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x {tuple(x.shape)}")
        new_res = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        fused_add_rmsnorm(x2, _rows(residual, d), self.weight, self.variance_epsilon,
                          out=out.view(-1, d), residual_out=new_res.view(-1, d))
        return out, new_res

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Pure torch. Args:
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

    def norm_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Normed x written into `out` (same shape, x's dtype; e.g. a column slice of a wider
        buffer, last dim contiguous): the triton kernel straight into it on CUDA (as `forward`
        dispatches), else `forward_native` and a copy. Returns out."""
        if self._use_kernel(x) and out.dtype == x.dtype and out.dim() == 2 \
                and out.stride(-1) == 1:
            from mla_kernels.rmsnorm import rmsnorm

            rmsnorm(_rows(x, self.weight.shape[0]), self.weight, self.variance_epsilon, out=out)
            return out
        return out.copy_(self.forward_native(x))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"


def _rows(x: torch.Tensor, d: int) -> torch.Tensor:
    """x [..., d] as a 2-D [rows, d] tensor with a contiguous last dim (a view when possible)."""
    if x.shape[-1] != d:
        raise ValueError(f"last dim {x.shape[-1]} != hidden_size {d}")
    x2 = x.reshape(-1, d)
    return x2 if x2.stride(-1) == 1 or x2.shape[0] == 0 else x2.contiguous()
