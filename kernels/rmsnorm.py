"""RMSNorm and fused residual-add + RMSNorm as triton kernels (one program per token row).

Owns `rmsnorm` and `fused_add_rmsnorm`; their float32 twins are `reference.rmsnorm_ref` and
`reference.fused_add_rmsnorm_ref`. Math is fp32 inside: the row is upcast, its mean square
reduced in fp32, the weight multiplied in fp32 and the result rounded once to the output dtype
(SGLang/vLLM semantics). The fused form first rounds x + residual to the residual dtype (that is
the value written back as the next residual stream) and normalizes that rounded sum, exactly as
`fused_add_rmsnorm_ref` does.

Layout: rows of a 2-D [T, D] tensor, last dim contiguous, any row stride (so views such as a
column slice of a bigger matrix work without a copy). The whole row lives in registers
(BLOCK_D = next power of two >= D, masked), which is right for hidden sizes up to ~16k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_enter, use_pdl


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, D, eps,
                    BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / D
    y = x * tl.math.rsqrt(var + eps) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res,
                        stride_out, stride_res_out, D, eps, BLOCK_D: tl.constexpr,
                        USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    # Round the sum to the stored residual dtype and normalize that value (reference semantics).
    s = (x + r).to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + row * stride_res_out + cols, s, mask=mask)
    s = s.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(s * s, axis=0) / D
    y = s * tl.math.rsqrt(var + eps) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_cfg(d: int) -> tuple[int, int]:
    block = triton.next_power_of_2(d)
    warps = 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16
    return block, warps


def _check_rows(name: str, t: torch.Tensor, d: int) -> None:
    if t.dim() != 2 or t.shape[1] != d:
        raise ValueError(f"{name} must be [T, {d}], got {tuple(t.shape)}")
    if t.shape[0] > 0 and t.stride(1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride {t.stride(1)})")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x / sqrt(mean(x², -1) + eps) * weight, fp32 math, one rounding to the output dtype.

    Args:
        x: [T, D] any float dtype; last dim contiguous (any row stride).
        weight: [D] any float dtype (contiguous).
        eps: variance epsilon.
        out: optional [T, D] destination (any float dtype, last dim contiguous); may be x itself.
    Returns:
        out, or a new contiguous [T, D] tensor of x's dtype.
    Raises:
        ValueError: shapes disagree or a last dim is strided.
    """
    d = weight.shape[0]
    _check_rows("x", x, d)
    if out is None:
        out = torch.empty((x.shape[0], d), dtype=x.dtype, device=x.device)
    _check_rows("out", out, d)
    if x.shape[0] == 0:
        return out
    block, warps = _launch_cfg(d)
    _rmsnorm_kernel[(x.shape[0],)](x, weight.contiguous(), out, x.stride(0), out.stride(0), d,
                                   float(eps), BLOCK_D=block, num_warps=warps,
                                   **launch_options(use_pdl(x)))
    return out


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      *, out: torch.Tensor | None = None,
                      residual_out: torch.Tensor | None = None) -> None:
    """residual ← round(x + residual); x ← rmsnorm(residual) — in place by default.

    SGLang/vLLM `fused_add_rmsnorm` semantics. The sum is computed in fp32, rounded to the
    residual output's dtype, stored, and that rounded value is normalized in fp32.

    Args:
        x: [T, D] float, last dim contiguous; overwritten with the normed rows unless `out` given.
        residual: [T, D] float, last dim contiguous; overwritten with x + residual unless
            `residual_out` given.
        weight: [D].
        eps: variance epsilon.
        out: optional destination [T, D] for the normed rows instead of x.
        residual_out: optional destination [T, D] for the sum instead of residual.
    Raises:
        ValueError: shapes disagree or a last dim is strided.
    """
    d = weight.shape[0]
    out = x if out is None else out
    residual_out = residual if residual_out is None else residual_out
    for name, t in (("x", x), ("residual", residual), ("out", out),
                    ("residual_out", residual_out)):
        _check_rows(name, t, d)
        if t.shape[0] != x.shape[0]:
            raise ValueError(f"{name} has {t.shape[0]} rows, x has {x.shape[0]}")
    if x.shape[0] == 0:
        return
    block, warps = _launch_cfg(d)
    _add_rmsnorm_kernel[(x.shape[0],)](
        x, residual, weight.contiguous(), out, residual_out, x.stride(0), residual.stride(0),
        out.stride(0), residual_out.stride(0), d, float(eps), BLOCK_D=block,
        num_warps=warps, **launch_options(use_pdl(x)))


__all__ = ["fused_add_rmsnorm", "rmsnorm"]
