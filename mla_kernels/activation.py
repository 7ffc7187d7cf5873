"""SwiGLU gate activation `silu_and_mul` as a triton kernel.

Owns `silu_and_mul`; float32 twin `reference.silu_and_mul_ref`. For x = [gate ‖ up] of last dim
2N (the merged gate/up projection of an MLP), out = silu(gate) * up, computed in fp32 and rounded
once to the output dtype. Grid (T, cdiv(N, BLOCK_N)), each program one contiguous column block of
one row; with `fp8_out` (the rows also quantized to e4m3 per row for a dynamic FP8 down
projection, bit for bit `fp8_quant.quantize_fp8_per_token`) one program per whole row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_quant import _quantize_row, check_per_token_pair
from .pdl import launch_options, pdl_enter, use_pdl

_BLOCK_N = 1024
FP8_MAX_N = 16384  # widest row one program quantizes (fp8_out)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, q_ptr, scale_ptr, stride_x, stride_out, stride_q, N,
                         BLOCK_N: tl.constexpr, QUANT: tl.constexpr, EXACT: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    base = x_ptr + row * stride_x
    gate = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + N + cols, mask=mask, other=0.0).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)
    if QUANT:  # the whole row is this program's (BLOCK_N >= N): quantize the stored values
        q, scale = _quantize_row(y.to(tl.float32), EXACT)
        tl.store(q_ptr + row * stride_q + cols, q, mask=mask)
        tl.store(scale_ptr + row, scale)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None,
                 fp8_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """silu(x[:, :N]) * x[:, N:].

    Args:
        x: [T, 2N] any float dtype, last dim contiguous (any row stride).
        out: optional [T, N] destination (last dim contiguous).
        fp8_out: optional (q float8_e4m3fn [T, N] with a contiguous last dim, scale float32
            [T, 1] contiguous): also written, with the rows as stored in `out` quantized per row
            as `fp8_quant.quantize_fp8_per_token` does (bit for bit), for the dynamic FP8 down
            projection that reads them. Then one program holds a whole row (N <= 16384).
    Returns:
        out, or a new contiguous [T, N] tensor of x's dtype.
    Raises:
        ValueError: x is not 2-D, its last dim is odd or strided, out or fp8_out has the wrong
            shape (or dtype), or fp8_out with N > 16384.
    """
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2N], got {tuple(x.shape)}")
    t, n = x.shape[0], x.shape[1] // 2
    if t and x.stride(1) != 1:
        raise ValueError("x must have a contiguous last dim")
    if out is None:
        out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (t, n) or (t and out.stride(1) != 1):
        raise ValueError(f"out must be [{t}, {n}] with a contiguous last dim")
    q, scale = fp8_out if fp8_out is not None else (None, None)
    if fp8_out is not None:
        check_per_token_pair(q, scale, t, n, "fp8_out")
        if n > FP8_MAX_N:
            raise ValueError(f"fp8_out: rows of {n} > {FP8_MAX_N} columns are not supported")
    if t == 0 or n == 0:
        if q is not None:
            scale.fill_(1e-12)
        return out
    if q is None:
        block = min(_BLOCK_N, triton.next_power_of_2(n))
        warps = 4 if block >= 512 else 1
    else:
        block = triton.next_power_of_2(n)
        warps = 4 if block <= 2048 else 8
    grid = (t, triton.cdiv(n, block))
    _silu_and_mul_kernel[grid](x, out, q, scale, x.stride(0), out.stride(0),
                               0 if q is None else q.stride(0), n, BLOCK_N=block,
                               QUANT=q is not None, EXACT=not x.is_cuda, num_warps=warps,
                               **launch_options(use_pdl(x)))
    return out


__all__ = ["FP8_MAX_N", "silu_and_mul"]
