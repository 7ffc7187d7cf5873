"""RMSNorm, with an optional fused residual add (vLLM/SGLang `fused_add_rms_norm` semantics).

Used by every decoder layer of `models/`. Math in fp32, result in the input dtype, weight applied
after the cast back (as Hugging Face's `LlamaRMSNorm`), so fp32 runs match HF bit-for-bit up to
reduction order.

Dispatch: `forward` runs the triton kernels of `mla_kernels.rmsnorm` for CUDA tensors (math in
fp32, the weight multiplied in fp32 and the result rounded once — within one output-dtype
rounding of `forward_native`, identical in fp32) and `forward_native` (pure torch, the form
torch.compile traces) on CPU, while compiling, or when x/residual/weight dtypes differ. The
kernel path is inference-only (no autograd) and never modifies its inputs. `forward_fp8` also
hands out the normed rows quantized per token for the dynamic FP8 linears that read them (one
pass on CUDA instead of a norm and a quantization launch).
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

    def forward_fp8(self, x: torch.Tensor, residual: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor,
                                                                    torch.Tensor]]:
        """`forward`, plus the normed rows quantized to FP8 per token for the dynamic FP8
        linears that read them (`quantization.PerTokenFp8`, handed over as their `x_fp8`).

        Args: as `forward`; x [T, hidden] (2-D).
        Returns:
            (normed x, x + residual or None without a residual, (q float8_e4m3fn [T, hidden],
            scale float32 [T, 1])), q and scale exactly `fp8_quant.quantize_per_token(normed
            x)`: on CUDA written by the norm kernel in the same pass (`fp8_out`; the normed
            rows themselves then may differ from `forward`'s in the last bits: the extra store
            changes the kernel's reduction order), elsewhere (CPU, torch.compile) that
            function run after `forward_native`.
        Raises:
            ValueError: x not 2-D, or a residual of another shape.
        """
        if x.dim() != 2:
            raise ValueError(f"forward_fp8: x must be [T, hidden], got {tuple(x.shape)}")
        if residual is not None and residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x {tuple(x.shape)}")
        if not self._use_kernel(x, residual):
            from mla_kernels.fp8_quant import quantize_per_token

            res = self.forward_native(x, residual)
            out, new_res = (res, None) if residual is None else res
            return out, new_res, quantize_per_token(out)
        from mla_kernels.rmsnorm import fused_add_rmsnorm, rmsnorm

        t, d = x.shape
        out = torch.empty((t, d), dtype=x.dtype, device=x.device)
        fp8 = (torch.empty((t, d), dtype=torch.float8_e4m3fn, device=x.device),
               torch.empty((t, 1), dtype=torch.float32, device=x.device))
        if residual is None:
            rmsnorm(_rows(x, d), self.weight, self.variance_epsilon, out=out, fp8_out=fp8)
            return out, None, fp8
        new_res = torch.empty((t, d), dtype=x.dtype, device=x.device)
        fused_add_rmsnorm(_rows(x, d), _rows(residual, d), self.weight, self.variance_epsilon,
                          out=out, residual_out=new_res, fp8_out=fp8)
        return out, new_res, fp8

    def prenorm(self, x: torch.Tensor, residual: torch.Tensor | None, fp8: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """A decoder layer's pre-norm step: (normed, the residual stream, the normed rows
        quantized per token or None). The stream is x itself without a residual (the first
        layer), else x + residual. fp8: also quantize (`forward_fp8`), for a consumer whose
        linears quantize their input per token (`takes_fp8_input`)."""
        if fp8:
            out, new_res, x_fp8 = self.forward_fp8(x, residual)
            return out, (x if residual is None else new_res), x_fp8
        if residual is None:
            return self(x), x, None
        out, new_res = self(x, residual)
        return out, new_res, None

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
