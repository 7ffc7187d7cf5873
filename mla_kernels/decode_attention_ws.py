"""Warp-specialized MLA absorbed decode attention for Hopper (sm_90), written in Gluon.

Owns `mla_decode_ws_fwd`, a drop-in for `decode_attention.decode_attention_fwd` restricted to
the MLA absorbed layout, `ws_supported` (whether a call can take it) and `ws_num_kv_splits` (its
split plan). Its float32 twin is `reference.decode_attention_ref` (on the dequantized pool).

Shapes: q [bs, H, 576] bf16 (512 latent + 64 rope columns); k_buffer [S, 1, 576] bf16,
float8_e4m3fn or float8_e5m2 (per-tensor k_scale / v_scale); v = k_buffer[..., :512] (never
passed); o [bs, H, 512]. Any H >= 1 (programs of 16 heads, a partial group zero-padded). Tokens
are read through `req_to_token` one slot at a time.

Flash-decoding: stage 1 here, stage 2 is `decode_merge.merge_splits_kernel`, with the same split
plan as `decode_attention`. A request with one non-empty split writes o directly and the merge
(`SKIP_SINGLE`) leaves it alone. Each program splits its warps as FlashMLA's Hopper kernel does:
producer warps gather KV tiles with cp.async into a shared-memory ring, one consumer warpgroup
runs the wgmmas and the online softmax (see the notes above `_producer` and `_consumer`). An FP8
pool runs every MMA in fp16. `benchmarks/compile_ws_report.py` compiles this for sm_90 without a
GPU. Needs triton >= 3.6 with Gluon; imports torch and triton only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from .decode_merge import FP8_DTYPES, MIN_TOKENS_PER_SPLIT, merge_split_block, merge_splits_kernel

LK, LV, D_MAIN, D_ROPE = 576, 512, 512, 64  # MLA absorbed: 512 latent + 64 rope columns
HEADS_PER_PROG = 16  # wgmma N (query heads of one program; fewer are zero-padded)
# Launch settings (tuning knobs: `benchmarks/bench_decode_ws.py --bufs --load-warps --load-regs
# --maxnreg --per-sm`).
BLOCK_N = 64  # tokens per tile = the wgmma M of q·K (64 per warpgroup)
# Tiles in the shared-memory ring per program: 1 (92 KB, maxnreg 128: two programs per SM) was
# faster than 2 (164 KB, one program per SM) with 4 producer warps.
NUM_BUFS = 1
# Producer warps: the worker partition is given a whole warpgroup's registers anyway, and 4 warps
# spread the gather issue over the 4 schedulers (PTX per tile and warp: 174 instructions with 4
# warps, 609 with 1; `benchmarks/compile_ws_report.py --dump`).
LOAD_WARPS = 4
LOAD_REGS = 64  # registers per producer thread (setmaxnreg of the worker partition; no spills)
# the same for an FP8 pool, whose producer holds a whole tile (36.9 KB, 72 registers per thread
# with 4 warps) in registers while it waits for the buffer: 120 is the least without spills at
# maxnreg 128 (the consumer then has 136; `compile_ws_report.py --pool e4m3 1,4,120,128`)
LOAD_REGS_FP8 = 120
# An FP8 pool's tiles stay FP8 in shared memory, copied by cp.async, and the consumer converts
# them into register operands of its MMAs (`_producer_raw`, `_consumer_reg_a`) instead of the
# producer converting them into fp16 tiles (`_producer_convert`). A 36.9 KB FP8 tile lets each
# program keep NUM_BUFS_REG_A of them in flight at two programs per SM. Its fp16 products equal
# the converting producer's (GPU test); False selects the converting producer
# (`benchmarks/bench_decode_ws.py --reg-a 0 1` times both; figures in docs/benchmarks.md).
FP8_REG_A = True
NUM_BUFS_REG_A = 2
# The register-operand path's MMAs: each 128-column chunk's wgmma left in flight while the next
# chunk is loaded and converted (True), or waited for at once (False).
REG_A_ASYNC = True
# producer registers per thread on that path: its cp.async producer needs few, and the consumer
# gets 2 x 128 - this many (216): the least spill-free value of 32 / 40 / 48 / 56 / 64 for the
# asynchronous MMAs, which spill 56 bytes with 64 (`compile_ws_report.py --reg-a --pool e4m3
# 2,4,40`)
LOAD_REGS_REG_A = 40
# Launch register cap per thread (None: triton's default, 255 = one program per SM). The CTA has
# 8 warps (the consumer warpgroup + the producer warps rounded up to a warpgroup), so two
# programs per SM need <= 128 (the consumer then gets 2 x 128 - LOAD_REGS via setmaxnreg).
MAXNREG: int | None = None


def load_regs_for(pool_dtype: torch.dtype, reg_a: bool | None = None) -> int:
    """Producer registers per thread the launch gives a pool dtype: LOAD_REGS for bf16,
    LOAD_REGS_REG_A for an FP8 pool on the register-operand path (`reg_a`, default FP8_REG_A:
    a cp.async producer), LOAD_REGS_FP8 for an FP8 pool with the converting producer."""
    if pool_dtype == torch.bfloat16:
        return LOAD_REGS
    return LOAD_REGS_REG_A if (FP8_REG_A if reg_a is None else reg_a) else LOAD_REGS_FP8


def default_bufs(pool_dtype: torch.dtype | None = None, reg_a: bool | None = None) -> int:
    """Tiles per program for a pool dtype (None = bf16): NUM_BUFS_REG_A for an FP8 pool on the
    register-operand path, else NUM_BUFS."""
    if pool_dtype in FP8_DTYPES and (FP8_REG_A if reg_a is None else reg_a):
        return NUM_BUFS_REG_A
    return NUM_BUFS


def programs_per_sm(num_bufs: int | None = None, fp8_tiles: bool = False) -> int:
    """Resident programs per SM the split plan aims at. 16-bit tiles (73.7 KB each): 1 with two
    buffers (164 KB of shared memory), 2 with one (92 KB, launched with maxnreg 128). FP8 tiles
    (`fp8_tiles`, the register-operand path; 36.9 KB each): 2 with up to two buffers (92 KB)."""
    nb = NUM_BUFS if num_bufs is None else num_bufs
    if fp8_tiles:
        return 2 if nb <= 2 else 1
    return 2 if nb == 1 else 1


def default_maxnreg(num_bufs: int | None = None, fp8_tiles: bool = False) -> int | None:
    """MAXNREG if set, else 128 when two programs share an SM, else None."""
    if MAXNREG is not None:
        return MAXNREG
    return 128 if programs_per_sm(num_bufs, fp8_tiles) == 2 else None


@gluon.jit
def _split_len(seq_len, n_splits, ALIGN: gl.constexpr):
    """Tokens per split: cdiv(seq_len, n_splits) rounded up to ALIGN (at least ALIGN); the
    same as `decode_merge.split_len`, which the merge kernel uses (written again: a Gluon
    kernel cannot call a triton-language function)."""
    per = (seq_len + n_splits - 1) // n_splits
    per = (per + ALIGN - 1) // ALIGN * ALIGN
    return gl.maximum(per, ALIGN)


@gluon.jit
def _fp16_saturated(x):
    """x rounded to fp16, saturated at +-65504 (NaN stays NaN): `decode_attention.mma_operand`
    for a bf16 q over an FP8 pool (written again: a Gluon kernel cannot call a triton-language
    function)."""
    x = gl.maximum(x.to(gl.float32), -65504.0, propagate_nan=tl.PropagateNan.ALL)
    return gl.minimum(x, 65504.0, propagate_nan=tl.PropagateNan.ALL).to(gl.float16)


# The producer (worker partition, LOAD_WARPS warps) prefetches one tile ahead the slot indices of
# BLOCK_N tokens from req_to_token (int64 before the stride multiply), then gathers the whole
# 1152-byte rows with cp.async (16 bytes per thread and instruction; tokens past the split end
# are masked, i.e. zero-filled without a read) into a ring of NUM_BUFS shared-memory tiles
# (kc [64, 512] and kpe [64, 64], NVMMA 128-byte swizzle). Each tile's `full` mbarrier completes
# when its copies land (`cp.async.mbarrier.arrive.noinc`, one arrival per producer thread); the
# producer waits on the tile's `empty` mbarrier before refilling it. An FP8 pool uses
# `_producer_convert` (the default: fp16 tiles) or `_producer_raw` (`REG_A`: FP8 tiles).
# Shared memory per program: 16-bit tiles NUM_BUFS x 73.7 KB + q 18.4 KB + p^T 2 KB, so 1 buffer
# lets two programs share an SM; FP8 tiles are 36.9 KB, so two of them still do.
@gluon.jit
def _producer(K, r2t, stride_kn, kc_bufs, kpe_bufs, full_bars, empty_bars, start, end, n_tiles,
              BLOCK_N: gl.constexpr, NUM_BUFS: gl.constexpr, LOAD_WARPS: gl.constexpr):
    D_MAIN: gl.constexpr = kc_bufs.type.shape[2]
    D_ROPE: gl.constexpr = kpe_bufs.type.shape[2]
    # [BLOCK_N, 64] pieces: 8 lanes x 8 bf16 = one 128-byte column block of 4 rows per warp
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOAD_WARPS, 1], [1, 0])
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lay))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, lay))
    tok = start + rows
    valid = tok < end
    slot = gl.load(r2t + tok, mask=valid, other=0)
    for t in range(n_tiles):
        idx = t % NUM_BUFS
        phase = (t // NUM_BUFS) & 1
        cur_slot = slot
        cur_valid = valid
        # slot indices of the next tile: in flight while this one waits for its buffer
        tok = tok + BLOCK_N
        valid = tok < end
        slot = gl.load(r2t + tok, mask=valid, other=0)
        mbarrier.wait(empty_bars.index(idx), phase ^ 1)
        row = K + cur_slot.to(gl.int64) * stride_kn  # [BLOCK_N] row pointers (int64 offsets)
        ptrs = gl.expand_dims(row, 1) + gl.expand_dims(cols, 0)
        msk = gl.expand_dims(cur_valid, 1)
        kc = kc_bufs.index(idx)
        for cb in gl.static_range(D_MAIN // 64):
            async_copy.async_copy_global_to_shared(kc.slice(cb * 64, 64, dim=1), ptrs + cb * 64,
                                                   mask=msk)
        for cb in gl.static_range(D_ROPE // 64):
            async_copy.async_copy_global_to_shared(
                kpe_bufs.index(idx).slice(cb * 64, 64, dim=1), ptrs + (D_MAIN + cb * 64),
                mask=msk)
        # completes (one of LOAD_WARPS * 32 arrivals) once this thread's copies have landed
        async_copy.mbarrier_arrive(full_bars.index(idx), increment_count=False)


@gluon.jit
def _producer_convert(K, r2t, stride_kn, kc_bufs, kpe_bufs, full_bars, empty_bars, start, end,
                      n_tiles, BLOCK_N: gl.constexpr, NUM_BUFS: gl.constexpr,
                      LOAD_WARPS: gl.constexpr):
    """The producer for an FP8 pool: gathers a tile's 576-byte rows into registers (16 bytes per
    thread and load) before waiting for its buffer, converts them to fp16 (exact for e4m3 and
    e5m2; the per-tensor scales are applied by the consumer in fp32) and stores them into the
    fp16 tiles of the same shared layout the bf16 pool's cp.async fills."""
    D_MAIN: gl.constexpr = kc_bufs.type.shape[2]
    D_ROPE: gl.constexpr = kpe_bufs.type.shape[2]
    HALF: gl.constexpr = D_MAIN // 2
    # latent part as two [BLOCK_N, 256] halves, 16 bytes per thread and load, 4 lanes per row
    # and 8 rows per warp. Each thread's 16 values become two 16-byte fp16 chunks (2j, 2j + 1
    # of its 128-byte swizzle row), so 16 lanes on one row put two lanes on every 16-byte bank
    # group (2-way conflicts on every shared store, seen in a profile); 4 lanes
    # on each of rows r and r ^ 1 cover the eight bank groups once
    lay_c: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [LOAD_WARPS, 1], [1, 0])
    # rope part [BLOCK_N, 64]: 4 lanes x 16 bytes = a row, 8 rows per warp
    lay_r: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [LOAD_WARPS, 1], [1, 0])
    rows_c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lay_c))
    rows_r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lay_r))
    cols_c = gl.arange(0, HALF, layout=gl.SliceLayout(0, lay_c))
    cols_r = D_MAIN + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, lay_r))
    tok_c = start + rows_c
    tok_r = start + rows_r
    slot_c = gl.load(r2t + tok_c, mask=tok_c < end, other=0)
    slot_r = gl.load(r2t + tok_r, mask=tok_r < end, other=0)
    for t in range(n_tiles):
        idx = t % NUM_BUFS
        phase = (t // NUM_BUFS) & 1
        # this tile's rows (tokens past the split end masked: zero rows, as cp.async's zero
        # fill), loaded before waiting for the buffer; then the next tile's slot indices
        row_c = gl.expand_dims(slot_c.to(gl.int64) * stride_kn, 1)
        msk_c = gl.expand_dims(tok_c < end, 1)
        lo8 = gl.load(K + row_c + gl.expand_dims(cols_c, 0), mask=msk_c, other=0.0)
        hi8 = gl.load(K + row_c + gl.expand_dims(HALF + cols_c, 0), mask=msk_c, other=0.0)
        kpe8 = gl.load(K + gl.expand_dims(slot_r.to(gl.int64) * stride_kn, 1)
                       + gl.expand_dims(cols_r, 0), mask=gl.expand_dims(tok_r < end, 1),
                       other=0.0)
        tok_c = tok_c + BLOCK_N
        tok_r = tok_r + BLOCK_N
        slot_c = gl.load(r2t + tok_c, mask=tok_c < end, other=0)
        slot_r = gl.load(r2t + tok_r, mask=tok_r < end, other=0)
        mbarrier.wait(empty_bars.index(idx), phase ^ 1)
        kc = kc_bufs.index(idx)
        kc.slice(0, HALF, dim=1).store(lo8.to(gl.float16))
        kc.slice(HALF, HALF, dim=1).store(hi8.to(gl.float16))
        kpe_bufs.index(idx).store(kpe8.to(gl.float16))
        fence_async_shared()  # these generic-proxy stores before the consumer's wgmma reads
        mbarrier.arrive(full_bars.index(idx))


@gluon.jit
def _producer_raw(K, r2t, stride_kn, kc_bufs, kpe_bufs, full_bars, empty_bars, start, end,
                  n_tiles, BLOCK_N: gl.constexpr, NUM_BUFS: gl.constexpr,
                  LOAD_WARPS: gl.constexpr):
    """The producer of the register-operand path (`REG_A`, an FP8 pool): cp.async of a tile's
    576-byte rows as stored (16 bytes per thread and copy; tokens past the split end are
    zero-filled without a read) into the FP8 tiles, which the consumer converts on its way to
    the MMAs; the bf16 producer's scheme (`_producer`) for one-byte values."""
    D_MAIN: gl.constexpr = kc_bufs.type.shape[2]
    D_ROPE: gl.constexpr = kpe_bufs.type.shape[2]
    # [BLOCK_N, 128] pieces of the latent part: 8 lanes x 16 bytes = one 128-byte row segment
    lay: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [LOAD_WARPS, 1], [1, 0])
    # the rope part [BLOCK_N, 64]: 4 lanes x 16 bytes per row
    lay_r: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [LOAD_WARPS, 1], [1, 0])
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lay))
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, lay))
    rows_r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lay_r))
    cols_r = D_MAIN + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, lay_r))
    tok = start + rows
    tok_r = start + rows_r
    slot = gl.load(r2t + tok, mask=tok < end, other=0)
    slot_r = gl.load(r2t + tok_r, mask=tok_r < end, other=0)
    for t in range(n_tiles):
        idx = t % NUM_BUFS
        phase = (t // NUM_BUFS) & 1
        cur_slot = slot
        cur_valid = tok < end
        cur_slot_r = slot_r
        cur_valid_r = tok_r < end
        # slot indices of the next tile: in flight while this one waits for its buffer
        tok = tok + BLOCK_N
        tok_r = tok_r + BLOCK_N
        slot = gl.load(r2t + tok, mask=tok < end, other=0)
        slot_r = gl.load(r2t + tok_r, mask=tok_r < end, other=0)
        mbarrier.wait(empty_bars.index(idx), phase ^ 1)
        ptrs = gl.expand_dims(K + cur_slot.to(gl.int64) * stride_kn, 1) + gl.expand_dims(cols, 0)
        msk = gl.expand_dims(cur_valid, 1)
        kc = kc_bufs.index(idx)
        for cb in gl.static_range(D_MAIN // 128):
            async_copy.async_copy_global_to_shared(kc.slice(cb * 128, 128, dim=1),
                                                   ptrs + cb * 128, mask=msk)
        ptrs_r = gl.expand_dims(K + cur_slot_r.to(gl.int64) * stride_kn, 1) \
            + gl.expand_dims(cols_r, 0)
        async_copy.async_copy_global_to_shared(kpe_bufs.index(idx), ptrs_r,
                                               mask=gl.expand_dims(cur_valid_r, 1))
        # completes (one of LOAD_WARPS * 32 arrivals) once this thread's copies have landed
        async_copy.mbarrier_arrive(full_bars.index(idx), increment_count=False)


@gluon.jit
def _load_q(Q, q_base, stride_qh, head0, num_heads, qc_smem, qpe_smem, HB: gl.constexpr):
    """q of this program's heads -> the shared q tiles (zero rows for heads >= num_heads; an
    FP8 pool's fp16 tiles get q rounded and saturated), by the consumer warpgroup while the
    producer already gathers the first tile; ends with a warpgroup barrier."""
    D_MAIN: gl.constexpr = qc_smem.type.shape[1]
    D_ROPE: gl.constexpr = qpe_smem.type.shape[1]
    q_lay: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    heads = head0 + gl.arange(0, HB, layout=gl.SliceLayout(1, q_lay))
    q_row = q_base + heads.to(gl.int64) * stride_qh
    q_mask = gl.expand_dims(heads < num_heads, 1)
    offs_dc = gl.arange(0, D_MAIN, layout=gl.SliceLayout(0, q_lay))
    offs_dp = D_MAIN + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, q_lay))
    qc = gl.load(Q + gl.expand_dims(q_row, 1) + gl.expand_dims(offs_dc, 0), mask=q_mask,
                 other=0.0)
    qpe = gl.load(Q + gl.expand_dims(q_row, 1) + gl.expand_dims(offs_dp, 0), mask=q_mask,
                  other=0.0)
    if qc_smem.dtype == gl.float16:  # the MMA operand type of an FP8 pool (its cheap conversion)
        qc = _fp16_saturated(qc)
        qpe = _fp16_saturated(qpe)
    qc_smem.store(qc)
    qpe_smem.store(qpe)
    fence_async_shared()  # these generic-proxy stores before the wgmma reads (async proxy)
    gl.thread_barrier()  # every consumer thread's part of q before the first wgmma


# The consumer (default partition, one warpgroup) computes transposed products as the triton
# path does (`SWAP_AB`): scores^T [64 tokens, 16 heads] = kc · qc^T + kpe · qpe^T as two async
# wgmmas reading the tile and q^T (in shared memory for the whole program); online softmax over
# the token axis in fp32 (base-2 exponent; the running sum is kept per token row and reduced once
# at the end); p^T stored to shared memory in bf16 (fp16 for an FP8 pool); out^T [512, 16] +=
# V^T · p^T as one async wgmma, V^T a transposed view of the same kc tile. That P·V MMA stays in
# flight across the next tile's wait and q·K issue; the tile is released (`empty`) once its P·V
# has completed. It writes the normalized partial output MidO [bs, H, splits, 512] fp32 and its
# natural-log LSE [bs, H, splits], or o for a one-split request. For an FP8 pool q is rounded to
# fp16, k_scale is folded into the softmax scale and v_scale into the partial output.
@gluon.jit
def _consumer(kc_bufs, kpe_bufs, qc_smem, qpe_smem, p_smem, full_bars, empty_bars,
              MidO, MidLse, start, end, n_tiles, qk_scale, v_scale, mid_base, lse_base, head0,
              num_heads, stride_mh, stride_lh, Q, q_base, stride_qh, O, o_base, stride_oh,
              direct, BLOCK_N: gl.constexpr, NUM_BUFS: gl.constexpr, HB: gl.constexpr):
    D_MAIN: gl.constexpr = kc_bufs.type.shape[2]
    _load_q(Q, q_base, stride_qh, head0, num_heads, qc_smem, qpe_smem, HB)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, HB, 16])
    col_l: gl.constexpr = gl.SliceLayout(0, mma)  # per head
    row_l: gl.constexpr = gl.SliceLayout(1, mma)  # per token / per value column
    qc_t = qc_smem.permute((1, 0))  # [512, HB]
    qpe_t = qpe_smem.permute((1, 0))  # [64, HB]
    offs_n = gl.arange(0, BLOCK_N, layout=row_l)
    m_i = gl.full([HB], float("-inf"), gl.float32, layout=col_l)
    l_rows = gl.zeros([BLOCK_N, HB], gl.float32, layout=mma)  # running sums per token row
    s_init = gl.zeros([BLOCK_N, HB], gl.float32, layout=mma)
    acc = warpgroup_mma_init(gl.zeros([D_MAIN, HB], gl.float32, layout=mma))  # out^T
    for t in range(n_tiles):
        idx = t % NUM_BUFS
        mbarrier.wait(full_bars.index(idx), (t // NUM_BUFS) & 1)
        fence_async_shared()  # the cp.async writes (generic proxy) before wgmma reads (async)
        kc = kc_bufs.index(idx)
        s = warpgroup_mma(kc, qc_t, s_init, use_acc=False, is_async=True)
        s = warpgroup_mma(kpe_bufs.index(idx), qpe_t, s, is_async=True)
        # the previous tile's P·V (issued before these two) has completed: release its buffer
        acc = warpgroup_mma_wait(num_outstanding=2, deps=[acc])
        if NUM_BUFS > 1:
            mbarrier.arrive(empty_bars.index((t + NUM_BUFS - 1) % NUM_BUFS), pred=t > 0)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        s = s * qk_scale
        tok = start + t * BLOCK_N + offs_n
        s = gl.where(gl.expand_dims(tok < end, 1), s, float("-inf"))
        # every tile has >= 1 valid token and padded heads have q = 0: m_new is finite
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 0))
        l_rows = l_rows * gl.expand_dims(alpha, 0) + p
        acc = acc * gl.expand_dims(alpha, 0)
        m_i = m_new
        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()
        acc = warpgroup_mma(kc.permute((1, 0)), p_smem, acc, is_async=True)
        if NUM_BUFS == 1:  # the only buffer: release it now (the producer waits on it)
            acc = warpgroup_mma_init(warpgroup_mma_wait(num_outstanding=0, deps=[acc]))
            mbarrier.arrive(empty_bars.index(0))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    l_i = gl.sum(l_rows, axis=0)
    offs_h = gl.arange(0, HB, layout=col_l)
    heads = head0 + offs_h
    mask_h = heads < num_heads
    offs_dv = gl.arange(0, D_MAIN, layout=row_l)
    out = acc * (v_scale / gl.expand_dims(l_i, 0))
    if direct:  # the request's only split: its normalized output is o (the merge skips it)
        o_ptr = O + o_base + gl.expand_dims(heads.to(gl.int64) * stride_oh, 0) \
            + gl.expand_dims(offs_dv, 1)
        gl.store(o_ptr, out.to(O.dtype.element_ty), mask=gl.expand_dims(mask_h, 0))
    else:
        mid = MidO + mid_base + gl.expand_dims(heads.to(gl.int64) * stride_mh, 0) \
            + gl.expand_dims(offs_dv, 1)
        gl.store(mid, out, mask=gl.expand_dims(mask_h, 0))
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453  # natural log
        gl.store(MidLse + lse_base + heads.to(gl.int64) * stride_lh, lse, mask=mask_h)


@gluon.jit
def _consumer_reg_a(kc_bufs, kpe_bufs, qc_smem, qpe_smem, p_smem, full_bars, empty_bars,
                    MidO, MidLse, start, end, n_tiles, qk_scale, v_scale, mid_base, lse_base,
                    head0, num_heads, stride_mh, stride_lh, Q, q_base, stride_qh, O, o_base,
                    stride_oh, direct, BLOCK_N: gl.constexpr, NUM_BUFS: gl.constexpr,
                    HB: gl.constexpr, ASYNC_MMA: gl.constexpr):
    """The consumer of the register-operand path (`REG_A`, an FP8 pool): the same transposed
    products and online softmax as `_consumer`, but the tile stays FP8 in shared memory. Each
    warpgroup MMA takes its token-side operand from registers: loaded from the FP8 tile in the
    MMA's operand layout, converted to fp16 there (exact), in 128-column chunks (q·K: the
    latent columns, then the rope part; P·V: V^T in four 128-row chunks, each with its own
    [128, HB] accumulator). The tile is released as soon as its last chunk is in registers."""
    D_MAIN: gl.constexpr = kc_bufs.type.shape[2]
    CH: gl.constexpr = 128
    gl.static_assert(D_MAIN == 4 * CH, "four 128-column latent chunks")
    _load_q(Q, q_base, stride_qh, head0, num_heads, qc_smem, qpe_smem, HB)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, HB, 16])
    a_lay: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)  # per head
    row_l: gl.constexpr = gl.SliceLayout(1, mma)  # per token / per value column
    qc_t = qc_smem.permute((1, 0))  # [512, HB]
    qpe_t = qpe_smem.permute((1, 0))  # [64, HB]
    offs_n = gl.arange(0, BLOCK_N, layout=row_l)
    m_i = gl.full([HB], float("-inf"), gl.float32, layout=col_l)
    l_rows = gl.zeros([BLOCK_N, HB], gl.float32, layout=mma)  # running sums per token row
    s_init = gl.zeros([BLOCK_N, HB], gl.float32, layout=mma)
    acc0 = gl.zeros([CH, HB], gl.float32, layout=mma)  # out^T rows 0-127
    acc1 = gl.zeros([CH, HB], gl.float32, layout=mma)
    acc2 = gl.zeros([CH, HB], gl.float32, layout=mma)
    acc3 = gl.zeros([CH, HB], gl.float32, layout=mma)
    for t in range(n_tiles):
        idx = t % NUM_BUFS
        mbarrier.wait(full_bars.index(idx), (t // NUM_BUFS) & 1)
        kc = kc_bufs.index(idx)
        if ASYNC_MMA:
            # each chunk's MMA runs while the next chunk is loaded and converted; a wait keeps
            # the registers of the chunk before it alive until its MMA has read them
            a0 = kc.slice(0, CH, dim=1).load(a_lay).to(gl.float16)
            s = warpgroup_mma(a0, qc_t.slice(0, CH, dim=0), s_init, use_acc=False,
                              is_async=True)
            a1 = kc.slice(CH, CH, dim=1).load(a_lay).to(gl.float16)
            s = warpgroup_mma(a1, qc_t.slice(CH, CH, dim=0), s, is_async=True)
            s, a0 = warpgroup_mma_wait(num_outstanding=1, deps=[s, a0])
            a2 = kc.slice(2 * CH, CH, dim=1).load(a_lay).to(gl.float16)
            s = warpgroup_mma(a2, qc_t.slice(2 * CH, CH, dim=0), s, is_async=True)
            s, a1 = warpgroup_mma_wait(num_outstanding=1, deps=[s, a1])
            a3 = kc.slice(3 * CH, CH, dim=1).load(a_lay).to(gl.float16)
            s = warpgroup_mma(a3, qc_t.slice(3 * CH, CH, dim=0), s, is_async=True)
            s, a2 = warpgroup_mma_wait(num_outstanding=1, deps=[s, a2])
            a4 = kpe_bufs.index(idx).load(a_lay).to(gl.float16)
            s = warpgroup_mma(a4, qpe_t, s, is_async=True)
            s, a3, a4 = warpgroup_mma_wait(num_outstanding=0, deps=[s, a3, a4])
        else:
            a = kc.slice(0, CH, dim=1).load(a_lay).to(gl.float16)
            s = warpgroup_mma(a, qc_t.slice(0, CH, dim=0), s_init, use_acc=False)
            a = kc.slice(CH, CH, dim=1).load(a_lay).to(gl.float16)
            s = warpgroup_mma(a, qc_t.slice(CH, CH, dim=0), s)
            a = kc.slice(2 * CH, CH, dim=1).load(a_lay).to(gl.float16)
            s = warpgroup_mma(a, qc_t.slice(2 * CH, CH, dim=0), s)
            a = kc.slice(3 * CH, CH, dim=1).load(a_lay).to(gl.float16)
            s = warpgroup_mma(a, qc_t.slice(3 * CH, CH, dim=0), s)
            a = kpe_bufs.index(idx).load(a_lay).to(gl.float16)
            s = warpgroup_mma(a, qpe_t, s)
        s = s * qk_scale
        tok = start + t * BLOCK_N + offs_n
        s = gl.where(gl.expand_dims(tok < end, 1), s, float("-inf"))
        # every tile has >= 1 valid token and padded heads have q = 0: m_new is finite
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 0))
        l_rows = l_rows * gl.expand_dims(alpha, 0) + p
        m_i = m_new
        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()
        gl.thread_barrier()  # every consumer thread's part of p before the MMAs read it
        alpha_b = gl.expand_dims(alpha, 0)
        vt = kc.permute((1, 0))  # [512, BLOCK_N]: V^T
        if ASYNC_MMA:
            a0 = vt.slice(0, CH, dim=0).load(a_lay).to(gl.float16)
            acc0 = warpgroup_mma(a0, p_smem, acc0 * alpha_b, is_async=True)
            a1 = vt.slice(CH, CH, dim=0).load(a_lay).to(gl.float16)
            acc1 = warpgroup_mma(a1, p_smem, acc1 * alpha_b, is_async=True)
            acc0, a0 = warpgroup_mma_wait(num_outstanding=1, deps=[acc0, a0])
            a2 = vt.slice(2 * CH, CH, dim=0).load(a_lay).to(gl.float16)
            acc2 = warpgroup_mma(a2, p_smem, acc2 * alpha_b, is_async=True)
            acc1, a1 = warpgroup_mma_wait(num_outstanding=1, deps=[acc1, a1])
            a3 = vt.slice(3 * CH, CH, dim=0).load(a_lay).to(gl.float16)
            mbarrier.arrive(empty_bars.index(idx))  # the whole tile is in registers now
            acc3 = warpgroup_mma(a3, p_smem, acc3 * alpha_b, is_async=True)
            acc2, acc3, a2, a3 = warpgroup_mma_wait(num_outstanding=0,
                                                    deps=[acc2, acc3, a2, a3])
        else:
            a = vt.slice(0, CH, dim=0).load(a_lay).to(gl.float16)
            acc0 = warpgroup_mma(a, p_smem, acc0 * alpha_b)
            a = vt.slice(CH, CH, dim=0).load(a_lay).to(gl.float16)
            acc1 = warpgroup_mma(a, p_smem, acc1 * alpha_b)
            a = vt.slice(2 * CH, CH, dim=0).load(a_lay).to(gl.float16)
            acc2 = warpgroup_mma(a, p_smem, acc2 * alpha_b)
            a = vt.slice(3 * CH, CH, dim=0).load(a_lay).to(gl.float16)
            mbarrier.arrive(empty_bars.index(idx))  # the whole tile is in registers now
            acc3 = warpgroup_mma(a, p_smem, acc3 * alpha_b)
        gl.thread_barrier()  # every thread's P·V read of p before the next tile's p store
    l_i = gl.sum(l_rows, axis=0)
    offs_h = gl.arange(0, HB, layout=col_l)
    heads = head0 + offs_h
    mask_h = gl.expand_dims(heads < num_heads, 0)
    offs_dv = gl.arange(0, CH, layout=row_l)
    scale = gl.expand_dims(v_scale / l_i, 0)
    if direct:  # the request's only split: its normalized output is o (the merge skips it)
        o_ptr = O + o_base + gl.expand_dims(heads.to(gl.int64) * stride_oh, 0) \
            + gl.expand_dims(offs_dv, 1)
        gl.store(o_ptr, (acc0 * scale).to(O.dtype.element_ty), mask=mask_h)
        gl.store(o_ptr + CH, (acc1 * scale).to(O.dtype.element_ty), mask=mask_h)
        gl.store(o_ptr + 2 * CH, (acc2 * scale).to(O.dtype.element_ty), mask=mask_h)
        gl.store(o_ptr + 3 * CH, (acc3 * scale).to(O.dtype.element_ty), mask=mask_h)
    else:
        mid = MidO + mid_base + gl.expand_dims(heads.to(gl.int64) * stride_mh, 0) \
            + gl.expand_dims(offs_dv, 1)
        gl.store(mid, acc0 * scale, mask=mask_h)
        gl.store(mid + CH, acc1 * scale, mask=mask_h)
        gl.store(mid + 2 * CH, acc2 * scale, mask=mask_h)
        gl.store(mid + 3 * CH, acc3 * scale, mask=mask_h)
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453  # natural log
        gl.store(MidLse + lse_base + heads.to(gl.int64) * stride_lh, lse,
                 mask=heads < num_heads)


@gluon.jit
def _mla_decode_ws_kernel(
    Q, K, ReqToToken, ReqPoolIdx, SeqLens, NumKvSplits, MidO, MidLse, O,
    qk_scale, v_scale, num_heads,
    stride_qb, stride_qh, stride_kn, stride_r2t,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ls, stride_ob, stride_oh,
    MAX_KV_SPLITS: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUFS: gl.constexpr,
    LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr, HB: gl.constexpr,
    D_MAIN: gl.constexpr, D_ROPE: gl.constexpr, REG_A: gl.constexpr = False,
    ASYNC_MMA: gl.constexpr = False,
):
    KV_FP8: gl.constexpr = K.dtype.element_ty.is_fp8()  # fp16 MMAs
    # an FP8 pool: the tile stays FP8 in shared memory (cp.async) and the consumer converts it
    # into register operands (REG_A), or the producer converts it into fp16 tiles
    RAW: gl.constexpr = KV_FP8 and REG_A
    gl.static_assert(BLOCK_N == 64, "wgmma M: 64 tokens per consumer warpgroup")
    gl.static_assert(D_MAIN % 64 == 0 and D_ROPE % 64 == 0, "64-column blocks")
    b = gl.program_id(0)
    split = gl.program_id(1)
    head0 = gl.program_id(2) * HB
    seq_len = gl.load(SeqLens + b).to(gl.int32)
    n_splits = gl.minimum(gl.maximum(gl.load(NumKvSplits + b), 1), MAX_KV_SPLITS)
    per = _split_len(seq_len, n_splits, BLOCK_N)
    start = split * per
    end = gl.minimum(start + per, seq_len)
    if (split < n_splits) & (start < end):
        n_tiles = (end - start + BLOCK_N - 1) // BLOCK_N
        # a split that holds the whole request is its only non-empty one (the merge's n_valid
        # is 1 exactly then): it writes o itself
        direct = per >= seq_len
        # the MMA operand type: fp16 for an FP8 pool (its cheap conversion), else bf16
        MMA_DT: gl.constexpr = gl.float16 if KV_FP8 else gl.bfloat16
        sw128: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                   rank=2)
        # q's tiles, filled by the consumer (`_load_q`) so that the producer's first gather
        # does not wait for q's load
        qc_smem = gl.allocate_shared_memory(MMA_DT, [HB, D_MAIN], sw128)
        qpe_smem = gl.allocate_shared_memory(MMA_DT, [HB, D_ROPE], sw128)
        p_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HB], MMA_DT)
        p_smem = gl.allocate_shared_memory(MMA_DT, [BLOCK_N, HB], p_lay)
        if RAW:
            sw8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8,
                                                     rank=2)
            sw8r: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8,
                                                      rank=2)
            kc_bufs = gl.allocate_shared_memory(K.dtype.element_ty, [NUM_BUFS, BLOCK_N, D_MAIN],
                                                sw8)
            kpe_bufs = gl.allocate_shared_memory(K.dtype.element_ty, [NUM_BUFS, BLOCK_N, D_ROPE],
                                                 sw8r)
        else:
            kc_bufs = gl.allocate_shared_memory(MMA_DT, [NUM_BUFS, BLOCK_N, D_MAIN], sw128)
            kpe_bufs = gl.allocate_shared_memory(MMA_DT, [NUM_BUFS, BLOCK_N, D_ROPE], sw128)
        full_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUFS, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUFS, 1],
                                               mbarrier.MBarrierLayout())
        # cp.async: one arrival per producer thread; converting producer: one per tile
        full_count: gl.constexpr = 1 if (KV_FP8 and not RAW) else LOAD_WARPS * 32
        for i in gl.static_range(NUM_BUFS):
            mbarrier.init(full_bars.index(i), count=full_count)
            mbarrier.init(empty_bars.index(i), count=1)
        fence_async_shared()  # the barrier inits before either partition uses them

        req_row = gl.load(ReqPoolIdx + b).to(gl.int64)
        r2t = ReqToToken + req_row * stride_r2t
        mid_base = b.to(gl.int64) * stride_mb + split.to(gl.int64) * stride_ms
        lse_base = b.to(gl.int64) * stride_lb + split.to(gl.int64) * stride_ls
        if RAW:
            gl.warp_specialize([
                (_consumer_reg_a, (kc_bufs, kpe_bufs, qc_smem, qpe_smem, p_smem, full_bars,
                                   empty_bars, MidO, MidLse, start, end, n_tiles, qk_scale,
                                   v_scale, mid_base, lse_base, head0, num_heads, stride_mh,
                                   stride_lh, Q, b.to(gl.int64) * stride_qb, stride_qh, O,
                                   b.to(gl.int64) * stride_ob, stride_oh, direct, BLOCK_N,
                                   NUM_BUFS, HB, ASYNC_MMA)),
                (_producer_raw,
                 (K, r2t, stride_kn, kc_bufs, kpe_bufs, full_bars, empty_bars, start, end,
                  n_tiles, BLOCK_N, NUM_BUFS, LOAD_WARPS)),
            ], [LOAD_WARPS], [LOAD_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (kc_bufs, kpe_bufs, qc_smem, qpe_smem, p_smem, full_bars, empty_bars,
                             MidO, MidLse, start, end, n_tiles, qk_scale, v_scale, mid_base,
                             lse_base, head0, num_heads, stride_mh, stride_lh, Q,
                             b.to(gl.int64) * stride_qb, stride_qh, O,
                             b.to(gl.int64) * stride_ob, stride_oh, direct, BLOCK_N, NUM_BUFS,
                             HB)),
                (_producer_convert if KV_FP8 else _producer,
                 (K, r2t, stride_kn, kc_bufs, kpe_bufs, full_bars, empty_bars, start, end,
                  n_tiles, BLOCK_N, NUM_BUFS, LOAD_WARPS)),
            ], [LOAD_WARPS], [LOAD_REGS])


POOL_DTYPES = (torch.bfloat16, *FP8_DTYPES)


def ws_supported(q: torch.Tensor, k_buffer: torch.Tensor) -> bool:
    """Whether `mla_decode_ws_fwd` can run this call: CUDA tensors on an sm_90 device, bf16 q, a
    bf16 or FP8 (e4m3 / e5m2) pool, q [bs, H, 576], k_buffer [S, 1, 576], last dims
    contiguous."""
    if not (q.is_cuda and k_buffer.is_cuda and q.device == k_buffer.device):
        return False
    if q.dtype != torch.bfloat16 or k_buffer.dtype not in POOL_DTYPES:
        return False
    if q.dim() != 3 or k_buffer.dim() != 3 or q.shape[-1] != LK or k_buffer.shape[1:] != (1, LK):
        return False
    if q.stride(-1) != 1 or k_buffer.stride(-1) != 1:
        return False
    return torch.cuda.get_device_capability(q.device) == (9, 0)


def ws_splits_per_request(bs: int, device_sm_count: int, per_sm: int | None = None) -> int:
    """Most KV splits the ws plan gives a request: max(1, (per_sm x SMs) // bs), per_sm =
    `programs_per_sm()` by default: rounded down so that uniform batches fill whole waves of
    resident programs (as `decode_attention`'s wide plan). Host int, shapes only."""
    pps = programs_per_sm() if per_sm is None else per_sm
    return max(1, pps * device_sm_count // max(bs, 1))


def ws_num_kv_splits(seq_lens: torch.Tensor, max_kv_splits: int, device_sm_count: int,
                     per_sm: int | None = None) -> torch.Tensor:
    """[bs] int32 splits on seq_lens' device (no host sync): clamp(min(ws_splits_per_request,
    cdiv(seq_len, MIN_TOKENS_PER_SPLIT)), 1, max_kv_splits)."""
    per_req = min(max_kv_splits,
                  ws_splits_per_request(seq_lens.shape[0], device_sm_count, per_sm))
    m = MIN_TOKENS_PER_SPLIT
    by_len = torch.div(seq_lens.to(torch.int64) + (m - 1), m, rounding_mode="floor")
    return by_len.clamp(1, max(per_req, 1)).to(torch.int32)


def mla_decode_ws_fwd(q: torch.Tensor, k_buffer: torch.Tensor, o: torch.Tensor,
                      req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                      seq_lens: torch.Tensor, num_kv_splits: torch.Tensor, max_kv_splits: int,
                      attn_logits: torch.Tensor, attn_lse: torch.Tensor, sm_scale: float,
                      k_scale: float = 1.0, v_scale: float = 1.0,
                      *, block_n: int | None = None, num_bufs: int | None = None,
                      load_warps: int | None = None, load_regs: int | None = None,
                      maxnreg: int | None = None, reg_a: bool | None = None,
                      async_mma: bool | None = None) -> None:
    """MLA absorbed decode attention (v = k_buffer[..., :512]); writes `o`.

    Same semantics as `decode_attention_fwd(q, k_buffer, k_buffer[..., :512], o, ...)`:
    seq_len 0 rows give zeros, splits are clamped to [1, max_kv_splits],
    empty splits are neither computed nor merged, no host synchronisation (graph-capturable).
    Unlike it, a request with a single non-empty split writes o directly and leaves its
    attn_logits / attn_lse rows unwritten.
    Args:
        q: [bs, H, 576] bf16 (strides along bs and H free, last dim contiguous); any H >= 1.
        k_buffer: [S, 1, 576] bf16 or FP8 (float8_e4m3fn / float8_e5m2) pool (last dim
            contiguous); value = its first 512 columns. An FP8 pool's tiles are converted to
            fp16 by the producer (`_producer_convert`) instead of copied, and q is rounded to
            fp16 (saturated at +-65504) for the fp16 MMAs.
        o: [bs, H, 512] output (any float dtype, last dim contiguous).
        req_to_token, req_pool_indices, seq_lens, num_kv_splits, max_kv_splits, attn_logits,
        attn_lse, sm_scale: as for `decode_attention_fwd`.
        k_scale, v_scale: per-tensor dequantization scales of an FP8 pool (key = stored ·
            k_scale, value = stored · v_scale), applied in fp32: k_scale folded into the
            softmax scale, v_scale into the normalized partial output; 1.0 for a bf16 pool.
        block_n, num_bufs, load_warps, load_regs, maxnreg: launch overrides (default: the
            module settings BLOCK_N, `default_bufs`, LOAD_WARPS, `load_regs_for`,
            `default_maxnreg`).
        reg_a: for an FP8 pool, the register-operand path (FP8 tiles in shared memory, the
            consumer converting; default FP8_REG_A) or the converting producer (False).
            Ignored for a bf16 pool.
        async_mma: the register-operand path's chunk MMAs in flight across the next chunk's
            loads (default REG_A_ASYNC) or waited for at once.
    Raises:
        ValueError: not the MLA layout with a bf16 q and a bf16 / FP8 pool, not on an sm_90
            CUDA device, inconsistent shapes, workspaces too small / not fp32, or an FP8 pool
            with fewer than 4 producer warps (its producer holds a tile in registers).
    """
    if not ws_supported(q, k_buffer):
        raise ValueError(f"mla_decode_ws_fwd: needs bf16 q [bs, H, {LK}] and a bf16 or FP8 "
                         f"pool [S, 1, {LK}] "
                         f"with contiguous last dims on an sm_90 device; got q "
                         f"{tuple(q.shape)} {q.dtype}, k {tuple(k_buffer.shape)} "
                         f"{k_buffer.dtype} on {q.device}")
    bs, num_heads, _ = q.shape
    if tuple(o.shape) != (bs, num_heads, LV) or o.stride(-1) != 1:
        raise ValueError(f"mla_decode_ws_fwd: o {tuple(o.shape)} (want {(bs, num_heads, LV)}, "
                         f"contiguous last dim)")
    if req_to_token.stride(-1) != 1 or req_to_token.dtype != torch.int32:
        raise ValueError("mla_decode_ws_fwd: req_to_token must be int32 with a contiguous row")
    if max_kv_splits < 1 or (attn_logits.dtype != torch.float32
                             or attn_lse.dtype != torch.float32
                             or attn_logits.shape[0] < bs or attn_logits.shape[1] != num_heads
                             or attn_logits.shape[2] < max_kv_splits
                             or attn_logits.shape[3] < LV or attn_logits.stride(-1) != 1
                             or attn_lse.shape[0] < bs or attn_lse.shape[1] != num_heads
                             or attn_lse.shape[2] < max_kv_splits):
        raise ValueError(f"mla_decode_ws_fwd: workspaces {tuple(attn_logits.shape)} "
                         f"{attn_logits.dtype}, {tuple(attn_lse.shape)} {attn_lse.dtype} too "
                         f"small for bs {bs}, H {num_heads}, splits {max_kv_splits}")
    bn = BLOCK_N if block_n is None else block_n
    if bn != 64:
        raise ValueError(f"mla_decode_ws_fwd: block_n must be 64 (wgmma M), got {bn}")
    fp8 = k_buffer.dtype != torch.bfloat16
    raw = fp8 and (FP8_REG_A if reg_a is None else reg_a)
    nb = default_bufs(k_buffer.dtype, raw) if num_bufs is None else num_bufs
    if nb < 1:
        raise ValueError(f"mla_decode_ws_fwd: num_bufs must be >= 1, got {nb}")
    lw = LOAD_WARPS if load_warps is None else load_warps
    if fp8 and not raw and lw < 4:
        raise ValueError(f"mla_decode_ws_fwd: an FP8 pool needs >= 4 producer warps (a 64-row "
                         f"tile held in registers), got {lw}")
    if bs == 0:
        return
    groups = triton.cdiv(num_heads, HEADS_PER_PROG)
    opts = {}
    mnr = maxnreg if maxnreg is not None else default_maxnreg(nb, raw)
    if mnr is not None:
        opts["maxnreg"] = mnr
    _mla_decode_ws_kernel[(bs, max_kv_splits, groups)](
        q, k_buffer, req_to_token, req_pool_indices, seq_lens, num_kv_splits,
        attn_logits, attn_lse, o, sm_scale * k_scale * 1.4426950408889634, v_scale, num_heads,
        q.stride(0), q.stride(1), k_buffer.stride(0), req_to_token.stride(0),
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse.stride(0), attn_lse.stride(1), attn_lse.stride(2), o.stride(0), o.stride(1),
        MAX_KV_SPLITS=max_kv_splits, BLOCK_N=bn,
        NUM_BUFS=nb,
        LOAD_WARPS=lw,
        LOAD_REGS=load_regs_for(k_buffer.dtype, raw) if load_regs is None else load_regs,
        HB=HEADS_PER_PROG, D_MAIN=D_MAIN, D_ROPE=D_ROPE, REG_A=raw,
        ASYNC_MMA=raw and (REG_A_ASYNC if async_mma is None else async_mma), num_warps=4, **opts,
    )
    merge_splits_kernel[(bs, num_heads)](
        attn_logits, attn_lse, o, seq_lens, num_kv_splits,
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse.stride(0), attn_lse.stride(1), attn_lse.stride(2), o.stride(0), o.stride(1),
        Lv=LV, MAX_KV_SPLITS=max_kv_splits, BLOCK_DV=LV, SPLIT_ALIGN=bn,
        SPLIT_BLOCK=merge_split_block(max_kv_splits), SKIP_SINGLE=True, num_warps=4,
        num_stages=2,
    )
