"""Fused MoE: routed SiLU-gated experts as triton kernels, two paths chosen by the row count.

Owns `moe_align_block_size` (the sort), `grouped_gemm`, `gemv_experts`, the default configs,
`use_gemv_path` and `fused_experts` (the whole routed-expert computation); float32 twin
`reference.fused_experts_ref`. The MoE layer (`mla_backend.layers.moe`) passes x [T, H], w13
[E, 2I, H] (gate rows then up rows), w2 [E, H, I] and the router's topk_weights / topk_ids
[T, k]; the output [T, H] goes back to it, which adds the shared experts. For row = t*k + j,
e = topk_ids[t, j]:

    GEMM1  inter[row] = silu(x[t] @ w13[e, :I]^T) * (x[t] @ w13[e, I:]^T)      [T*k, I]
    GEMM2  out[t]     = sum_j topk_weights[t, j] * (inter[t*k + j] @ w2[e]^T)   [T, H]

Gate and up share a program, so [T*k, 2I] never reaches memory; inter is rounded to x's dtype.
Sorted path (T*k > GEMV_MAX_ROWS): rows sorted by expert and padded to BLOCK_M blocks, tl.dot
tiles, each expert's weights read once per column block. GEMV path (decode): no sort, each row
reads its expert's weights itself (`fused_moe_gemv`). FP8 weights (W8A8; per-tensor [E] or
DeepSeek-V3 block scales) have their activations quantized before each GEMM, never inside it
(the interpreter's in-kernel fp8 rounding is wrong). No host reads of device data: a call with
fixed shapes can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .fused_moe_gemv import _gemv_down_kernel, _gemv_gate_up_kernel
from .moe_sum import moe_sum
from .pdl import launch_options, use_pdl


class MoEConfig(NamedTuple):
    """Tile sizes of the grouped GEMM (all powers of two; block_m/n/k >= 16 for tl.dot).

    block_m: sorted rows per program (the per-expert padding unit).
    block_n: output columns per program. block_k: reduction step.
    group_m: row blocks visited together per column block (L2 reuse of weight tiles).
    num_warps, num_stages: triton launch options (ignored by the interpreter).
    b_desc: load the weight tiles through a tensor descriptor (`TensorDescriptor`: on Hopper a
        TMA copy per tile) instead of per-thread pointer loads; the gathered activation rows
        keep pointer loads (`benchmarks/bench_moe_tiles.py --b-desc`). On by default only in
        the FP8 down GEMM's tiles from 17 to 64 rows per expert on Hopper
        (`get_default_config(down=True)`; at V2-Lite's E 64, top-6: T 182-682 tokens).
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    b_desc: bool = False


# Rows per expert (T*k/E) above which the sorted path takes 128-row blocks (one block per
# expert, each weight tile read once for up to 128 rows, 128-wide N blocks halving the re-reads
# of the gathered activation rows) instead of 64-row ones. Chosen with
# `bench_moe_tiles.py --block-ms 64 128` on V2-Lite's experts: the 64-row tiles stay faster at
# 60 rows per expert, the 128-row ones win from about 72.
BLOCK_M_128_ROWS = 64

# Under triton's interpreter (CPU tests) small tiles keep each program cheap and exercise masking.
_INTERPRETER_CONFIG = MoEConfig(block_m=16, block_n=32, block_k=32, group_m=4)


def get_default_config(num_tokens: int, top_k: int, num_experts: int,
                       device: torch.device | str, fp8: bool = False,
                       down: bool = False, dtype: torch.dtype | None = None) -> MoEConfig:
    """Tile config for a call, chosen from shapes only (so it is fixed for a captured graph).

    On CUDA, BLOCK_M follows the average rows per expert, T*k/E: small decode batches (a few
    rows per expert) use 16-row blocks so little padding is computed; from 17 rows per expert (bf16:
    33) one 64-row block per expert, so each weight tile is read once for all of its rows; above
    `BLOCK_M_128_ROWS` (64) rows per expert 128 x 128 tiles with 8 warps (large decode batches: T >
    682 at V2-Lite's E 64, top-6; and prefill). FP8 weights take 128-deep K steps (one byte per
    element: the same bytes per step as bf16's 64). The tiles above 16 rows per expert are the
    fastest of a per-GEMM sweep at V2-Lite's expert shapes (E 64, top-6, H 2048, I 1408;
    `benchmarks/bench_moe_tiles.py`). A GPU with less shared memory per block than the tiles take
    gets narrower ones (`fit_shared_memory`). On other devices (the interpreter) small tiles. The
    second (down) GEMM may take other tiles of the same BLOCK_M (`down`): on Hopper (sm 9.x, where
    they were timed; TMA), with FP8 weights from 17 to 64 rows per expert, 128-wide N blocks whose
    weight tiles load through a tensor descriptor, a little faster per GEMM and per call
    (`bench_moe_tiles.py --b-desc both`, `bench_fused_moe.py --down-tiles`). From 65 to 256 rows per
    expert the gate/up GEMM pipelines 4 stages, the down GEMM 3 (both dtypes; the sweep at T 768 /
    945 with `--block-ms 64 128`, the comment at `BLOCK_M_128_ROWS`).
    Args:
        num_tokens: T. top_k: k. num_experts: E. device: where the tensors live. fp8: the
            weights are float8_e4m3fn. down: the tiles of the second GEMM. dtype: the
            activations' and weights' dtype without FP8 (None: 16-bit); the shared memory the
            tiles take scales with its size, so float32 may get narrower tiles.
    Returns:
        a MoEConfig.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return _INTERPRETER_CONFIG
    bk = 128 if fp8 else 64
    rows_per_expert = num_tokens * top_k / max(num_experts, 1)
    if rows_per_expert <= 16:
        cfg = MoEConfig(block_m=16, block_n=64, block_k=bk, group_m=1, num_warps=4, num_stages=4)
    elif rows_per_expert <= 32 and not fp8:
        cfg = MoEConfig(block_m=32, block_n=64, block_k=128, group_m=8, num_warps=4,
                        num_stages=3)
    elif rows_per_expert <= BLOCK_M_128_ROWS:
        wide = down and fp8 and _compute_capability(device)[0] == 9
        cfg = MoEConfig(block_m=64, block_n=128 if wide else 64, block_k=bk, group_m=8,
                        num_warps=4, num_stages=3, b_desc=wide)
    else:
        stages = 4 if rows_per_expert <= 256 and not down else 3
        cfg = MoEConfig(block_m=128, block_n=128, block_k=bk, group_m=8, num_warps=8,
                        num_stages=stages)
    elem_bytes = 1 if fp8 else (2 if dtype is None else dtype.itemsize)
    return fit_shared_memory(cfg, elem_bytes, _max_shared_memory(device))


def moe_tile_smem_bytes(config: MoEConfig, elem_bytes: int) -> int:
    """Shared memory the pipelined tiles of the fused gate/up GEMM take, as an estimate in
    bytes: num_stages x (an A tile [BLOCK_M, BLOCK_K] + two weight tiles [BLOCK_K, BLOCK_N]) x
    the operand's bytes per element (1 for FP8, 2 for 16-bit, 4 for float32)."""
    return config.num_stages * (config.block_m * config.block_k
                                + 2 * config.block_k * config.block_n) * elem_bytes


def fit_shared_memory(config: MoEConfig, elem_bytes: int, max_bytes: int | None) -> MoEConfig:
    """config if its tiles fit max_bytes of shared memory per block (`moe_tile_smem_bytes`;
    None: unknown, config unchanged); else the same BLOCK_M with 64-wide N tiles, 64-deep K
    steps (bf16) and 2 stages (at most 64 KB). The sweep's tiles need up to 144 KB, which an
    H100 / H200 (227 KB) or A100 (163 KB) has and an sm89 / sm86 GPU (99 KB) has not."""
    if max_bytes is None or moe_tile_smem_bytes(config, elem_bytes) <= max_bytes:
        return config
    return config._replace(block_n=64, block_k=min(config.block_k, 128 // elem_bytes),
                           num_stages=2)


@functools.lru_cache(maxsize=None)
def _compute_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device; read once per device."""
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def _max_shared_memory(device: torch.device) -> int | None:
    """Opt-in shared memory per block of a CUDA device, in bytes (None when torch does not
    report it); read once per device."""
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin",
                   None)


def max_padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """Length of `sorted_token_ids` for num_rows = T*k pairs: the worst-case padded row count
    (each of at most min(E, num_rows) used experts adds at most block_m - 1 padding rows),
    rounded up to a whole number of blocks."""
    worst = num_rows + min(num_experts, num_rows) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


# The sort's three kernels work on [rows, E_pad] one-hot tiles of int32: about this many elements
# per program (E_pad = the expert count rounded up to a power of two, at least 16).
_ALIGN_TILE_ELEMS = 8192


# Row counts and lengths are not specialized (divisibility by 16, == 1): one compile per BLOCK_M
# and E for every token count, so no new shape compiles inside a serving run.
@triton.jit(do_not_specialize=["n"])
def _align_count_kernel(ids_ptr, counts_ptr, n, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    """counts[pid, e] = how many of rows pid*BLOCK_R .. +BLOCK_R-1 go to expert e."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    ids = tl.load(ids_ptr + rows, mask=rows < n, other=-1)
    experts = tl.arange(0, BLOCK_E)
    hit = (ids[:, None] == experts[None, :]).to(tl.int32)  # [R, E]
    tl.store(counts_ptr + pid * BLOCK_E + experts, tl.sum(hit, axis=0))


@triton.jit(do_not_specialize=["n", "num_progs", "padded_len"])
def _align_plan_kernel(counts_ptr, start_ptr, sorted_ptr, expert_ids_ptr, total_ptr, n,
                       num_progs, padded_len, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_P: tl.constexpr, PAD_J: tl.constexpr, BLOCK_B: tl.constexpr,
                       BLOCK_FILL: tl.constexpr):
    """One program. Turns the count table into each row block's first position per expert
    (exclusive prefix over the row blocks, in place), then: each expert's padded start
    (start_ptr [E_pad]), the used length (total_ptr [1]), the sentinel n at every position that
    no row takes (the end of each expert's last block and everything past the used length) and
    the expert of every BLOCK_M block (-1 past the used length)."""
    experts = tl.arange(0, BLOCK_E)
    progs = tl.arange(0, BLOCK_P)
    count = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, num_progs, BLOCK_P):
        p = p0 + progs
        keep = (p < num_progs)[:, None]
        ptrs = counts_ptr + p[:, None] * BLOCK_E + experts[None, :]
        c = tl.load(ptrs, mask=keep, other=0)
        tl.store(ptrs, tl.cumsum(c, axis=0) - c + count[None, :], mask=keep)
        count += tl.sum(c, axis=0)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)  # inclusive end of each expert's padded run
    start = end - padded
    total = tl.sum(padded, axis=0)
    tl.store(start_ptr + experts, start)
    tl.store(total_ptr, total)
    # Padding inside each expert's last block: positions start + count .. end - 1.
    js = tl.arange(0, PAD_J)
    for j0 in range(0, BLOCK_M, PAD_J):
        pos = (start + count)[:, None] + (j0 + js)[None, :]  # [E, PAD_J]
        tl.store(sorted_ptr + pos, tl.full([BLOCK_E, PAD_J], 0, tl.int32) + n,
                 mask=pos < end[:, None])
    fill = tl.arange(0, BLOCK_FILL)
    for q0 in range(0, padded_len, BLOCK_FILL):
        q = q0 + fill
        tl.store(sorted_ptr + q, tl.full([BLOCK_FILL], 0, tl.int32) + n,
                 mask=(q >= total) & (q < padded_len))
    # Block b belongs to the first expert whose padded run ends after its start (empty experts,
    # whose end equals the previous end, are passed over).
    blocks = tl.arange(0, BLOCK_B)
    num_blocks = padded_len // BLOCK_M
    for b0 in range(0, num_blocks, BLOCK_B):
        b = b0 + blocks
        first = b * BLOCK_M
        owner = tl.sum((end[None, :] <= first[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + b, tl.where(first < total, owner, -1), mask=b < num_blocks)


@triton.jit(do_not_specialize=["n"])
def _align_scatter_kernel(ids_ptr, offsets_ptr, start_ptr, sorted_ptr, n,
                          BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    """sorted[start[e] + offsets[pid, e] + rank] = row for each row of this program's block,
    rank = the rows of expert e before it in the block (so rows keep their order)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    ids = tl.load(ids_ptr + rows, mask=rows < n, other=-1)
    experts = tl.arange(0, BLOCK_E)
    hit = (ids[:, None] == experts[None, :]).to(tl.int32)  # [R, E]
    rank = tl.cumsum(hit, axis=0) - hit
    base = tl.load(offsets_ptr + pid * BLOCK_E + experts) + tl.load(start_ptr + experts)
    dest = tl.sum(hit * (rank + base[None, :]), axis=1)  # [R]
    tl.store(sorted_ptr + dest, rows.to(tl.int32), mask=rows < n)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) rows by expert, padding each expert's run to a multiple of block_m.

    Row r = t*k + j stands for topk_ids[t, j]. Experts appear in increasing order; within an
    expert, rows keep their original order. A counting sort in three triton launches, output
    sizes fixed by the shapes and no host reads, so the call can be captured in a CUDA graph:
    `_align_count_kernel` (per block of rows, how many go to each expert), `_align_plan_kernel`
    (one program: prefix sums over blocks and experts, padding, `expert_ids`, the used length)
    and `_align_scatter_kernel` (each row to its place). It replaces about 20 torch launches
    (the form kept as `reference.moe_align_block_size_ref`, which gives the same tensors).
    Args:
        topk_ids: [T, k] int32/int64 expert ids, each in [0, num_experts) (not checked: an id
            out of range is dropped from the counts and its row's slot is never written).
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
    flat = topk_ids.reshape(-1).contiguous()  # [N], N = T*k
    n = flat.numel()
    padded_len = max_padded_rows(n, num_experts, block_m)
    sorted_token_ids = torch.empty(padded_len, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(padded_len // block_m, dtype=torch.int32, device=dev)
    if n == 0:
        return sorted_token_ids, expert_ids, torch.zeros(1, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)  # written by the plan kernel
    block_e = max(16, triton.next_power_of_2(num_experts))
    block_r = max(16, min(1024, _ALIGN_TILE_ELEMS // block_e))
    num_progs = triton.cdiv(n, block_r)
    counts = torch.empty((num_progs, block_e), dtype=torch.int32, device=dev)
    start = torch.empty(block_e, dtype=torch.int32, device=dev)
    _align_count_kernel[(num_progs,)](flat, counts, n, BLOCK_R=block_r, BLOCK_E=block_e)
    pad_m = triton.next_power_of_2(block_m)
    _align_plan_kernel[(1,)](
        counts, start, sorted_token_ids, expert_ids, total, n, num_progs, padded_len,
        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_P=max(1, _ALIGN_TILE_ELEMS // block_e),
        PAD_J=min(pad_m, max(1, 2048 // block_e)), BLOCK_B=max(1, 4096 // block_e),
        BLOCK_FILL=1024)
    _align_scatter_kernel[(num_progs,)](flat, counts, start, sorted_token_ids, n,
                                        BLOCK_R=block_r, BLOCK_E=block_e)
    return sorted_token_ids, expert_ids, total


@triton.jit
def _tile_dot(a, b, acc, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr,
              FP8_DOT: tl.constexpr):
    # acc + a @ b in fp32. FP8 weights: fp8 x fp8 tensor-core dot (FP8_DOT, GPU), else both
    # tiles upcast to fp32 (the interpreter's form, and fp8 weights with unquantized a).
    if not FP8:
        out = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    elif FP8_DOT:
        out = tl.dot(a, b, acc)
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return out


# Per-call row counts are not specialized (divisibility by 16, == 1): one compiled kernel per
# tile config serves every batch size instead of a JIT compile for each new pattern.
@triton.jit(do_not_specialize=["num_rows", "num_blocks_m"])
def _grouped_gemm_kernel(
    A, B, C, TopkWeights, SortedTokenIds, ExpertIds, NumTokensPostPadded, AScale, BScale, BDesc,
    N, K, num_rows, a_row_div, num_blocks_m, up_offset, group_n, group_k, up_scale_offset,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
    FUSE_SILU_MUL: tl.constexpr, MUL_ROUTING_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr, FP8_DOT: tl.constexpr,
    B_DESC: tl.constexpr,
):
    # QUANT: 0 = a, B in one float dtype; 1 = FP8 B with one scale per expert (BScale[e]) and
    # one activation scale per a row (AScale[a_row * stride_asm]; stride 0: one for all),
    # applied after the K loop; 2 = FP8 B with block scales
    # BScale[e, n // group_n, k // group_k] and per-(row, K group) activation scales
    # AScale[a_row, k // group_k], applied per K step (BLOCK_K divides group_k).
    # B_DESC: weight tiles through BDesc, a descriptor over B [E, N (2N fused), K] with block
    # [1, BLOCK_N, BLOCK_K]; out-of-range elements read as 0, a gate tile's columns past N read
    # up rows, and both are masked at the store like the pointer path's.
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
        # Block scales (QUANT 2): this tile's scale rows, and the activation rows' scales.
        as_ptrs = AScale + a_rows * stride_asm  # [BLOCK_M]
        bs_ptrs = BScale + expert * stride_bse + (offs_n // group_n).to(tl.int64) * stride_bsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if FUSE_SILU_MUL:
            up_ptrs = b_ptrs + up_offset  # up rows follow the N gate rows
            bsu_ptrs = bs_ptrs + up_scale_offset  # and their scale rows the gate's
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        expert32 = expert.to(tl.int32)
        n0 = pid_n * BLOCK_N
        for kb in range(tl.cdiv(K, BLOCK_K)):
            mask_k = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            if B_DESC:
                b = BDesc.load([expert32, n0, kb * BLOCK_K]).reshape(BLOCK_N, BLOCK_K).T
            else:
                b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if QUANT == 2:
                g = (kb * BLOCK_K) // group_k
                a_s = tl.load(as_ptrs + g * stride_ask, mask=mask_m, other=0.0)
                b_s = tl.load(bs_ptrs + g * stride_bsk, mask=mask_n, other=0.0)
                part = _tile_dot(a, b, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32),
                                 DOT_PRECISION, True, FP8_DOT)
                acc += part * a_s[:, None] * b_s[None, :]
            else:
                acc = _tile_dot(a, b, acc, DOT_PRECISION, QUANT == 1, FP8_DOT)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
            if FUSE_SILU_MUL:
                if B_DESC:
                    bu = BDesc.load([expert32, N + n0, kb * BLOCK_K]).reshape(BLOCK_N, BLOCK_K).T
                else:
                    bu = tl.load(up_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
                if QUANT == 2:
                    bu_s = tl.load(bsu_ptrs + g * stride_bsk, mask=mask_n, other=0.0)
                    part_up = _tile_dot(a, bu, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32),
                                        DOT_PRECISION, True, FP8_DOT)
                    acc_up += part_up * a_s[:, None] * bu_s[None, :]
                else:
                    acc_up = _tile_dot(a, bu, acc_up, DOT_PRECISION, QUANT == 1, FP8_DOT)
                up_ptrs += BLOCK_K * stride_bk

        if QUANT == 1:  # one scale for the expert's whole matrix, one per row of A
            a_s = tl.load(as_ptrs, mask=mask_m, other=0.0).to(tl.float32)
            s = a_s[:, None] * tl.load(BScale + expert * stride_bse)
            acc = acc * s
            if FUSE_SILU_MUL:
                acc_up = acc_up * s
        if FUSE_SILU_MUL:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if MUL_ROUTING_WEIGHT:
            w = tl.load(TopkWeights + rows, mask=mask_m, other=0.0).to(tl.float32)
            acc = acc * w[:, None]
        c_ptrs = C + rows[:, None] * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


FP8_DTYPE = torch.float8_e4m3fn


def _fp8_dot_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """fp8 x fp8 tensor-core tl.dot: CUDA, both operands fp8, sm89 or newer."""
    return (a.is_cuda and a.dtype == FP8_DTYPE and b.dtype == FP8_DTYPE
            and torch.cuda.get_device_capability(a.device) >= (8, 9))


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor,
                 sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
                 num_tokens_post_padded: torch.Tensor, num_rows: int, a_row_div: int,
                 config: MoEConfig, fuse_silu_mul: bool = False,
                 topk_weights: torch.Tensor | None = None,
                 a_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                 block_shape: tuple[int, int] | None = None) -> torch.Tensor:
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
        config: tile sizes; with `config.b_desc` the weight tiles load through a tensor
            descriptor (`_weight_descriptor`), or through pointers where none can address w.
        fuse_silu_mul: c = silu(a @ gate^T) * (a @ up^T) instead.
        topk_weights: optional [num_rows] contiguous fp32 routing weights multiplied into row r.
        a_scale, w_scale, block_shape: required with FP8 w (float8_e4m3fn), refused without;
            the real operands are a * a_scale and w * w_scale. Per tensor (block_shape None):
            w_scale [E], a_scale [1] (one for all of a) or [Ta, 1] (one per row of a).
            Blocks (bn, bk), bk a multiple of 16: w_scale
            [E, ceil(N/bn) (x2 with fuse_silu_mul: gate's rows, then up's), ceil(K/bk)],
            a_scale [Ta, ceil(K/bk)]. a: float8_e4m3fn, or a float dtype with scales of 1.
    Returns:
        c. Without FP8, a, w and c share a dtype (float16, bfloat16 or float32); with FP8, c is
        any of those. Accumulation is fp32; scales are applied to the fp32 sums.
    Raises:
        ValueError: shape mismatch, FP8 weights without both scales (or scales for float
            weights), a scale of the wrong shape, or bk not a multiple of 16.
    """
    e, n_w, k = w.shape
    n = n_w // 2 if fuse_silu_mul else n_w
    if a.shape[1] != k or c.shape != (num_rows, n) or (fuse_silu_mul and n_w % 2):
        raise ValueError(f"grouped_gemm: a {tuple(a.shape)}, w {tuple(w.shape)}, "
                         f"c {tuple(c.shape)} do not fit (num_rows {num_rows})")
    quant, group_n, group_k, up_scale_offset = 0, 1, 1, 0
    if w.dtype == FP8_DTYPE:
        if a_scale is None or w_scale is None:
            raise ValueError("grouped_gemm: FP8 weights need a_scale and w_scale")
        a_scale, w_scale = a_scale.float(), w_scale.float()
        if block_shape is None:
            quant = 1
            if tuple(w_scale.shape) != (e,) or tuple(a_scale.shape) not in ((1,),
                                                                          (a.shape[0], 1)):
                raise ValueError(f"grouped_gemm: per-tensor weight scales must be w_scale [{e}] "
                                 f"and a_scale [1] or [{a.shape[0]}, 1], got "
                                 f"{tuple(w_scale.shape)}, {tuple(a_scale.shape)}")
        else:
            quant = 2
            group_n, group_k = int(block_shape[0]), int(block_shape[1])
            if group_n < 1 or group_k < 16 or group_k % 16:
                raise ValueError(f"grouped_gemm: block_shape {block_shape}: bk % 16 != 0")
            nb, kb = triton.cdiv(n, group_n), triton.cdiv(k, group_k)
            want = (e, 2 * nb if fuse_silu_mul else nb, kb)
            if tuple(w_scale.shape) != want or tuple(a_scale.shape) != (a.shape[0], kb):
                raise ValueError(f"grouped_gemm: block scales must be w_scale {want} and "
                                 f"a_scale {(a.shape[0], kb)}, got {tuple(w_scale.shape)}, "
                                 f"{tuple(a_scale.shape)}")
            up_scale_offset = nb * w_scale.stride(1)
            block_k = config.block_k
            while group_k % block_k:  # every K step inside one scale group
                block_k //= 2
            config = config._replace(block_k=max(block_k, 16))
    elif a_scale is not None or w_scale is not None:
        raise ValueError("grouped_gemm: scales given for unquantized weights")
    num_blocks_m = expert_ids.shape[0]
    if num_blocks_m == 0 or n == 0:
        return c
    b_desc = _weight_descriptor(w, config) if config.b_desc else None
    grid = (num_blocks_m * triton.cdiv(n, config.block_n),)
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    weights = topk_weights if topk_weights is not None else c  # unused pointer when not weighted
    if quant:
        a_strides = _a_scale_strides(a_scale, quant)
        w_strides = (w_scale.stride(0),) + ((w_scale.stride(1), w_scale.stride(2))
                                            if quant == 2 else (0, 0))
    else:  # unused pointers
        a_scale = w_scale = c
        a_strides, w_strides = (0, 0), (0, 0, 0)
    _grouped_gemm_kernel[grid](
        a, w, c, weights, sorted_token_ids, expert_ids, num_tokens_post_padded, a_scale, w_scale,
        b_desc if b_desc is not None else w,  # w: an unused pointer
        n, k, num_rows, a_row_div, num_blocks_m, n * w.stride(1), group_n, group_k,
        up_scale_offset,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        c.stride(0), c.stride(1), *a_strides, *w_strides,
        FUSE_SILU_MUL=fuse_silu_mul, MUL_ROUTING_WEIGHT=topk_weights is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, DOT_PRECISION=precision, QUANT=quant,
        FP8_DOT=bool(quant) and _fp8_dot_ok(a, w), B_DESC=b_desc is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return c


def _weight_descriptor(w: torch.Tensor,
                       config: MoEConfig) -> "TensorDescriptor | None":  # noqa: F821
    """A `TensorDescriptor` over w [E, N', K] with block [1, block_n, block_k], or None where
    a descriptor cannot address w (TMA needs a contiguous last dim, 16-byte aligned base and
    strides, and 16 bytes or more per block row) or w is empty. Built per call (the host
    encodes it at each launch; a CUDA graph keeps the encoded copy)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    size = w.element_size()
    if (w.numel() == 0 or w.stride(2) != 1 or (w.data_ptr() % 16)
            or any((st * size) % 16 for st in w.stride()[:2]) or config.block_k * size < 16):
        return None
    return TensorDescriptor(w, list(w.shape), list(w.stride()),
                            [1, config.block_n, config.block_k])


# ------------------------------------------------------------------ GEMV path (small batches)
# Rows (T*k) at or below which `fused_experts` takes the GEMV path. The GEMV path reads an
# expert's weights once per (token, slot) row that uses it (a second row of the same expert finds
# the tiles in L2 only when its programs run at about the same time), the sorted path once per
# expert; but the sorted path pays ~20 launches for the sort (~40 us of GPU time and gaps) and,
# below ~16 rows per expert, tl.dot tiles that are mostly padding. At DeepSeek-V2-Lite shapes
# (E 64, top-6, bf16) the crossover lies between 96 and 144 rows; 96 (T <= 16 at k = 6) keeps
# every batch where GEMV was not slower. With more experts (fewer rows sharing one)
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

    On CUDA, tiles picked by a sweep at V2-Lite shapes (bench_fused_moe.py --gemv-*):
    the first kernel loads 2 x 16 x 256 weights per step (16 KB in bf16), 6 x 88 = 528 programs
    at T=1 (4 per SM); every block_n 8..64 / block_k 128..256 / 2..8 warps was within ~5%. The
    second loads k_pad x down_block_n x 128 with 8 warps and down_block_n = 64 // k_pad (at least
    8): 8 for k 6 or 8 (256 programs at T=1 with H 2048); it is the more sensitive one (4 warps,
    or a 256 step with 4 warps, ran up to 1.8x slower). Other devices (the interpreter): small
    tiles.
    With the two shared experts folded in (batch-size-1 decode) a 512-column first step timed
    faster in isolation (`bench_fused_moe.py --tokens 1 --shared 2 --route kernel --cold`) but
    made the model's bs-1 step slower (not profiled), so 256 stays.
    Args:
        top_k: k. device: where the tensors live.
    Returns:
        a GemvConfig.
    """
    if torch.device(device).type != "cuda":
        return _INTERPRETER_GEMV_CONFIG
    k_pad = triton.next_power_of_2(max(top_k, 1))
    return GemvConfig(down_block_n=max(8, 64 // k_pad))


def _is_pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


def gemv_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                 config: GemvConfig, w13_scale: torch.Tensor | None = None,
                 w2_scale: torch.Tensor | None = None,
                 block_shape: tuple[int, int] | None = None,
                 activation_quant: bool = True, shared_w13: torch.Tensor | None = None,
                 shared_w2: torch.Tensor | None = None,
                 x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
                 shared_w13_scale: torch.Tensor | None = None,
                 shared_w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The GEMV path of `fused_experts` (no sort): two kernel launches and one [T*(k+S), I]
    buffer (with FP8 weights also the quantization of x, unless x_fp8, and of that buffer,
    unless activation_quant is off: per-tensor FP8 then reads both unquantized).

    Shapes as in `fused_experts`, already checked there (any strides; topk_weights any float
    dtype, read as fp32; out [T, H] of x's dtype is written whole). T*k >= 1, H >= 1. FP8
    arguments as in `fused_experts` (block_shape resolved; None = per tensor). shared_w13 /
    shared_w2: S shared experts as extra slots of weight 1 (of x's dtype, or with per-tensor
    FP8 routed weights FP8 with the column scales shared_w13_scale / shared_w2_scale; checked
    there).
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
    fp8 = w13.dtype == FP8_DTYPE
    quant = 0 if not fp8 else (1 if block_shape is None else 2)
    group_n, group_k = block_shape or (1, 1)
    block_k, down_block_k = config.block_k, config.down_block_k
    if quant == 2:  # every K step inside one scale group
        block_k, down_block_k = _pow2_divisor(group_k, block_k), _pow2_divisor(group_k,
                                                                              down_block_k)
    group = group_k if quant == 2 else None
    # per-tensor FP8 without activation quantization: the kernels skip the activation scales
    a_scaled = not (quant == 1 and not activation_quant)
    a1, x_scale = (x, w13_scale) if not a_scaled else _quantize(x, fp8, group,
                                                                activation_quant, x_fp8)
    n_shared = 0 if shared_w13 is None else shared_w13.shape[0] // (2 * inter)
    slots = top_k + n_shared
    h_act = torch.empty((t * slots, inter), dtype=x.dtype, device=x.device)  # [T*(k+S), I]
    s13, xs = _scale_args(w13_scale, x_scale, quant, h_act)
    pdl = use_pdl(x)
    sw13 = w13 if shared_w13 is None else shared_w13  # a dummy pointer when there are none
    sw2 = w2 if shared_w2 is None else shared_w2
    sws13 = shared_w13_scale if shared_w13_scale is not None else s13[0]  # (dummy likewise)
    sws2 = shared_w2_scale if shared_w2_scale is not None else s13[0]
    _gemv_gate_up_kernel[(t * slots, triton.cdiv(inter, config.block_n))](
        a1, w13, h_act, topk_ids, xs[0], s13[0], sw13, sws13,
        h, inter, inter * w13.stride(1), group_n, group_k,
        (triton.cdiv(inter, group_n) * s13[2]) if quant == 2 else 0,
        n_shared * inter * sw13.stride(-2),
        a1.stride(0), a1.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        h_act.stride(0), h_act.stride(1), topk_ids.stride(0), topk_ids.stride(1),
        *xs[1:], *s13[1:], sw13.stride(-2), sw13.stride(-1),
        TOP_K=top_k, N_SHARED=n_shared, BLOCK_N=config.block_n, BLOCK_K=block_k, QUANT=quant,
        A_SCALED=a_scaled, num_warps=config.num_warps, num_stages=config.num_stages,
        **launch_options(pdl),
    )
    a2, a2_scale = (h_act, w2_scale) if not a_scaled else _quantize(h_act, fp8, group,
                                                                    activation_quant)
    s2, as2 = _scale_args(w2_scale, a2_scale, quant, out)
    _gemv_down_kernel[(t, triton.cdiv(h, config.down_block_n))](
        a2, w2, out, topk_weights, topk_ids, as2[0], s2[0], sw2, sws2,
        h, inter, group_n, group_k,
        a2.stride(0), a2.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        out.stride(0), out.stride(1), topk_weights.stride(0), topk_weights.stride(1),
        topk_ids.stride(0), topk_ids.stride(1), *as2[1:], *s2[1:], sw2.stride(-2),
        sw2.stride(-1),
        TOP_K=top_k, N_SHARED=n_shared, K_PAD=triton.next_power_of_2(slots),
        BLOCK_N=config.down_block_n, BLOCK_K=down_block_k, QUANT=quant, A_SCALED=a_scaled,
        num_warps=config.down_num_warps, num_stages=config.num_stages, **launch_options(pdl),
    )
    return out


def _check_shared(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  shared_w13: torch.Tensor | None, shared_w2: torch.Tensor | None,
                  per_tensor_fp8: bool, shared_w13_scale: torch.Tensor | None = None,
                  shared_w2_scale: torch.Tensor | None = None) -> int:
    """S, the number of shared experts of width I in shared_w13 / shared_w2 (0 when None).
    per_tensor_fp8: the routed weights are per-tensor FP8 (then the shared ones are FP8 with
    column scales); else they must be unquantized.
    Raises:
        ValueError: only one given, shapes not [2*S*I, H] / [H, S*I], a dtype other than x's
            (FP8 with per-tensor FP8 routed weights), block-FP8 routed weights, scales missing,
            misshapen or given for 16-bit shared weights."""
    if shared_w13 is None and shared_w2 is None:
        if shared_w13_scale is not None or shared_w2_scale is not None:
            raise ValueError("fused_experts: shared-expert scales without shared experts")
        return 0
    if shared_w13 is None or shared_w2 is None:
        raise ValueError("fused_experts: give both shared_w13 and shared_w2, or neither")
    inter, h = w2.shape[2], x.shape[1]
    n2 = shared_w13.shape[0] if shared_w13.dim() == 2 else -1
    if (shared_w13.dim() != 2 or shared_w2.dim() != 2 or inter == 0 or n2 % (2 * inter)
            or n2 == 0 or shared_w13.shape[1] != h or tuple(shared_w2.shape) != (h, n2 // 2)):
        raise ValueError(f"fused_experts: shared_w13 {tuple(shared_w13.shape)} / shared_w2 "
                         f"{tuple(shared_w2.shape)} must be [2*S*{inter}, {h}] / [{h}, S*{inter}]")
    want = FP8_DTYPE if per_tensor_fp8 else x.dtype
    if (w13.dtype == FP8_DTYPE and not per_tensor_fp8) or shared_w13.dtype != want \
            or shared_w2.dtype != want:
        raise ValueError(f"fused_experts: shared experts need weights of x's dtype {x.dtype} "
                         f"(float8_e4m3fn with per-tensor FP8 routed weights), got "
                         f"{shared_w13.dtype} / {shared_w2.dtype} (routed {w13.dtype})")
    scales = (shared_w13_scale, shared_w2_scale)
    if per_tensor_fp8:
        if any(sc is None or sc.dtype != torch.float32 or not sc.is_contiguous()
               for sc in scales) or shared_w13_scale.numel() != n2 \
                or shared_w2_scale.numel() != h:
            raise ValueError(f"fused_experts: FP8 shared experts need contiguous float32 "
                             f"column scales [{n2}] and [{h}]")
    elif any(sc is not None for sc in scales):
        raise ValueError("fused_experts: shared-expert scales for unquantized shared weights")
    return n2 // (2 * inter)


def _pow2_divisor(group: int, block: int) -> int:
    """The largest power of two <= block that divides group (>= 1)."""
    while block > 1 and group % block:
        block //= 2
    return block


def _scale_args(w_scale: torch.Tensor | None, a_scale: torch.Tensor | None, quant: int,
                dummy: torch.Tensor) -> tuple[tuple, tuple]:
    """(w_scale, its 3 strides), (a_scale, its 2 strides) as kernel arguments; unused slots
    0 and dummy pointers when the weights are not FP8."""
    if not quant:
        return (dummy, 0, 0, 0), (dummy, 0, 0)
    w_scale, a_scale = w_scale.float(), a_scale.float()
    ws = (w_scale, w_scale.stride(0)) + ((w_scale.stride(1), w_scale.stride(2)) if quant == 2
                                         else (0, 0))
    return ws, (a_scale,) + _a_scale_strides(a_scale, quant)


def _a_scale_strides(a_scale: torch.Tensor, quant: int) -> tuple[int, int]:
    """(row stride, group stride) of the activation scales: blocks [Ta, kb] (QUANT 2), per row
    [Ta, 1] or one for all [1] (QUANT 1: row stride 0)."""
    if quant == 2:
        return a_scale.stride(0), a_scale.stride(1)
    return (a_scale.stride(0) if a_scale.dim() == 2 else 0), 0


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def quantize_activations_fp8(x: torch.Tensor, group_size: int | None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic e4m3 quantization of a GEMM's activations, before the GEMM (never inside it: the
    interpreter rounds float -> fp8 wrongly for a few percent of values).

    Args:
        x: [M, K] float.
        group_size: None = one scale per row (token); else per row per group_size columns
            (DeepSeek-V3's per-token-group quantization: `per_token_group_quant_fp8`).
    Returns:
        (q float8_e4m3fn [M, K], scale float32 [M, 1] or [M, ceil(K/group_size)]) with
        q * scale ~ x (saturating: |x / scale| <= 448); per row `fp8_quant.quantize_per_token`
        (scale = max(amax / 448, 1e-12); one launch on CUDA), per group
        `block_fp8_gemm.per_token_group_quant_fp8` (scale = max(amax, 1e-10) / 448). Device ops
        only (no host read).
    """
    if group_size is not None:
        from .block_fp8_gemm import per_token_group_quant_fp8

        return per_token_group_quant_fp8(x, group_size)
    from .fp8_quant import quantize_per_token

    return quantize_per_token(x)


def _quantize(a: torch.Tensor, fp8: bool, group: int | None, activation_quant: bool,
              a_fp8: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A GEMM's activations for the kernels: unchanged without FP8 weights; else quantized
    (`quantize_activations_fp8`; per token: `a_fp8` when given, a already quantized so), or
    unchanged with scales of 1 (activation_quant off)."""
    if not fp8:
        return a, None
    if activation_quant:
        if a_fp8 is not None and group is None:
            from .fp8_quant import check_per_token_pair

            check_per_token_pair(*a_fp8, *a.shape, "fused_experts: x_fp8")
            return a_fp8
        return quantize_activations_fp8(a, group)
    shape = (a.shape[0], 1 if group is None else triton.cdiv(a.shape[1], group))
    return a, torch.ones(shape, dtype=torch.float32, device=a.device)


def _check_fp8_scales(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                      w2_scale: torch.Tensor | None, block_shape: tuple[int, int] | None
                      ) -> tuple[int, int] | None:
    """The block shape of `fused_experts`' FP8 operands (None: per tensor), after checking them.

    Raises:
        ValueError: see `fused_experts`.
    """
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(f"fused_experts: w13 and w2 must both be float8_e4m3fn or both be x's "
                         f"dtype, got {w13.dtype}, {w2.dtype}")
    if w13_scale is None or w2_scale is None:
        raise ValueError("fused_experts: FP8 weights need w13_scale and w2_scale")
    e, two_i, h = w13.shape
    if w13_scale.dim() == 1 and block_shape is None:
        want13 = want2 = (e,)
    else:
        bn, bk = block_shape = tuple(int(v) for v in (block_shape or (128, 128)))
        if bn < 1 or bk < 16 or bk % 16:
            raise ValueError(f"fused_experts: block_shape {block_shape}: bk % 16 != 0")
        nb = triton.cdiv(two_i // 2, bn)
        want13 = (e, 2 * nb, triton.cdiv(h, bk))
        want2 = (e, triton.cdiv(h, bn), triton.cdiv(two_i // 2, bk))
    if tuple(w13_scale.shape) != want13 or tuple(w2_scale.shape) != want2:
        kind = "per-tensor" if block_shape is None else f"block {block_shape}"
        raise ValueError(f"fused_experts: {kind} scales must be w13_scale {want13} and "
                         f"w2_scale {want2}, got {tuple(w13_scale.shape)}, "
                         f"{tuple(w2_scale.shape)}")
    return block_shape


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  out: torch.Tensor | None = None, *, add: torch.Tensor | None = None,
                  config: MoEConfig | None = None, gemv_config: GemvConfig | None = None,
                  path: str = "auto", w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None,
                  block_shape: tuple[int, int] | None = None,
                  activation_quant: bool = True, shared_w13: torch.Tensor | None = None,
                  shared_w2: torch.Tensor | None = None,
                  x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
                  down_config: MoEConfig | None = None,
                  shared_w13_scale: torch.Tensor | None = None,
                  shared_w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), SiLU-gated experts:
    expert_e(v) = w2[e] @ (silu(w13[e, :I] @ v) * (w13[e, I:] @ v)), plus, when shared_w13 /
    shared_w2 are given, the shared experts' SiLU-gated MLP of x[t] (DeepSeek's
    `shared_experts`) computed in the same two launches.

    Same math as `mla_backend.layers.moe.experts_forward`, without host synchronisation. The
    [T*k, I] intermediate is rounded to x's dtype, products accumulate in fp32; the sorted path
    also rounds each slot's weighted output to x's dtype before the sum over k, the GEMV path
    sums the slots in fp32 and rounds once.

    FP8 weights (w13, w2 float8_e4m3fn, W8A8): the real weights are w * scale, in one of two
    forms, and each GEMM's activations (x, then the intermediate after rounding to x's dtype)
    are quantized dynamically (`quantize_activations_fp8`) to match:
    - per expert per tensor: w13_scale, w2_scale [E] float32; one activation scale per row of x
      (resp. of the intermediate), amax / 448 (per-token dynamic activations; vLLM's
      Fp8MoEMethod uses one per tensor);
    - DeepSeek-V3 block scales (`weight_scale_inv`, multiplied): block_shape (bn, bk) (default
      (128, 128)), w13_scale [E, 2*ceil(I/bn), ceil(H/bk)] (gate's block rows, then up's: gate
      and up are blocked separately, as in the checkpoint; = ceil(2I/bn) rows when bn divides
      I), w2_scale [E, ceil(H/bn), ceil(I/bk)]; activations per token per bk columns.
    Any H and I (ragged blocks are masked). Both paths take FP8: the sorted path's tiles are
    fp8 x fp8 tensor-core dots on sm89+ GPUs (else upcast to fp32), the GEMV path upcasts the
    fp8 weights to fp32 as it reads them. Float32 twin: `reference.fused_experts_fp8_ref`.
    Args:
        x: [T, H] float16/bfloat16/float32 (last dim any stride).
        w13: [E, 2I, H], x's dtype or float8_e4m3fn (gate rows then up rows).
        w2: [E, H, I], x's dtype or float8_e4m3fn (as w13).
        topk_weights: [T, k] float (cast to fp32).
        topk_ids: [T, k] int32/int64, each in [0, E) (not checked on the host).
        out: optional [T, H] destination of x's dtype.
        add: optional [T, H] added to the result (DeepSeek's shared experts' output, run by the
            caller): the sorted path adds it in the fp32 sum over k before the one rounding
            (`moe_sum.moe_sum`), the GEMV path to its rounded output.
        config: sorted-path tile sizes (default `get_default_config(T, k, E, x.device, fp8)`).
        down_config: the second (down) GEMM's tiles, block_m equal to config's (default: config
            when config is given, else `get_default_config(..., down=True)`).
        gemv_config: GEMV-path tile sizes (default `get_default_gemv_config(k, x.device)`).
        path: "auto" (GEMV when T*k <= GEMV_MAX_ROWS, see `use_gemv_path`; else sorted),
            "gemv" or "sorted" (forced, for tests and benchmarks). Chosen from shapes only.
        w13_scale, w2_scale, block_shape: the FP8 scales (required with FP8 weights, refused
            without).
        activation_quant: FP8 only; False keeps activations in x's dtype (W8A16, a diagnostic
            that isolates the weight format).
        shared_w13: optional [2*S*I, H] in x's dtype: the gate rows of S shared experts of
            width I (S*I rows, as `GatedMLP.gate_up_proj` holds an intermediate of S*I) and
            then their up rows; shared_w2: [H, S*I] (`down_proj`). The shared MLP splits
            exactly into S experts of width I (SiLU-and-mul is per intermediate unit and the
            down product sums over units), run as S extra slots of weight 1 whose [H] results
            join the routed slots' fp32 sum before the one rounding. GEMV path only (the caller
            picks when it pays: each token row reads the shared weights once). In x's dtype, or,
            with per-tensor FP8 routed weights, float8_e4m3fn with shared_w13_scale [2*S*I] and
            shared_w2_scale [H] (float32, one per output column: `Fp8LinearMethod`'s
            weight_scale_row), the activations quantized as the routed slots' are.
        x_fp8: optional x already quantized per token, (q float8_e4m3fn [T, H], scale
            float32 [T, 1]) = `fp8_quant.quantize_per_token(x)` (e.g. written by the RMSNorm
            that made x): per-tensor FP8 weights then skip quantizing x; ignored otherwise
            (unquantized or block-FP8 weights, activation_quant off).
    Returns:
        out, or a new [T, H] tensor of x's dtype.
    Raises:
        ValueError: shapes or dtypes do not fit together, unknown path, GEMV tiles not powers
            of two, FP8 weights without fitting scales (or scales without FP8 weights), shared
            experts of the wrong shape or dtype, with FP8 weights or off the GEMV path, an
            x_fp8 (when used) not of x's shape, an add not [T, H] of x's dtype, a down_config
            of another block_m.
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
    fp8 = w13.dtype == FP8_DTYPE or w2.dtype == FP8_DTYPE
    if x.dtype not in _DTYPES or (not fp8 and (w13.dtype != x.dtype or w2.dtype != x.dtype)):
        raise ValueError(f"fused_experts: x, w13, w2 must share a float16/bfloat16/float32 "
                         f"dtype (or w13, w2 float8_e4m3fn), got {x.dtype}, {w13.dtype}, "
                         f"{w2.dtype}")
    if fp8:
        block_shape = _check_fp8_scales(w13, w2, w13_scale, w2_scale, block_shape)
    elif w13_scale is not None or w2_scale is not None:
        raise ValueError("fused_experts: scales given for unquantized weights")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_experts: topk_ids must be int32/int64, got {topk_ids.dtype}")
    if out is None:
        out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (t, h) or out.dtype != x.dtype:
        raise ValueError(f"fused_experts: out must be [{t}, {h}] {x.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    top_k = topk_ids.shape[1]
    n_shared = _check_shared(x, w13, w2, shared_w13, shared_w2, fp8 and block_shape is None,
                             shared_w13_scale, shared_w2_scale)
    num_rows = t * top_k
    if add is not None and (tuple(add.shape) != (t, h) or add.dtype != x.dtype):
        raise ValueError(f"fused_experts: add must be [{t}, {h}] {x.dtype}, got "
                         f"{tuple(add.shape)} {add.dtype}")
    if num_rows == 0 or h == 0:
        return out.zero_() if add is None else out.copy_(add)
    if path == "gemv" or (path == "auto" and use_gemv_path(t, top_k + n_shared)):
        gemv_experts(x, w13, w2, topk_weights, topk_ids, out,
                     gemv_config or get_default_gemv_config(top_k + n_shared, x.device),
                     w13_scale, w2_scale, block_shape, activation_quant,
                     shared_w13, shared_w2, x_fp8, shared_w13_scale, shared_w2_scale)
        return out if add is None else out.add_(add)
    if n_shared:
        raise ValueError("fused_experts: shared experts are folded on the GEMV path only "
                         f"(T={t}, k={top_k}, S={n_shared}, path {path!r})")
    cfg = config or get_default_config(t, top_k, e, x.device, fp8=fp8, dtype=w13.dtype)
    cfg2 = down_config or (cfg if config is not None
                           else get_default_config(t, top_k, e, x.device, fp8=fp8, down=True,
                                                   dtype=w13.dtype))
    if cfg2.block_m != cfg.block_m:
        raise ValueError(f"fused_experts: down_config.block_m {cfg2.block_m} != config.block_m "
                         f"{cfg.block_m} (both GEMMs read one sorted row order)")
    group = None if block_shape is None else block_shape[1]
    sorted_ids, expert_ids, used = moe_align_block_size(topk_ids, e, cfg.block_m)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [T*k]
    h_act = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)  # [T*k, I]
    a1, a1_scale = _quantize(x, fp8, group, activation_quant, x_fp8)
    grouped_gemm(a1, w13, h_act, sorted_ids, expert_ids, used, num_rows, top_k, cfg,
                 fuse_silu_mul=True, a_scale=a1_scale, w_scale=w13_scale,
                 block_shape=block_shape)
    y = torch.empty((num_rows, h), dtype=x.dtype, device=x.device)  # [T*k, H]
    a2, a2_scale = _quantize(h_act, fp8, group, activation_quant)
    grouped_gemm(a2, w2, y, sorted_ids, expert_ids, used, num_rows, 1, cfg2,
                 topk_weights=weights, a_scale=a2_scale, w_scale=w2_scale,
                 block_shape=block_shape)
    return moe_sum(y.view(t, top_k, h), out, add)


__all__ = ["FP8_DTYPE", "GEMV_MAX_ROWS", "GemvConfig", "MoEConfig", "fit_shared_memory",
           "fused_experts", "gemv_experts", "get_default_config", "get_default_gemv_config",
           "grouped_gemm", "max_padded_rows", "moe_align_block_size", "moe_tile_smem_bytes",
           "quantize_activations_fp8", "use_gemv_path"]
