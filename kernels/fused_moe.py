"""Fused MoE: routed SiLU-gated experts as triton kernels, two paths chosen by the row count.

Owns `moe_align_block_size` (the sort), `grouped_gemm` (the sorted-path kernel launch),
`gemv_experts` (the small-batch path), `get_default_config` / `get_default_gemv_config`,
`use_gemv_path` and `fused_experts` (the whole routed-expert computation); float32 twin
`reference.fused_experts_ref`. Inputs come from the MoE layer (`mla_backend.layers.moe`): hidden
states x [T, H], the stacked expert weights w13 [E, 2I, H] (gate rows then up rows) and
w2 [E, H, I], and the router's choice topk_weights / topk_ids [T, k]; the output [T, H] goes back
to the layer, which adds the shared experts.

Both paths compute, for the T*k (token, slot) pairs numbered row = t*k + j with e = topk_ids[t, j]:

    GEMM1  inter[row] = silu(x[t] @ w13[e, :I]^T) * (x[t] @ w13[e, I:]^T)      [T*k, I]
    GEMM2  out[t]     = sum_j topk_weights[t, j] * (inter[t*k + j] @ w2[e]^T)   [T, H]

Gate and up are computed in the same program (two fp32 accumulators), so the [T*k, 2I] product
never reaches memory; inter is rounded to x's dtype.

Sorted path (T*k > GEMV_MAX_ROWS, prefill). `moe_align_block_size` sorts the rows by expert and
pads each expert's run to a multiple of BLOCK_M with the sentinel T*k, so every BLOCK_M-row block
of `sorted_token_ids` belongs to one expert (`expert_ids`); `grouped_gemm` runs one program per
(row block, column block) with tl.dot tiles, so each expert's weights are read once per column
block for all its rows. GEMM2 writes y[row] = topk_weights[row] * (inter[row] @ w2[e]^T) [T*k, H]
(rounded to x's dtype) and a torch sum over k gives out. About 20 small torch launches (the sort)
plus three kernels.

GEMV path (T*k <= GEMV_MAX_ROWS, decode). No sort: two kernels read each row's expert straight
from topk_ids. `_gemv_gate_up_kernel`, grid (T*k, cdiv(I, BLOCK_N)): one row's BLOCK_N gate and up
outputs, a loop over H in BLOCK_K chunks of fp32 multiply + tl.sum. `_gemv_down_kernel`, grid
(T, cdiv(H, DOWN_BLOCK_N)): one token's BLOCK_N outputs for all k slots at once (a
[k_pad, BLOCK_N, BLOCK_K] weight tile per step, k_pad = next power of two >= k), weighted and
summed over the slots in fp32 and written once, so no separate sum. Rows are grid axis 0, so rows
of one expert at the same column block run at about the same time and share weight tiles through
L2. Each row reads its expert's weights itself (no tl.dot, whose 16-row minimum would waste 15/16
of the tile at T=1), and the grid is T*k*cdiv(I, BLOCK_N) programs, enough to fill the SMs at
T=1. Measured on an H200 (V2-Lite shapes, bf16, T=1): the two GEMV kernels take 19 + 12 us of GPU
time, about what the two grouped GEMMs take (2 x 16 us); the gain, 100 -> 43 us per CUDA-graph
replay of one call, is mostly the sort's launches that are gone. It loses once many rows share
experts (the weight reads then repeat, L2 saves only part of it): see `GEMV_MAX_ROWS`.

Nothing here reads device data on the host: the sort is torch device ops with buffers sized by the
worst case (T*k + min(E, T*k) * (BLOCK_M - 1) rows), the sorted kernels read the used row count
(`num_tokens_post_padded`) on the device and skip the blocks beyond it, and the GEMV kernels read
topk_ids / topk_weights on the device. So a call with fixed shapes can be captured in a CUDA
graph; the path is chosen from shapes only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class MoEConfig(NamedTuple):
    """Tile sizes of the grouped GEMM (all powers of two; block_m/n/k >= 16 for tl.dot).

    block_m: sorted rows per program (the per-expert padding unit).
    block_n: output columns per program. block_k: reduction step.
    group_m: row blocks visited together per column block (L2 reuse of weight tiles).
    num_warps, num_stages: triton launch options (ignored by the interpreter).
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


# Under triton's interpreter (CPU tests) small tiles keep each program cheap and exercise masking.
_INTERPRETER_CONFIG = MoEConfig(block_m=16, block_n=32, block_k=32, group_m=4)


def get_default_config(num_tokens: int, top_k: int, num_experts: int,
                       device: torch.device | str) -> MoEConfig:
    """Tile config for a call, chosen from shapes only (so it is fixed for a captured graph).

    On CUDA, BLOCK_M follows the average rows per expert, T*k/E: decode batches (a few rows per
    expert, weight-bandwidth bound) use 16-row blocks so little padding is computed; prefill
    uses 64- or 128-row blocks. On other devices (the interpreter) small tiles.
    Args:
        num_tokens: T. top_k: k. num_experts: E. device: where the tensors live.
    Returns:
        a MoEConfig.
    """
    if torch.device(device).type != "cuda":
        return _INTERPRETER_CONFIG
    rows_per_expert = num_tokens * top_k / max(num_experts, 1)
    if rows_per_expert <= 16:
        return MoEConfig(block_m=16, block_n=64, block_k=64, group_m=1, num_warps=4, num_stages=4)
    if rows_per_expert <= 48:
        return MoEConfig(block_m=32, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4)
    if rows_per_expert <= 256:
        return MoEConfig(block_m=64, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=3)
    return MoEConfig(block_m=128, block_n=64, block_k=64, group_m=8, num_warps=8, num_stages=3)


def max_padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """Length of `sorted_token_ids` for num_rows = T*k pairs: the worst-case padded row count
    (each of at most min(E, num_rows) used experts adds at most block_m - 1 padding rows),
    rounded up to a whole number of blocks."""
    worst = num_rows + min(num_experts, num_rows) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) rows by expert, padding each expert's run to a multiple of block_m.

    Row r = t*k + j stands for topk_ids[t, j]. Experts appear in increasing order; within an
    expert, rows keep their original order. Only torch device ops with output sizes fixed by the
    shapes (no host reads), so the call can be captured in a CUDA graph.
    Args:
        topk_ids: [T, k] int32/int64 expert ids, each in [0, num_experts) (not checked: an id out
            of range is a device-side index error).
        num_experts: E (>= 1).
        block_m: rows per block (>= 1).
    Returns:
        sorted_token_ids: [P] int32, P = `max_padded_rows(T*k, E, block_m)`: row ids grouped by
            expert; padding entries (within an expert's last block, and every entry past the used
            count) hold the sentinel T*k.
        expert_ids: [P // block_m] int32: the expert of each block; -1 for blocks past the used
            count.
        num_tokens_post_padded: [1] int32: used length of sorted_token_ids (a multiple of
            block_m).
    Raises:
        ValueError: topk_ids not 2-D, num_experts < 1 or block_m < 1.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got {tuple(topk_ids.shape)}")
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"need num_experts >= 1 and block_m >= 1, got {num_experts}, {block_m}")
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)  # [N], N = T*k
    n = flat.numel()
    padded_len = max_padded_rows(n, num_experts, block_m)

    # Per-expert counts by scatter_add (torch.bincount reads its max back to the host on CUDA).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = torch.div(counts + (block_m - 1), block_m, rounding_mode="floor") * block_m
    padded_end = torch.cumsum(padded, 0)  # [E] inclusive end of each expert's padded run
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts  # [E] start in the unpadded sorted order

    sorted_expert, order = torch.sort(flat, stable=True)  # [N], [N]: rows grouped by expert
    rank = torch.arange(n, device=dev) - count_start[sorted_expert]  # position within its expert
    dest = padded_start[sorted_expert] + rank  # [N] position in sorted_token_ids
    sorted_token_ids = torch.full((padded_len,), n, dtype=torch.int32, device=dev)
    sorted_token_ids.scatter_(0, dest, order.to(torch.int32))

    block_start = torch.arange(0, padded_len, block_m, device=dev)  # [P // block_m]
    # Block b belongs to the first expert whose padded run ends after its start (empty experts,
    # whose end equals the previous end, are passed over by right=True).
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    total = padded_end[-1:]  # [1]
    expert_ids = torch.where(block_start < total, expert_ids, -1).to(torch.int32)
    return sorted_token_ids, expert_ids, total.to(torch.int32)


@triton.jit
def _grouped_gemm_kernel(
    A, B, C, TopkWeights, SortedTokenIds, ExpertIds, NumTokensPostPadded,
    N, K, num_rows, a_row_div, num_blocks_m, up_offset,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    FUSE_SILU_MUL: tl.constexpr, MUL_ROUTING_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Program -> (row block, column block), GROUP_M row blocks at a time so consecutive programs
    # reuse a column block of one expert's weights from L2.
    pid = tl.program_id(0)
    num_blocks_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    used = tl.load(NumTokensPostPadded)
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)
    if (pid_m * BLOCK_M < used) & (expert >= 0):
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(SortedTokenIds + offs_m).to(tl.int64)  # [BLOCK_M]; sentinel = num_rows
        mask_m = rows < num_rows
        a_rows = rows // a_row_div  # GEMM1: token of the row; GEMM2: the row itself
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)

        a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
        b_ptrs = (B + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
                  + offs_k[:, None].to(tl.int64) * stride_bk)  # [BLOCK_K, BLOCK_N] = W^T tile
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if FUSE_SILU_MUL:
            up_ptrs = b_ptrs + up_offset  # up rows follow the N gate rows
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(tl.cdiv(K, BLOCK_K)):
            mask_k = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
            if FUSE_SILU_MUL:
                bu = tl.load(up_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
                acc_up = tl.dot(a, bu, acc_up, input_precision=DOT_PRECISION)
                up_ptrs += BLOCK_K * stride_bk

        if FUSE_SILU_MUL:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if MUL_ROUTING_WEIGHT:
            w = tl.load(TopkWeights + rows, mask=mask_m, other=0.0).to(tl.float32)
            acc = acc * w[:, None]
        c_ptrs = C + rows[:, None] * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor,
                 sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
                 num_tokens_post_padded: torch.Tensor, num_rows: int, a_row_div: int,
                 config: MoEConfig, fuse_silu_mul: bool = False,
                 topk_weights: torch.Tensor | None = None) -> torch.Tensor:
    """c[r] = a[r // a_row_div] @ w[expert of r]^T for every sorted row r < num_rows.

    Args:
        a: [Ta, K] activations (any strides); row r reads a[r // a_row_div].
        w: [E, N, K] expert weights (any strides), or [E, 2N, K] with fuse_silu_mul (gate rows
            then up rows).
        c: [num_rows, N] output (any strides), written at the rows listed in sorted_token_ids.
        sorted_token_ids, expert_ids, num_tokens_post_padded: from `moe_align_block_size` with
            block_m = config.block_m.
        num_rows: T*k, the sentinel value of sorted_token_ids.
        a_row_div: k for the first GEMM (rows are (token, slot) pairs over x), 1 for the second.
        config: tile sizes.
        fuse_silu_mul: c = silu(a @ gate^T) * (a @ up^T) instead.
        topk_weights: optional [num_rows] contiguous fp32 routing weights multiplied into row r.
    Returns:
        c. a, w and c share a dtype (float16, bfloat16 or float32); accumulation is fp32.
    Raises:
        ValueError: shape mismatch.
    """
    _, n_w, k = w.shape
    n = n_w // 2 if fuse_silu_mul else n_w
    if a.shape[1] != k or c.shape != (num_rows, n) or (fuse_silu_mul and n_w % 2):
        raise ValueError(f"grouped_gemm: a {tuple(a.shape)}, w {tuple(w.shape)}, "
                         f"c {tuple(c.shape)} do not fit (num_rows {num_rows})")
    num_blocks_m = expert_ids.shape[0]
    if num_blocks_m == 0 or n == 0:
        return c
    grid = (num_blocks_m * triton.cdiv(n, config.block_n),)
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    weights = topk_weights if topk_weights is not None else c  # unused pointer when not weighted
    _grouped_gemm_kernel[grid](
        a, w, c, weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        n, k, num_rows, a_row_div, num_blocks_m, n * w.stride(1),
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        c.stride(0), c.stride(1),
        FUSE_SILU_MUL=fuse_silu_mul, MUL_ROUTING_WEIGHT=topk_weights is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, DOT_PRECISION=precision,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return c


# ------------------------------------------------------------------ GEMV path (small batches)
# Rows (T*k) at or below which `fused_experts` takes the GEMV path. The GEMV path reads an
# expert's weights once per (token, slot) row that uses it (a second row of the same expert finds
# the tiles in L2 only when its programs run at about the same time), the sorted path once per
# expert; but the sorted path pays ~20 launches for the sort (~40 us of GPU time and gaps) and,
# below ~16 rows per expert, tl.dot tiles that are mostly padding. Measured on an H200 at
# DeepSeek-V2-Lite shapes (E 64, top-6, bf16, CUDA-graph replay of one call): GEMV 43 / 165 /
# 224 / 275 / 369 us against sorted 100 / 233 / 269 / 292 / 341 us at T = 1 / 8 / 12 / 16 / 24
# (T*k = 6 / 48 / 72 / 96 / 144), so the crossover lies between 96 and 144 rows; 96 (T <= 16 at
# k = 6) keeps every batch where GEMV was not slower. With more experts (fewer rows sharing one)
# the GEMV path stays ahead longer. Re-check with benchmarks/bench_fused_moe.py.
GEMV_MAX_ROWS = 96


class GemvConfig(NamedTuple):
    """Tile sizes of the GEMV path (all powers of two).

    block_n: gate/up outputs (of I) per program of the first kernel; block_k: its step over H.
    down_block_n: outputs (of H) per program of the second kernel; down_block_k: its step over I
        (each step loads a [k_pad, down_block_n, down_block_k] weight tile, k_pad = next power of
        two >= k).
    num_warps / down_num_warps: warps per program of each kernel; num_stages: triton's software
        pipelining depth for both (the interpreter ignores these three).
    """

    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    down_block_n: int = 8
    down_block_k: int = 128
    down_num_warps: int = 8
    num_stages: int = 2


# Interpreter (CPU tests): small tiles so H 48 / I 40 need masks in both directions.
_INTERPRETER_GEMV_CONFIG = GemvConfig(block_n=16, block_k=32, down_block_n=32, down_block_k=16)


def use_gemv_path(num_tokens: int, top_k: int) -> bool:
    """Whether `fused_experts(path="auto")` takes the GEMV path: T*k <= GEMV_MAX_ROWS."""
    return num_tokens * top_k <= GEMV_MAX_ROWS


def get_default_gemv_config(top_k: int, device: torch.device | str) -> GemvConfig:
    """GEMV tile sizes for a call, from shapes only (fixed for a captured graph).

    On CUDA, tiles picked by a sweep on an H200 at V2-Lite shapes (bench_fused_moe.py --gemv-*):
    the first kernel loads 2 x 16 x 256 weights per step (16 KB in bf16), 6 x 88 = 528 programs
    at T=1 (4 per SM); every block_n 8..64 / block_k 128..256 / 2..8 warps was within ~5%. The
    second loads k_pad x down_block_n x 128 with 8 warps and down_block_n = 64 // k_pad (at least
    8): 8 for k 6 or 8 (256 programs at T=1 with H 2048); it is the more sensitive one (4 warps,
    or a 256 step with 4 warps, ran up to 1.8x slower). At T=1 the two kernels take 19 + 12 us
    of GPU time (104 MB of weights, 3.3 TB/s). Other devices (the interpreter): small tiles.
    Args:
        top_k: k. device: where the tensors live.
    Returns:
        a GemvConfig.
    """
    if torch.device(device).type != "cuda":
        return _INTERPRETER_GEMV_CONFIG
    k_pad = triton.next_power_of_2(max(top_k, 1))
    return GemvConfig(down_block_n=max(8, 64 // k_pad))


@triton.jit
def _gemv_gate_up_kernel(
    X, W13, Inter, TopkIds,
    H, I, up_offset,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_ir, stride_in,
    stride_idt, stride_idk,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # inter[row, n-block] = silu(x[t] . gate rows) * (x[t] . up rows), e = topk_ids[t, j].
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    t = (row // TOP_K).to(tl.int64)
    j = (row % TOP_K).to(tl.int64)
    e = tl.load(TopkIds + t * stride_idt + j * stride_idk).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + t * stride_xt + offs_k[None, :].to(tl.int64) * stride_xh  # [1, BLOCK_K]
    g_ptrs = (W13 + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
              + offs_k[None, :].to(tl.int64) * stride_wh)  # [BLOCK_N, BLOCK_K] gate rows
    u_ptrs = g_ptrs + up_offset  # the up rows follow the I gate rows
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for kb in range(tl.cdiv(H, BLOCK_K)):
        mask_k = offs_k[None, :] < H - kb * BLOCK_K
        xv = tl.load(x_ptrs, mask=mask_k, other=0.0).to(tl.float32)
        w_mask = mask_n[:, None] & mask_k
        g = tl.load(g_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        acc_g += tl.sum(g * xv, axis=1)
        acc_u += tl.sum(u * xv, axis=1)
        x_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_wh
        u_ptrs += BLOCK_K * stride_wh
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    i_ptrs = Inter + row.to(tl.int64) * stride_ir + offs_n.to(tl.int64) * stride_in
    tl.store(i_ptrs, act.to(Inter.dtype.element_ty), mask=mask_n)


@triton.jit
def _gemv_down_kernel(
    Inter, W2, Out, TopkWeights, TopkIds,
    H, I,
    stride_ir, stride_in, stride_we, stride_wn, stride_wi, stride_ot, stride_on,
    stride_twt, stride_twk, stride_idt, stride_idk,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # out[t, n-block] = sum_j topk_weights[t, j] * inter[t*k + j] . w2[e_j, n-block rows].
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    slots = tl.arange(0, K_PAD)
    mask_s = slots < TOP_K
    e = tl.load(TopkIds + t * stride_idt + slots.to(tl.int64) * stride_idk, mask=mask_s,
                other=0).to(tl.int64)  # [K_PAD]
    rw = tl.load(TopkWeights + t * stride_twt + slots.to(tl.int64) * stride_twk, mask=mask_s,
                 other=0.0).to(tl.float32)  # [K_PAD]
    rows = t * TOP_K + slots.to(tl.int64)  # [K_PAD]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = (Inter + rows[:, None, None] * stride_ir
              + offs_k[None, None, :].to(tl.int64) * stride_in)  # [K_PAD, 1, BLOCK_K]
    w_ptrs = (W2 + e[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn
              + offs_k[None, None, :].to(tl.int64) * stride_wi)  # [K_PAD, BLOCK_N, BLOCK_K]
    mask_sn = mask_s[:, None, None] & mask_n[None, :, None]
    acc = tl.zeros([K_PAD, BLOCK_N], dtype=tl.float32)
    for kb in range(tl.cdiv(I, BLOCK_K)):
        mask_k = offs_k[None, None, :] < I - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_s[:, None, None] & mask_k, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=mask_sn & mask_k, other=0.0).to(tl.float32)
        acc += tl.sum(w * a, axis=2)
        a_ptrs += BLOCK_K * stride_in
        w_ptrs += BLOCK_K * stride_wi
    y = tl.sum(acc * rw[:, None], axis=0)  # [BLOCK_N]
    o_ptrs = Out + t * stride_ot + offs_n.to(tl.int64) * stride_on
    tl.store(o_ptrs, y.to(Out.dtype.element_ty), mask=mask_n)


def _is_pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


def gemv_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                 config: GemvConfig) -> torch.Tensor:
    """The GEMV path of `fused_experts` (no sort): two kernel launches and one [T*k, I] buffer.

    Shapes as in `fused_experts`, already checked there (any strides; topk_weights any float
    dtype, read as fp32; out [T, H] of x's dtype is written whole). T*k >= 1, H >= 1.
    Raises:
        ValueError: a tile size that is not a power of two.
    """
    if not all(_is_pow2(v) for v in (config.block_n, config.block_k, config.down_block_n,
                                     config.down_block_k)):
        raise ValueError(f"gemv_experts: tile sizes must be powers of two, got {config}")
    t, h = x.shape
    inter = w2.shape[2]
    top_k = topk_ids.shape[1]
    if inter == 0:
        return out.zero_()
    h_act = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)  # [T*k, I]
    _gemv_gate_up_kernel[(t * top_k, triton.cdiv(inter, config.block_n))](
        x, w13, h_act, topk_ids,
        h, inter, inter * w13.stride(1),
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        h_act.stride(0), h_act.stride(1), topk_ids.stride(0), topk_ids.stride(1),
        TOP_K=top_k, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    _gemv_down_kernel[(t, triton.cdiv(h, config.down_block_n))](
        h_act, w2, out, topk_weights, topk_ids,
        h, inter,
        h_act.stride(0), h_act.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        out.stride(0), out.stride(1), topk_weights.stride(0), topk_weights.stride(1),
        topk_ids.stride(0), topk_ids.stride(1),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_N=config.down_block_n,
        BLOCK_K=config.down_block_k,
        num_warps=config.down_num_warps, num_stages=config.num_stages,
    )
    return out


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  out: torch.Tensor | None = None, *,
                  config: MoEConfig | None = None, gemv_config: GemvConfig | None = None,
                  path: str = "auto") -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), SiLU-gated experts:
    expert_e(v) = w2[e] @ (silu(w13[e, :I] @ v) * (w13[e, I:] @ v)).

    Same math as `mla_backend.layers.moe.experts_forward`, without host synchronisation. The
    [T*k, I] intermediate is rounded to x's dtype, products accumulate in fp32; the sorted path
    also rounds each slot's weighted output to x's dtype before the sum over k, the GEMV path
    sums the slots in fp32 and rounds once.
    Args:
        x: [T, H] float16/bfloat16/float32 (last dim any stride).
        w13: [E, 2I, H], x's dtype (gate rows then up rows).
        w2: [E, H, I], x's dtype.
        topk_weights: [T, k] float (cast to fp32).
        topk_ids: [T, k] int32/int64, each in [0, E) (not checked on the host).
        out: optional [T, H] destination of x's dtype.
        config: sorted-path tile sizes (default `get_default_config(T, k, E, x.device)`).
        gemv_config: GEMV-path tile sizes (default `get_default_gemv_config(k, x.device)`).
        path: "auto" (GEMV when T*k <= GEMV_MAX_ROWS, see `use_gemv_path`; else sorted),
            "gemv" or "sorted" (forced, for tests and benchmarks). Chosen from shapes only.
    Returns:
        out, or a new [T, H] tensor of x's dtype.
    Raises:
        ValueError: shapes or dtypes do not fit together, unknown path, GEMV tiles not powers
            of two.
    """
    if path not in ("auto", "gemv", "sorted"):
        raise ValueError(f"fused_experts: path must be 'auto', 'gemv' or 'sorted', got {path!r}")
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_experts: x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]; got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    t, h = x.shape
    e, two_i, h13 = w13.shape
    inter = two_i // 2
    if h13 != h or two_i % 2 or tuple(w2.shape) != (e, h, inter):
        raise ValueError(f"fused_experts: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)} do not fit (w2 must be [E, H, I])")
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError(f"fused_experts: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T={t}, k]")
    if x.dtype not in _DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"fused_experts: x, w13, w2 must share a float16/bfloat16/float32 "
                         f"dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_experts: topk_ids must be int32/int64, got {topk_ids.dtype}")
    if out is None:
        out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (t, h) or out.dtype != x.dtype:
        raise ValueError(f"fused_experts: out must be [{t}, {h}] {x.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    top_k = topk_ids.shape[1]
    num_rows = t * top_k
    if num_rows == 0 or h == 0:
        return out.zero_()
    if path == "gemv" or (path == "auto" and use_gemv_path(t, top_k)):
        return gemv_experts(x, w13, w2, topk_weights, topk_ids, out,
                            gemv_config or get_default_gemv_config(top_k, x.device))
    cfg = config or get_default_config(t, top_k, e, x.device)

    sorted_ids, expert_ids, used = moe_align_block_size(topk_ids, e, cfg.block_m)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [T*k]
    h_act = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)  # [T*k, I]
    grouped_gemm(x, w13, h_act, sorted_ids, expert_ids, used, num_rows, top_k, cfg,
                 fuse_silu_mul=True)
    y = torch.empty((num_rows, h), dtype=x.dtype, device=x.device)  # [T*k, H]
    grouped_gemm(h_act, w2, y, sorted_ids, expert_ids, used, num_rows, 1, cfg,
                 topk_weights=weights)
    torch.sum(y.view(t, top_k, h), dim=1, out=out)
    return out


__all__ = ["GEMV_MAX_ROWS", "GemvConfig", "MoEConfig", "fused_experts", "gemv_experts",
           "get_default_config", "get_default_gemv_config", "grouped_gemm", "max_padded_rows",
           "moe_align_block_size", "use_gemv_path"]
