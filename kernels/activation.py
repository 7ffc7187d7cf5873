"""SwiGLU gate activation `silu_and_mul` as a triton kernel.

Owns `silu_and_mul`; float32 twin `reference.silu_and_mul_ref`. For x = [gate ‖ up] of last dim
2N (the merged gate/up projection of an MLP), out = silu(gate) * up, computed in fp32 and rounded
once to the output dtype. Grid (T, cdiv(N, BLOCK_N)), each program one contiguous column block of
one row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_enter, use_pdl

_BLOCK_N = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, N, BLOCK_N: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    base = x_ptr + row * stride_x
    gate = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + N + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x[:, :N]) * x[:, N:].

    Args:
        x: [T, 2N] any float dtype, last dim contiguous (any row stride).
        out: optional [T, N] destination (last dim contiguous).
    Returns:
        out, or a new contiguous [T, N] tensor of x's dtype.
    Raises:
        ValueError: x is not 2-D, its last dim is odd or strided, or out has the wrong shape.
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
    if t == 0 or n == 0:
        return out
    block = min(_BLOCK_N, triton.next_power_of_2(n))
    grid = (t, triton.cdiv(n, block))
    _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), n, BLOCK_N=block,
                               num_warps=4 if block >= 512 else 1,
                               **launch_options(use_pdl(x)))
    return out


__all__ = ["silu_and_mul"]
