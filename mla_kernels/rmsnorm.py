"""RMSNorm and fused residual-add + RMSNorm as triton kernels (one program per token row).

Owns `rmsnorm` and `fused_add_rmsnorm`; their float32 twins are `reference.rmsnorm_ref` and
`reference.fused_add_rmsnorm_ref`. Math is fp32 inside: the row is upcast, its mean square
reduced in fp32, the weight multiplied in fp32 and the result rounded once to the output dtype
(SGLang/vLLM semantics). The fused form first rounds x + residual to the residual dtype (that is
the value written back as the next residual stream) and normalizes that rounded sum, exactly as
`fused_add_rmsnorm_ref` does.

Both can also write the normed rows quantized to FP8 e4m3 per row (`fp8_out`): what a dynamic
FP8 linear reading them would compute itself (`fp8_quant.quantize_fp8_per_token`, bit for bit),
in the same pass, so that linear's quantization launch and its read of the rows go.

Layout: rows of a 2-D [T, D] tensor, last dim contiguous, any row stride (so views such as a
column slice of a bigger matrix work without a copy). The whole row lives in registers
(BLOCK_D = next power of two >= D, masked), which is right for hidden sizes up to ~16k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_quant import _quantize_row, check_per_token_pair
from .pdl import launch_options, pdl_enter, use_pdl


@triton.jit
def _store_normed(y, out_ptr, q_ptr, scale_ptr, row, stride_out, stride_q, cols, mask,
                  QUANT: tl.constexpr, EXACT: tl.constexpr):
    """Store the normed row y (fp32) in out's dtype and, with QUANT, that stored row quantized
    to e4m3 with its own scale (`fp8_quant.quantize_fp8_per_token`'s formula and rounding)."""
    yo = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, yo, mask=mask)
    if QUANT:
        q, scale = _quantize_row(yo.to(tl.float32), EXACT)
        tl.store(q_ptr + row * stride_q + cols, q, mask=mask)
        tl.store(scale_ptr + row, scale)


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, q_ptr, scale_ptr, stride_x, stride_out, stride_q,
                    D, eps, BLOCK_D: tl.constexpr, QUANT: tl.constexpr, EXACT: tl.constexpr,
                    USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / D
    y = x * tl.math.rsqrt(var + eps) * w
    _store_normed(y, out_ptr, q_ptr, scale_ptr, row, stride_out, stride_q, cols, mask, QUANT,
                  EXACT)


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, scale_ptr,
                        stride_x, stride_res, stride_out, stride_res_out, stride_q, D, eps,
                        BLOCK_D: tl.constexpr, QUANT: tl.constexpr, EXACT: tl.constexpr,
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
    _store_normed(y, out_ptr, q_ptr, scale_ptr, row, stride_out, stride_q, cols, mask, QUANT,
                  EXACT)


def _launch_cfg(d: int) -> tuple[int, int]:
    block = triton.next_power_of_2(d)
    warps = 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16
    return block, warps


def _check_rows(name: str, t: torch.Tensor, d: int) -> None:
    if t.dim() != 2 or t.shape[1] != d:
        raise ValueError(f"{name} must be [T, {d}], got {tuple(t.shape)}")
    if t.shape[0] > 0 and t.stride(1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride {t.stride(1)})")


def _fp8_outputs(fp8_out: tuple[torch.Tensor, torch.Tensor] | None, t: int, d: int
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """(q, scale, q's row stride) of an optional `fp8_out` after checking it."""
    if fp8_out is None:
        return None, None, 0
    q, scale = fp8_out
    check_per_token_pair(q, scale, t, d, "fp8_out")
    return q, scale, q.stride(0)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            out: torch.Tensor | None = None,
            fp8_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """y = x / sqrt(mean(x², -1) + eps) * weight, fp32 math, one rounding to the output dtype.

    Args:
        x: [T, D] any float dtype; last dim contiguous (any row stride).
        weight: [D] any float dtype (contiguous).
        eps: variance epsilon.
        out: optional [T, D] destination (any float dtype, last dim contiguous); may be x itself.
        fp8_out: optional (q float8_e4m3fn [T, D] with a contiguous last dim, scale float32
            [T, 1] contiguous): also written, with y as stored in `out` quantized per row as
            `fp8_quant.quantize_fp8_per_token` does (bit for bit): the dynamic FP8 linear that
            reads y needs no quantization launch of its own.
    Returns:
        out, or a new contiguous [T, D] tensor of x's dtype.
    Raises:
        ValueError: shapes disagree, a last dim is strided, or fp8_out is malformed.
    """
    d = weight.shape[0]
    _check_rows("x", x, d)
    if out is None:
        out = torch.empty((x.shape[0], d), dtype=x.dtype, device=x.device)
    _check_rows("out", out, d)
    q, scale, stride_q = _fp8_outputs(fp8_out, x.shape[0], d)
    if x.shape[0] == 0:
        return out
    block, warps = _launch_cfg(d)
    _rmsnorm_kernel[(x.shape[0],)](x, weight.contiguous(), out, q, scale, x.stride(0),
                                   out.stride(0), stride_q, d, float(eps), BLOCK_D=block,
                                   QUANT=q is not None, EXACT=not x.is_cuda, num_warps=warps,
                                   **launch_options(use_pdl(x)))
    return out


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      *, out: torch.Tensor | None = None,
                      residual_out: torch.Tensor | None = None,
                      fp8_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
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
        fp8_out: optional (q, scale) also written with the normed rows quantized per row, as
            in `rmsnorm`.
    Raises:
        ValueError: shapes disagree, a last dim is strided, or fp8_out is malformed.
    """
    d = weight.shape[0]
    out = x if out is None else out
    residual_out = residual if residual_out is None else residual_out
    for name, t in (("x", x), ("residual", residual), ("out", out),
                    ("residual_out", residual_out)):
        _check_rows(name, t, d)
        if t.shape[0] != x.shape[0]:
            raise ValueError(f"{name} has {t.shape[0]} rows, x has {x.shape[0]}")
    q, scale, stride_q = _fp8_outputs(fp8_out, x.shape[0], d)
    if x.shape[0] == 0:
        return
    block, warps = _launch_cfg(d)
    _add_rmsnorm_kernel[(x.shape[0],)](
        x, residual, weight.contiguous(), out, residual_out, q, scale, x.stride(0),
        residual.stride(0), out.stride(0), residual_out.stride(0), stride_q, d, float(eps),
        BLOCK_D=block, QUANT=q is not None, EXACT=not x.is_cuda, num_warps=warps,
        **launch_options(use_pdl(x)))


__all__ = ["fused_add_rmsnorm", "rmsnorm"]
