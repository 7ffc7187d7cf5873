"""Greedy token choice and its logprob in one pass over the logits (the sampler's common case).

`Sampler.launch` (mla_backend/model_executor/sampler.py) needs, per request row of the last
positions' fp32 logits [bs, V]: the argmax (greedy rows) and the chosen token's logprob
logit[chosen] - logsumexp(logits). In torch that is an argmax and a logsumexp (amax, a
broadcast subtraction, exp, sum, log) plus a gather: five or six passes over [bs, V]
(V = 102,400 for DeepSeek; on an H200 at bs 512 about 0.43 ms per decode step,
docs/benchmarks.md, "Grouped-GEMM tiles, the router's GEMM"). `greedy_with_logprob` reads each
row once: per lane a running maximum with its first index, and an online softmax sum
(Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018), combined across lanes
at the end.

Same results as torch: the index is the first position of the row's maximum (torch.argmax's
rule), or the first NaN when the row has one (torch.argmax treats NaN as the maximum); the
logprob is the chosen logit minus the row's logsumexp in fp32 (summation order differs from
torch's: ~1e-6 relative). A row that is entirely -inf gives index 0 and a NaN logprob, as torch.
Float64 / torch twin: the tests compare against torch.argmax and torch.logsumexp in float64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns a program reads per step (fp32: 16 KB).
GREEDY_BLOCK = 4096


@triton.jit(do_not_specialize=["V"])
def _greedy_logprob_kernel(logits_ptr, stride_row, V, next_ptr, lp_ptr, lse_ptr,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    lane = tl.arange(0, BLOCK)
    neg_inf = float("-inf")
    m = tl.full([BLOCK], neg_inf, tl.float32)  # per-lane running max
    s = tl.zeros([BLOCK], dtype=tl.float32)  # per-lane sum of exp(x - m)
    best = tl.full([BLOCK], neg_inf, tl.float32)  # per-lane max and its first column
    best_idx = lane
    first_nan = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + lane
        x = tl.load(base + cols, mask=cols < V, other=neg_inf).to(tl.float32)
        take = x > best  # strict: a lane keeps the first column of its maximum
        best = tl.where(take, x, best)
        best_idx = tl.where(take, cols, best_idx)
        first_nan = tl.where((x != x) & (first_nan == 2147483647), cols, first_nan)
        new_m = tl.maximum(m, x)
        live = new_m != neg_inf
        alpha = tl.where(live, tl.exp(m - new_m), 0.0)
        s = s * alpha + tl.where(live, tl.exp(x - new_m), 0.0)
        m = new_m
    row_max = tl.max(best, axis=0)
    idx = tl.min(tl.where(best == row_max, best_idx, 2147483647), axis=0)
    nan_idx = tl.min(first_nan, axis=0)
    has_nan = nan_idx != 2147483647
    idx = tl.where(has_nan, nan_idx, idx)
    big_m = tl.max(m, axis=0)
    total = tl.sum(tl.where(m != neg_inf, s * tl.exp(m - big_m), 0.0), axis=0)
    lse = big_m + tl.log(total)
    chosen = tl.load(base + idx).to(tl.float32)
    tl.store(next_ptr + row, idx.to(tl.int64))
    tl.store(lp_ptr + row, chosen - lse)
    tl.store(lse_ptr + row, lse)


def greedy_with_logprob(logits: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(argmax, logprob of the argmax, logsumexp) per row, one launch.

    Args:
        logits: [bs, V] float32/bfloat16/float16 with a contiguous last dim (any row stride:
            a `[:, :V]` view of padded logits is fine), on CUDA or, under triton's interpreter,
            the CPU.
    Returns:
        (next_ids int64 [bs], logprob float32 [bs], lse float32 [bs]) = (logits.argmax(-1),
        logits[r, next] - lse[r], logsumexp(logits[r]) in fp32); see the module docstring for
        NaN and -inf rows.
    Raises:
        ValueError: logits not 2-D, V == 0, or a strided last dim.
    """
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"greedy_with_logprob: logits must be [bs, V>0], got "
                         f"{tuple(logits.shape)}")
    if logits.stride(1) != 1:
        raise ValueError("greedy_with_logprob: the last dim must be contiguous")
    bs, v = logits.shape
    next_ids = torch.empty(bs, dtype=torch.int64, device=logits.device)
    logprob = torch.empty(bs, dtype=torch.float32, device=logits.device)
    lse = torch.empty(bs, dtype=torch.float32, device=logits.device)
    if bs == 0:
        return next_ids, logprob, lse
    block = min(GREEDY_BLOCK, triton.next_power_of_2(v))
    _greedy_logprob_kernel[(bs,)](logits, logits.stride(0), v, next_ids, logprob, lse,
                                  BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return next_ids, logprob, lse


__all__ = ["GREEDY_BLOCK", "greedy_with_logprob"]
