"""Flash-decoding's shared half: the split plan's per-split length and stage 2, the merge of
the splits' partial outputs by their log-sum-exp.

Used by both stage-1 kernels, `decode_attention` (triton) and `decode_attention_ws` (Gluon,
sm_90), so that neither imports the other's module for it. Imports torch and triton only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_enter

# Smallest number of tokens a split is given by the split plans (short sequences get fewer
# splits so that each program still has at least this much work).
MIN_TOKENS_PER_SPLIT = 64
# Pool dtypes whose tiles are FP8 (per-tensor scaled).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@triton.jit
def split_len(seq_len, n_splits, ALIGN: tl.constexpr):
    """Tokens per split: cdiv(seq_len, n_splits) rounded up to ALIGN (at least ALIGN)."""
    per = tl.cdiv(seq_len, n_splits)
    per = tl.cdiv(per, ALIGN) * ALIGN
    return tl.maximum(per, ALIGN)


@triton.jit
def merge_splits_kernel(
    MidO, MidLse, O, SeqLens, NumKvSplits,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ls, stride_ob, stride_oh,
    Lv: tl.constexpr, MAX_KV_SPLITS: tl.constexpr, BLOCK_DV: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr, SPLIT_BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
    SKIP_SINGLE: tl.constexpr = False,
):
    """o[b, h] = sum_s exp(lse_s - m) * part_s / sum_s exp(lse_s - m), m = max_s lse_s, over the
    non-empty splits, SPLIT_BLOCK splits per step (the LSEs and partial outputs of a step are
    loaded together; a plan with no more splits takes one step: one round of loads instead of
    a dependent chain per split); 0 when there are none. SKIP_SINGLE: requests with exactly one
    non-empty split are left alone (their stage 1 wrote o itself: `decode_attention_ws`)."""
    pdl_enter(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    n_splits = tl.minimum(tl.maximum(tl.load(NumKvSplits + b), 1), MAX_KV_SPLITS)
    per = split_len(seq_len, n_splits, SPLIT_ALIGN)
    n_valid = tl.minimum(n_splits, tl.cdiv(seq_len, per))  # non-empty splits only
    if SKIP_SINGLE:
        n_valid = tl.where(n_valid == 1, -1, n_valid)  # -1: neither the loop nor the store

    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < Lv
    offs_s = tl.arange(0, SPLIT_BLOCK)
    mid = MidO + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
    lse_ptr = MidLse + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
    m = float("-inf")
    den = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s0 in range(0, n_valid, SPLIT_BLOCK):
        live = s0 + offs_s < n_valid  # at least the first: m_new is finite
        lse = tl.load(lse_ptr + (s0 + offs_s) * stride_ls, mask=live, other=float("-inf"))
        part = tl.load(mid + (s0 + offs_s)[:, None] * stride_ms + offs_dv[None, :],
                       mask=live[:, None] & mask_dv[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        scale_old = tl.exp(m - m_new)  # 0 on the first step
        w = tl.exp(lse - m_new)  # 0 for the masked splits
        acc = acc * scale_old + tl.sum(w[:, None] * part, axis=0)
        den = den * scale_old + tl.sum(w, axis=0)
        m = m_new
    out = tl.where(den > 0, acc / tl.maximum(den, 1e-30), 0.0)
    o_ptr = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + offs_dv
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=mask_dv & (n_valid >= 0))


def merge_split_block(max_kv_splits: int) -> int:
    """Splits the merge kernel loads at once: all of them up to 8 (a power of two)."""
    return min(8, triton.next_power_of_2(max(1, max_kv_splits)))
