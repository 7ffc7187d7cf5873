"""Greedy token choice and its logprob in one pass over the logits (the sampler's common case).

`greedy_with_logprob` serves `Sampler.launch` (mla_backend/model_executor/sampler.py): for each
row of the last positions' logits [bs, V] (fp32, or bf16 / fp16 from a CUDA graph replay,
upcast on load) it returns the argmax and its logprob logit[chosen] - logsumexp(logits). Torch
needs five or six passes over [bs, V] for that; this reads each row once, keeping per lane a
running maximum with its first index and an online softmax sum (Milakov & Gimelshein, "Online
normalizer calculation for softmax", 2018). From SPLIT_MAX_ROWS rows one program reads a whole
row (`_greedy_logprob_kernel`); below, several programs read parts of a row
(`_greedy_partial_kernel`) and a second launch combines them (`_greedy_combine_kernel`).

Same results as torch: the index is the first position of the row's maximum, or the first NaN
(torch.argmax's rules); the logprob differs from torch's by ~1e-6 relative (summation order).
A row that is entirely -inf gives index 0 and a NaN logprob, as torch does. The tests compare
against torch.argmax and torch.logsumexp in float64.

With `bitmask` (the grammar masks of structured outputs: int32 words, bit j of word i set =
token 32 i + j allowed, xgrammar's layout) the argmax is taken over a row's allowed tokens only,
as torch's over the row with the others set to -inf, while the logsumexp and so the logprob
stay those of the whole row, in the same single read of the logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns a program reads per step (fp32: 16 KB).
GREEDY_BLOCK = 4096
# Row splits: below SPLIT_MAX_ROWS rows (and for rows longer than one BLOCK) each row is read by
# several programs whose partials a second launch combines; one program per row leaves most of
# the GPU idle at small batches. Splits per row: cdiv(SPLIT_TARGET_PROGRAMS, bs), at most the
# row's BLOCKs and MAX_SPLITS, rounded up to a power of two (the combine's tl.arange); each split
# starts at a whole BLOCK, so the rounding can leave the last splits empty (they read nothing).
# Splitting helps most at bs 1 and loses from about bs 192, hence SPLIT_MAX_ROWS.
SPLIT_MAX_ROWS = 160
SPLIT_TARGET_PROGRAMS = 264  # two per SM of an H100 / H200 (132 SMs)
MAX_SPLITS = 64


@triton.jit
def _scan_columns(base, lo, hi, words, masked, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr):
    """Columns [lo, hi) of one row (base: the row's first element): (max, first column of the
    max, first NaN column or INT32_MAX, softmax max m, sum of exp(x - m), a NaN in the row);
    m = -inf and sum 0 when every column is -inf. HAS_MASK and `masked`: the max and the NaN
    column only over the columns the bitmask row `words` allows (the softmax over all)."""
    lane = tl.arange(0, BLOCK)
    neg_inf = float("-inf")
    m = tl.full([BLOCK], neg_inf, tl.float32)  # per-lane running max
    s = tl.zeros([BLOCK], dtype=tl.float32)  # per-lane sum of exp(x - m)
    best = tl.full([BLOCK], neg_inf, tl.float32)  # per-lane max and its first column
    best_idx = lo + lane
    first_nan = tl.full([BLOCK], 2147483647, tl.int32)
    any_nan = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(lo, hi, BLOCK):
        cols = start + lane
        x = tl.load(base + cols, mask=cols < hi, other=neg_inf).to(tl.float32)
        xa = x  # the candidates of the argmax
        if HAS_MASK:
            w = tl.load(words + (cols >> 5), mask=(cols < hi) & masked, other=-1)
            xa = tl.where(((w >> (cols & 31)) & 1) != 0, x, neg_inf)
            any_nan = any_nan | (x != x).to(tl.int32)
        take = xa > best  # strict: a lane keeps the first column of its maximum
        best = tl.where(take, xa, best)
        best_idx = tl.where(take, cols, best_idx)
        first_nan = tl.where((xa != xa) & (first_nan == 2147483647), cols, first_nan)
        new_m = tl.maximum(m, x)
        live = new_m != neg_inf
        alpha = tl.where(live, tl.exp(m - new_m), 0.0)
        s = s * alpha + tl.where(live, tl.exp(x - new_m), 0.0)
        m = new_m
    row_max = tl.max(best, axis=0)
    idx = tl.min(tl.where(best == row_max, best_idx, 2147483647), axis=0)
    nan_idx = tl.min(first_nan, axis=0)
    big_m = tl.max(m, axis=0)
    total = tl.sum(tl.where(m != neg_inf, s * tl.exp(m - big_m), 0.0), axis=0)
    if HAS_MASK:
        row_nan = tl.max(any_nan, axis=0)
    else:
        row_nan = (nan_idx != 2147483647).to(tl.int32)
    return row_max, idx, nan_idx, big_m, total, row_nan


@triton.jit
def _finish_row(base, row, idx, nan_idx, row_nan, big_m, total, next_ptr, lp_ptr, lse_ptr):
    idx = tl.where(nan_idx != 2147483647, nan_idx, idx)  # torch.argmax: the first NaN
    # torch.logsumexp: NaN for a row with a NaN (a GPU's max ignores NaN operands, so the
    # running sums above do not carry it)
    lse = tl.where(row_nan != 0, float("nan"), big_m + tl.log(total))
    chosen = tl.load(base + idx).to(tl.float32)
    tl.store(next_ptr + row, idx.to(tl.int64))
    tl.store(lp_ptr + row, chosen - lse)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _mask_row(mask_rows_ptr, bitmask_ptr, words_stride, row, HAS_MASK: tl.constexpr):
    """(the bitmask row of logits row `row`, whether it has one): mask_rows[row] >= 0."""
    if HAS_MASK:
        mrow = tl.load(mask_rows_ptr + row)
        return bitmask_ptr + tl.maximum(mrow, 0).to(tl.int64) * words_stride, mrow >= 0
    return bitmask_ptr, False


@triton.jit(do_not_specialize=["V"])
def _greedy_logprob_kernel(logits_ptr, stride_row, V, next_ptr, lp_ptr, lse_ptr,
                           mask_rows_ptr, bitmask_ptr, words_stride,
                           BLOCK: tl.constexpr, HAS_MASK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    words, masked = _mask_row(mask_rows_ptr, bitmask_ptr, words_stride, row, HAS_MASK)
    _, idx, nan_idx, big_m, total, row_nan = _scan_columns(base, 0, V, words, masked, BLOCK,
                                                           HAS_MASK)
    _finish_row(base, row, idx, nan_idx, row_nan, big_m, total, next_ptr, lp_ptr, lse_ptr)


@triton.jit(do_not_specialize=["V", "chunk"])
def _greedy_partial_kernel(logits_ptr, stride_row, V, chunk, part_f_ptr, part_i_ptr,
                           mask_rows_ptr, bitmask_ptr, words_stride,
                           SPLITS: tl.constexpr, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr):
    # program (row, split): columns [split * chunk, min(V, (split + 1) * chunk)) -> partials
    # [row, split, :] = (max, softmax max, sum) float32 and (first column of the max, first NaN,
    # a NaN in the columns)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    base = logits_ptr + row * stride_row
    lo = split * chunk
    hi = tl.minimum(lo + chunk, V)
    words, masked = _mask_row(mask_rows_ptr, bitmask_ptr, words_stride, row, HAS_MASK)
    row_max, idx, nan_idx, big_m, total, row_nan = _scan_columns(base, lo, hi, words, masked,
                                                                 BLOCK, HAS_MASK)
    p = (row * SPLITS + split) * 3
    tl.store(part_f_ptr + p, row_max)
    tl.store(part_f_ptr + p + 1, big_m)
    tl.store(part_f_ptr + p + 2, total)
    tl.store(part_i_ptr + p, idx)
    tl.store(part_i_ptr + p + 1, nan_idx)
    tl.store(part_i_ptr + p + 2, row_nan)


@triton.jit
def _greedy_combine_kernel(logits_ptr, stride_row, part_f_ptr, part_i_ptr, next_ptr, lp_ptr,
                           lse_ptr, SPLITS: tl.constexpr):
    # one program per row: the SPLITS partials -> argmax (first column of the max, or the first
    # NaN), logsumexp (max-shifted sum of the splits' sums), the chosen logprob
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, SPLITS)
    pf = part_f_ptr + (row * SPLITS + sp) * 3
    pi = part_i_ptr + (row * SPLITS + sp) * 3
    best = tl.load(pf)
    m = tl.load(pf + 1)
    s = tl.load(pf + 2)
    idx_s = tl.load(pi)
    nan_s = tl.load(pi + 1)
    row_nan = tl.max(tl.load(pi + 2), axis=0)
    row_max = tl.max(best, axis=0)
    idx = tl.min(tl.where(best == row_max, idx_s, 2147483647), axis=0)
    nan_idx = tl.min(nan_s, axis=0)
    big_m = tl.max(m, axis=0)
    total = tl.sum(tl.where(m != float("-inf"), s * tl.exp(m - big_m), 0.0), axis=0)
    base = logits_ptr + row * stride_row
    _finish_row(base, row, idx, nan_idx, row_nan, big_m, total, next_ptr, lp_ptr, lse_ptr)


def _block(v: int) -> int:
    """Columns a program reads per step for rows of v columns: GREEDY_BLOCK, or v rounded up
    to a power of two when that is smaller."""
    return min(GREEDY_BLOCK, triton.next_power_of_2(max(v, 1)))


def num_splits(bs: int, v: int) -> int:
    """Programs per row `greedy_with_logprob` launches for bs rows of v columns by default: 1
    from SPLIT_MAX_ROWS rows, else cdiv(SPLIT_TARGET_PROGRAMS, bs) capped by the row's blocks
    and MAX_SPLITS, rounded up to a power of two (the combine kernel's tl.arange); 1 when the
    cap is 1."""
    if bs >= SPLIT_MAX_ROWS:
        return 1
    want = min(-(-SPLIT_TARGET_PROGRAMS // bs), -(-v // _block(v)), MAX_SPLITS)
    return 1 if want <= 1 else triton.next_power_of_2(want)


def plan_batch_sizes(max_rows: int, v: int) -> list[int]:
    """The smallest batch size of each launch plan `greedy_with_logprob` can take for 1 ..
    max_rows rows of V columns (one per distinct `num_splits`, ascending): running those once
    compiles every kernel variant a batch of at most max_rows rows can need."""
    seen: dict[int, int] = {}
    for bs in range(1, max(1, min(max_rows, SPLIT_MAX_ROWS)) + 1):
        seen.setdefault(num_splits(bs, v), bs)
    return sorted(seen.values())


def greedy_with_logprob(logits: torch.Tensor, splits: int | None = None,
                        bitmask: torch.Tensor | None = None,
                        mask_rows: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(argmax, logprob of the argmax, logsumexp) per row: one launch (one program per row), or,
    below SPLIT_MAX_ROWS rows of more than GREEDY_BLOCK columns, two (several programs per row,
    then a combine per row; `num_splits`).

    Args:
        logits: [bs, V] float32/bfloat16/float16 with a contiguous last dim (any row stride:
            a `[:, :V]` view of padded logits is fine), on CUDA or, under triton's interpreter,
            the CPU.
        splits: programs per row (a power of two from 1 to MAX_SPLITS); default from the batch
            size (`num_splits`). A split that starts past V reads nothing.
        bitmask: int32 [m, >= ceil(V / 32)] with a contiguous last dim, on logits' device: bit
            j of word i set = token 32 i + j allowed. With it, mask_rows (int32 or int64 [bs],
            same device) gives each logits row its bitmask row, -1 for none (every token
            allowed); the argmax is then over the allowed tokens (-inf elsewhere, as torch's
            masked argmax: a row that allows none gives 0), the logsumexp still over the row.
    Returns:
        (next_ids int64 [bs], logprob float32 [bs], lse float32 [bs]) = (logits.argmax(-1),
        logits[r, next] - lse[r], logsumexp(logits[r]) in fp32); see the module docstring for
        NaN and -inf rows.
    Raises:
        ValueError: logits not 2-D, V == 0, a strided last dim, splits not a power of two up
            to MAX_SPLITS, or a bitmask without mask_rows, too narrow or strided.
    """
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"greedy_with_logprob: logits must be [bs, V>0], got "
                         f"{tuple(logits.shape)}")
    if logits.stride(1) != 1:
        raise ValueError("greedy_with_logprob: the last dim must be contiguous")
    if splits is not None and (splits < 1 or splits & (splits - 1) or splits > MAX_SPLITS):
        raise ValueError(f"greedy_with_logprob: splits must be a power of two <= {MAX_SPLITS}, "
                         f"got {splits}")
    bs, v = logits.shape
    has_mask = bitmask is not None
    if has_mask and (mask_rows is None or mask_rows.shape != (bs,) or bitmask.dim() != 2
                     or bitmask.dtype != torch.int32 or bitmask.stride(1) != 1
                     or bitmask.shape[1] * 32 < v):
        raise ValueError(f"greedy_with_logprob: bitmask must be int32 [m, >= {-(-v // 32)}] "
                         f"with a contiguous last dim and mask_rows [{bs}]")
    next_ids = torch.empty(bs, dtype=torch.int64, device=logits.device)
    logprob = torch.empty(bs, dtype=torch.float32, device=logits.device)
    lse = torch.empty(bs, dtype=torch.float32, device=logits.device)
    if bs == 0:
        return next_ids, logprob, lse
    mask_args = (mask_rows, bitmask, bitmask.stride(0)) if has_mask else (next_ids, next_ids, 0)
    block = _block(v)
    warps = 8 if block >= 2048 else 4
    splits = num_splits(bs, v) if splits is None else splits
    if splits <= 1:
        _greedy_logprob_kernel[(bs,)](logits, logits.stride(0), v, next_ids, logprob, lse,
                                      *mask_args, BLOCK=block, HAS_MASK=has_mask,
                                      num_warps=warps)
        return next_ids, logprob, lse
    chunk = -(-v // splits)
    chunk = -(-chunk // block) * block  # whole blocks per split; the last split may be short
    part_f = torch.empty(bs, splits, 3, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(bs, splits, 3, dtype=torch.int32, device=logits.device)
    _greedy_partial_kernel[(bs, splits)](logits, logits.stride(0), v, chunk, part_f, part_i,
                                         *mask_args, SPLITS=splits, BLOCK=block,
                                         HAS_MASK=has_mask, num_warps=warps)
    _greedy_combine_kernel[(bs,)](logits, logits.stride(0), part_f, part_i, next_ids, logprob,
                                  lse, SPLITS=splits, num_warps=1)
    return next_ids, logprob, lse


__all__ = ["GREEDY_BLOCK", "MAX_SPLITS", "SPLIT_MAX_ROWS", "SPLIT_TARGET_PROGRAMS",
           "greedy_with_logprob", "num_splits", "plan_batch_sizes"]
