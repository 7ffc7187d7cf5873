"""DeepSeek-V2 greedy MoE routing, `softmax_topk`, as one triton kernel.

Owns `softmax_topk`; float32 twin `reference.softmax_topk_ref`. Replaces the three to four torch
launches of the router after the gate GEMM (softmax, top-k, optional renormalization, the
`routed_scaling_factor` multiply) with one: at batch size 1 each of those is a separate short
kernel in every MoE layer. The math is DeepSeek-V2's
`topk_method="greedy"` (the `MoEGate` of its model code): p = softmax(logits) in fp32, the top_k
largest p of each row, divided by their sum when renormalizing, times the scaling factor.

Grid (T,), one program per token row, the row's E scores in registers (E up to 1024). The top-k
is k rounds of argmax (ties go to the lower expert id); the chosen ids come out in descending
score order. Callers that route otherwise (group-limited greedy, DeepSeek-V3's noaux_tc) keep
the torch code of `mla_backend.layers.moe`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_enter, use_pdl

_MAX_EXPERTS = 1024


@triton.jit
def _softmax_topk_kernel(logits_ptr, weights_ptr, ids_ptr, stride_l, stride_w, stride_i, E,
                         scale, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < E
    x = tl.load(logits_ptr + row * stride_l + cols, mask=valid, other=-float("inf"))
    x = x.to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    p = e / tl.sum(e, axis=0)
    # Padding below any real score (>= 0) and below a chosen one (-1): never picked, as k <= E.
    p = tl.where(valid, p, -2.0)
    slots = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, cols, BLOCK_E), axis=0)  # lowest id among ties
        w = tl.where(slots == j, best, w)
        ids = tl.where(slots == j, idx, ids)
        p = tl.where(cols == idx, -1.0, p)
    if RENORMALIZE:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    keep = slots < TOP_K
    tl.store(weights_ptr + row * stride_w + slots, w * scale, mask=keep)
    tl.store(ids_ptr + row * stride_i + slots, ids.to(tl.int64), mask=keep)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool = False,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy softmax routing of T tokens over E experts.

    Args:
        logits: [T, E] router logits, any float dtype (math in fp32); last dim contiguous (any
            row stride). E <= 1024.
        top_k: experts per token, 1 <= top_k <= E.
        renormalize: divide the chosen weights by their sum (+1e-20), as `norm_topk_prob`
            (when top_k > 1).
        scale: multiplies the (renormalized) weights (`routed_scaling_factor`).
    Returns:
        (weights [T, top_k] fp32, ids [T, top_k] int64), each row's ids in descending score
        order (ties: lower id first).
    Raises:
        ValueError: logits not 2-D, a strided last dim, E > 1024 or top_k outside [1, E].
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got {tuple(logits.shape)}")
    t, e = logits.shape
    if not 1 <= e <= _MAX_EXPERTS:
        raise ValueError(f"{e} experts: 1..{_MAX_EXPERTS} supported")
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k {top_k} outside [1, {e}]")
    if t and logits.stride(1) != 1:
        raise ValueError("logits must have a contiguous last dim")
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    block_e = triton.next_power_of_2(e)
    _softmax_topk_kernel[(t,)](logits, weights, ids, logits.stride(0), weights.stride(0),
                               ids.stride(0), e, float(scale), TOP_K=top_k,
                               RENORMALIZE=bool(renormalize and top_k > 1), BLOCK_E=block_e,
                               BLOCK_K=triton.next_power_of_2(top_k),
                               num_warps=1 if block_e <= 256 else 4,
                               **launch_options(use_pdl(logits)))
    return weights, ids


__all__ = ["softmax_topk"]
