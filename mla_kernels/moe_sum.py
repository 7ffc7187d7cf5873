"""The routed experts' top-k combine as one triton kernel: out = sum_k y[:, k] (+ add).

Owns `moe_sum`; its float32 twin is `reference.moe_sum_ref`. The sorted path of
`fused_moe.fused_experts` writes each (token, chosen expert) row of the down projection, already
scaled by its routing weight, into y [T, k, H]; this kernel adds a token's k rows in float32
and, optionally, a second [T, H] tensor (the shared experts' output of a DeepSeek MoE layer, so
the model needs no separate addition launch), and rounds once to the output dtype. It replaces
`torch.sum(y, dim=1)` followed by `out + shared`: one read of y and of the addend, one write of
out, and the sum rounded once instead of twice.

Grid (T, cdiv(H, BLOCK_H)): each program one column block of one token row, k loads per element
in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_enter, use_pdl

_BLOCK_H = 1024  # columns per program (8 bf16 per thread at 4 warps: one 16-byte access)


@triton.jit
def _moe_sum_kernel(y_ptr, add_ptr, out_ptr, H, stride_yt, stride_yk, stride_add, stride_out,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, HAS_ADD: tl.constexpr,
                    USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    row = y_ptr + t * stride_yt + cols
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(row + k * stride_yk, mask=mask, other=0.0).to(tl.float32)
    if HAS_ADD:
        acc += tl.load(add_ptr + t * stride_add + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum(y: torch.Tensor, out: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = round(sum_j y[t, j] + add[t]) with float32 accumulation (j in y's order).

    Args:
        y: [T, k, H] float (any dtype), last dim contiguous, any other strides.
        out: [T, H] float destination, last dim contiguous (any row stride); may not overlap y.
            It may be `add` itself (each element is read before it is written).
        add: optional [T, H] float, last dim contiguous: added before the one rounding.
    Returns:
        out.
    Raises:
        ValueError: y is not 3-D, out or add is not [T, H], or a last dim is strided.
    """
    if y.dim() != 3:
        raise ValueError(f"moe_sum: y must be [T, k, H], got {tuple(y.shape)}")
    t, k, h = y.shape
    for name, z in (("out", out), ("add", add)):
        if z is None:
            continue
        if tuple(z.shape) != (t, h):
            raise ValueError(f"moe_sum: {name} must be [{t}, {h}], got {tuple(z.shape)}")
        if t and h and z.stride(1) != 1:
            raise ValueError(f"moe_sum: {name} must have a contiguous last dim")
    if t and k and h and y.stride(2) != 1:
        raise ValueError("moe_sum: y must have a contiguous last dim")
    if t == 0 or h == 0:
        return out
    if k == 0:
        return out.zero_() if add is None else out.copy_(add)
    block = min(_BLOCK_H, triton.next_power_of_2(h))
    warps = 4 if block >= 512 else 1
    _moe_sum_kernel[(t, triton.cdiv(h, block))](
        y, out if add is None else add, out, h, y.stride(0), y.stride(1),
        0 if add is None else add.stride(0), out.stride(0), TOP_K=k, BLOCK_H=block,
        HAS_ADD=add is not None, num_warps=warps, **launch_options(use_pdl(y)))
    return out


__all__ = ["moe_sum"]
