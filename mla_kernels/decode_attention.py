"""Flash-decoding attention over the paged token-slot pool (one query token per request).

Owns the decode attention op of the Triton attention backend: `get_num_kv_splits` (the on-device
split-count heuristic) and `decode_attention_fwd` (two triton kernels), as in SGLang's Triton
backend after PR #2394. Its float32 twin is `reference.decode_attention_ref`.

- Stage 1, grid (bs, head programs, max_kv_splits): a head program owns up to BLOCK_H (>= 16,
  padded) query heads that read the same KV head, so every K/V tile it gathers serves all of
  them. Each request's sequence is cut into `num_kv_splits[b]` BLOCK_N-aligned ranges; a
  program walks its range through `req_to_token` (int64 before any stride multiply), keeps an
  online softmax in fp32 and writes the normalized partial output and its natural-log LSE to
  fp32 workspaces. Empty splits read nothing.
- Wide heads (MLA's 576) in a 16-bit pool at up to SWAP_AB_MAX_BS requests take the transposed
  path (`SWAP_AB`): scores^T = K · q^T, so tokens are the MMA's M dimension and heads its N.
- Stage 2, grid (bs, H), merges the splits by their LSE into `o`; a seq_len-0 row gets zeros.

Lk that is a sum of two powers of two (576 = 512 + 64) runs as two `tl.dot` parts, else it is
padded with masks; v may be a strided view of k (MLA). FP8 pools (per-tensor k_scale / v_scale)
convert tiles to fp16 on load (exact); k_scale folds into the softmax scale, v_scale into the
partial output. MLA at bs >= WS_MLA_MIN_BS on sm_90 goes to `decode_attention_ws`. Both kernels
use programmatic dependent launch (`pdl.py`). No host sync: the op can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_merge import (
    FP8_DTYPES,
    MIN_TOKENS_PER_SPLIT,
    merge_split_block,
    merge_splits_kernel,
    split_len,
)
from .pdl import launch_options, pdl_enter, use_pdl

# The FP8 pool dtypes, as a knob of this module (benchmarks/bench_decode_attention.py's
# `fp8wide` rebinds it to give FP8 pools the wide plan).
_FP8_DTYPES = FP8_DTYPES

# `get_num_kv_splits` aims at this many stage-1 programs per SM (rounding the splits up).
PROGRAMS_PER_SM = 4
# Wide (MLA 576) heads in a 16-bit pool (`wide_plan`): two programs fit on an SM at once (shared
# memory), so the plan aims at exactly that many and rounds the splits *down*: a whole number of
# resident waves (bs 64 on 132 SMs: 4 splits = 256 programs, one wave, instead of 9 = 576, 2.2
# waves).
WIDE_PROGRAMS_PER_SM = 2
# Stage-1 launch settings (SGLang's flash-decoding values; tune on the target GPU).
STAGE1_NUM_WARPS = 4
STAGE1_NUM_STAGES = 2
# Wide (MLA 576) tiles, untransposed path: 3 stages, V gathered separately (a reused K tile is
# not pipelined on that path): the best of a sweep.
STAGE1_NUM_STAGES_WIDE = 3
REUSE_K_TILE_AS_V = False
# Wide tiles, transposed path (`SWAP_AB`: tokens as the MMA's M dimension, the 16 heads as N; the
# P·V product runs as a warpgroup MMA reading V^T straight from the shared K tile, so the K tile
# is always reused as V there). With indirect (req_to_token) loads triton's pipeliner gives the K
# tile floor((stages - 1) / 2) buffers: 5 stages = two 32-token buffers (91.5 KB, two programs
# per SM; `benchmarks/compile_report.py`). Used for batches of up to SWAP_AB_MAX_BS requests,
# where it beats the untransposed path; at larger batches the untransposed path is faster.
SWAP_AB_WIDE = True
SWAP_AB_MAX_BS = 64
STAGE1_NUM_STAGES_SWAP = 5
# Batches of at most SMALL_BS_MAX requests on the transposed path in a 16-bit pool take
# 64-token tiles with SMALL_BS_NUM_STAGES stages (`small_batch_tiles`; two 64-token K buffers,
# 164.5 KB of shared memory in bf16, one program per SM): fewer, longer tile steps where each
# program walks only a few tiles and the op is latency-bound (faster up to bs 4, slower at
# bs 8). fp32 pools keep BLOCK_N_WIDE (their 64-token buffers would not fit).
SMALL_BS_MAX = 4
SMALL_BS_BLOCK_N_WIDE = 64
SMALL_BS_NUM_STAGES = 4
SMALL_BS_DTYPES = (torch.bfloat16, torch.float16)
# MLA (bf16 q, one latent KV head, 576 / 512, a bf16 or FP8 pool with v a view of k) at batches
# of at least this many requests on sm_90 runs the warp-specialized Gluon kernel
# (`decode_attention_ws`) instead, faster there for both pool dtypes (docs/benchmarks.md, "MLA
# decode attention kernel: share of the copy bandwidth"); smaller batches were not measured.
# None turns it off.
WS_MLA_MIN_BS: int | None = 16
# Largest number of fp32 accumulator elements (BLOCK_H x BLOCK_DV) a stage-1 program keeps.
_MAX_ACC_ELEMS = 8192


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _split_head_dim(lk: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_DPE) for a QK head dim: the main power-of-two part and the optional second
    part (0 when absent). Lk = BLOCK_D + BLOCK_DPE exactly when a split exists; otherwise BLOCK_D =
    next_pow2(Lk) and the tail is masked."""
    if lk <= 16:
        return 16, 0
    if _is_pow2(lk):
        return lk, 0
    main = 1 << (lk.bit_length() - 1)
    rest = lk - main
    if _is_pow2(rest) and rest >= 16:
        return main, rest
    return triton.next_power_of_2(lk), 0


def heads_per_program(num_q_heads: int, num_kv_heads: int, v_head_dim: int) -> int:
    """How many query heads one stage-1 program owns (all share one KV head).

    The whole group (num_q_heads // num_kv_heads) when its fp32 accumulator [BLOCK_H, Lv] fits the
    register budget, else a fraction of it (e.g. 16 heads per program for MLA's Lv = 512).
    Raises:
        ValueError: num_q_heads is not a positive multiple of num_kv_heads.
    """
    if num_kv_heads < 1 or num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"query heads {num_q_heads} not a multiple of kv heads {num_kv_heads}")
    group = num_q_heads // num_kv_heads
    cap = max(16, min(64, _MAX_ACC_ELEMS // triton.next_power_of_2(v_head_dim)))
    return min(group, cap)


def num_head_programs(num_q_heads: int, num_kv_heads: int, v_head_dim: int) -> int:
    """Number of stage-1 head programs per (request, split): the `num_head_groups` argument of
    `get_num_kv_splits` (equals num_kv_heads unless a group is larger than one program)."""
    hpp = heads_per_program(num_q_heads, num_kv_heads, v_head_dim)
    group = num_q_heads // num_kv_heads
    return num_kv_heads * triton.cdiv(group, hpp)


BLOCK_N_WIDE = 32  # KV tokens per tile when the QK head dim is > 256 (MLA 576)
BLOCK_N_NARROW = 64  # KV tokens per tile otherwise


def small_batch_tiles(bs: int, lk: int, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether decode of a `bs`-request batch over a pool of QK head dim `lk` and dtype
    `kv_dtype` (None = 16-bit) takes the small-batch tiles (SMALL_BS_BLOCK_N_WIDE tokens,
    SMALL_BS_NUM_STAGES stages): the transposed path, at most SMALL_BS_MAX requests, a pool
    dtype in SMALL_BS_DTYPES (bf16, fp16)."""
    return (bs <= SMALL_BS_MAX and (kv_dtype is None or kv_dtype in SMALL_BS_DTYPES)
            and transposed_path(bs, lk, kv_dtype))


def block_n_for(lk: int, bs: int | None = None, kv_dtype: torch.dtype | None = None) -> int:
    """KV tokens per stage-1 tile for a QK head dim Lk; splits are aligned to this many tokens.
    With `bs` (and the pool dtype, None = 16-bit): the tile `decode_attention_fwd` uses for a
    batch of bs requests (SMALL_BS_BLOCK_N_WIDE under `small_batch_tiles`)."""
    d, dpe = _split_head_dim(lk)
    if d + dpe <= 256:
        return BLOCK_N_NARROW
    if bs is not None and small_batch_tiles(bs, lk, kv_dtype):
        return SMALL_BS_BLOCK_N_WIDE
    return BLOCK_N_WIDE


def wide_plan(head_dim: int, kv_dtype: torch.dtype | None = None, bs: int | None = None) -> bool:
    """Whether decode over a pool of this QK head dim and dtype uses the wide split plan: heads
    wider than 256 (MLA's 576) in a 16-bit pool, and MLA's 576 in an FP8 pool at batches of
    `bs` >= WS_MLA_MIN_BS, which the warp-specialized kernel decodes on sm_90 (two programs per
    SM, as the 16-bit pool's). Below that (and with `bs` None) FP8 pools keep the narrow plan and
    the untransposed path of the triton kernel, which converts tiles in registers (faster there
    than the wide plan). The plan is shape-only: on a GPU other than sm_90, or with a q that is
    not bf16 (an fp16 model), an FP8 pool at bs >= WS_MLA_MIN_BS gets the wide plan with the
    triton kernel (slower there, as above, but correct)."""
    if head_dim <= 256:
        return False
    if kv_dtype not in _FP8_DTYPES:
        return True
    return head_dim == 576 and bs is not None and ws_batch(bs)


def ws_batch(bs: int) -> bool:
    """Whether a `bs`-request MLA decode is large enough for the warp-specialized kernel
    (WS_MLA_MIN_BS; None: never): the dispatch of `decode_attention_fwd` and the plan of
    `wide_plan` both ask this."""
    return WS_MLA_MIN_BS is not None and bs >= WS_MLA_MIN_BS


def transposed_path(bs: int, head_dim: int, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether decode of a `bs`-request batch takes the transposed (SWAP_AB) path."""
    return SWAP_AB_WIDE and bs <= SWAP_AB_MAX_BS and wide_plan(head_dim, kv_dtype)


def splits_per_request(bs: int, num_head_groups: int, device_sm_count: int,
                       head_dim: int = 0, kv_dtype: torch.dtype | None = None) -> int:
    """Most KV splits the plan gives a request of a `bs`-request batch (host int, >= 1).

    Narrow plan: cdiv(PROGRAMS_PER_SM * SMs, bs * groups). Wide plan (`wide_plan`: MLA's 576 in a
    16-bit pool): max(1, (WIDE_PROGRAMS_PER_SM * SMs) // (bs * groups)), rounded down so that
    uniform batches fill whole waves of resident programs. Shapes only: safe in CUDA graphs.
    Args:
        bs: requests in the batch; num_head_groups: stage-1 head programs per request;
        device_sm_count: streaming multiprocessors; head_dim: the pool's QK head dim (0 = narrow);
        kv_dtype: the pool's dtype (None = 16-bit).
    """
    rows = max(bs, 1) * max(num_head_groups, 1)
    if wide_plan(head_dim, kv_dtype, bs):
        return max(1, WIDE_PROGRAMS_PER_SM * device_sm_count // rows)
    return max(1, triton.cdiv(PROGRAMS_PER_SM * device_sm_count, rows))


def get_num_kv_splits(seq_lens: torch.Tensor, num_head_groups: int, max_kv_splits: int,
                      device_sm_count: int, out: torch.Tensor | None = None,
                      head_dim: int = 0, kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """KV splits per request, computed on seq_lens' device with no host synchronisation.

    splits[b] = clamp(min(splits_per_request(bs, num_head_groups, device_sm_count, head_dim,
                                             kv_dtype),
                          cdiv(seq_lens[b], MIN_TOKENS_PER_SPLIT)), 1, max_kv_splits):
    small batches at long context get many splits (to fill the GPU), short sequences few.
    Args:
        seq_lens: [bs] int32/int64, tokens per request (0 allowed for padded rows).
        num_head_groups: stage-1 head programs per request (`num_head_programs`; the number of
            KV heads is a fine approximation).
        max_kv_splits: upper bound (>= 1), the workspace's split dimension.
        device_sm_count: streaming multiprocessors of the device (any positive number on CPU).
        out: optional preallocated [bs] int32 result (for CUDA-graph-static buffers).
        head_dim, kv_dtype: the pool's QK head dim and dtype (`wide_plan`; 0 / None = narrow /
            16-bit).
    Returns:
        [bs] int32 on seq_lens' device, values in [1, max_kv_splits].
    Raises:
        ValueError: max_kv_splits, num_head_groups or device_sm_count < 1.
    """
    if max_kv_splits < 1 or num_head_groups < 1 or device_sm_count < 1:
        raise ValueError(f"get_num_kv_splits: need max_kv_splits, num_head_groups, "
                         f"device_sm_count >= 1, got {max_kv_splits}, {num_head_groups}, "
                         f"{device_sm_count}")
    bs = seq_lens.shape[0]
    per_req = min(max_kv_splits,
                  splits_per_request(bs, num_head_groups, device_sm_count, head_dim, kv_dtype))
    by_len = torch.div(seq_lens.to(torch.int64) + (MIN_TOKENS_PER_SPLIT - 1),
                       MIN_TOKENS_PER_SPLIT, rounding_mode="floor")
    res = by_len.clamp(1, per_req).to(torch.int32)
    if out is None:
        return res
    out.copy_(res)
    return out


@triton.jit
def mma_operand(q, POOL_FP8: tl.constexpr):
    """q as the operand of its products with a pool's tiles, which are converted to q's dtype: a
    bf16 q becomes fp16 (saturated at +-65504) when the pool is FP8 (POOL_FP8), because FP8 ->
    fp16 is one packed conversion per pair of values on NVIDIA GPUs and FP8 -> bf16 a second,
    scalar one per value on top of it (sm_90 PTX: cvt.rn.f16x2.e4m3x2, then cvt.bf16.f16);
    bf16's 8-bit mantissa fits fp16's 10 bits, so only values outside fp16's normal range
    change (NaN stays NaN). Any other q (fp16, fp32, or a 16-bit pool) is returned as is."""
    if POOL_FP8:
        if q.dtype == tl.bfloat16:
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0,
                         propagate_nan=tl.PropagateNan.ALL).to(tl.float16)
    return q


@triton.jit
def _decode_split_kernel(
    Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, NumKvSplits, MidO, MidLse,
    sm_scale, v_scale,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_r2t,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ls,
    Lk: tl.constexpr, Lv: tl.constexpr, GROUP: tl.constexpr, HEADS_PER_PROG: tl.constexpr,
    BLOCKS_PER_KV: tl.constexpr, MAX_KV_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr,
    V_IS_K_PREFIX: tl.constexpr, SWAP_AB: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)  # before any load: q, the slot map and the pool come from earlier kernels
    b = tl.program_id(0)
    hp = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(SeqLens + b).to(tl.int32)
    n_splits = tl.minimum(tl.maximum(tl.load(NumKvSplits + b), 1), MAX_KV_SPLITS)
    per = split_len(seq_len, n_splits, BLOCK_N)
    start = split * per
    end = tl.minimum(start + per, seq_len)
    if (split < n_splits) & (start < end):
        kv_head = hp // BLOCKS_PER_KV
        offs_h = tl.arange(0, BLOCK_H)
        local = (hp % BLOCKS_PER_KV) * HEADS_PER_PROG + offs_h
        mask_h = (offs_h < HEADS_PER_PROG) & (local < GROUP)
        cur_head = kv_head * GROUP + local

        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < Lk
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_dv = offs_dv < Lv
        q_row = b.to(tl.int64) * stride_qb + cur_head.to(tl.int64) * stride_qh  # [BLOCK_H]
        req_row = tl.load(ReqPoolIdx + b).to(tl.int64)
        r2t = ReqToToken + req_row * stride_r2t
        kv_head_k = kv_head.to(tl.int64) * stride_kh
        kv_head_v = kv_head.to(tl.int64) * stride_vh
        qk_scale = sm_scale * 1.4426950408889634  # base-2 exponent domain
        mid_row = (b.to(tl.int64) * stride_mb + cur_head.to(tl.int64) * stride_mh
                   + split.to(tl.int64) * stride_ms)
        lse_row = (b.to(tl.int64) * stride_lb + cur_head.to(tl.int64) * stride_lh
                   + split.to(tl.int64) * stride_ls)
        if BLOCK_DPE > 0:
            offs_dpe = BLOCK_D + tl.arange(0, BLOCK_DPE)
            mask_dpe = offs_dpe < Lk
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        if SWAP_AB:
            # Transposed products: scores^T [BLOCK_N, BLOCK_H] = K · q^T and
            # out^T [BLOCK_DV, BLOCK_H] = V^T · p^T, so the token tile is the M dimension (>= 64
            # lets Hopper use warpgroup MMAs with K/V straight from shared memory) and the 16
            # query heads are N.
            qt = tl.load(Q + q_row[None, :] + offs_d[:, None],
                         mask=mask_h[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_H]
            qt = mma_operand(qt, K.dtype.element_ty.is_fp8())
            if BLOCK_DPE > 0:
                qpet = tl.load(Q + q_row[None, :] + offs_dpe[:, None],
                               mask=mask_h[None, :] & mask_dpe[:, None], other=0.0)
                qpet = mma_operand(qpet, K.dtype.element_ty.is_fp8())
            acc_t = tl.zeros([BLOCK_DV, BLOCK_H], dtype=tl.float32)
            for start_n in range(start, end, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                mask_n = offs_n < end
                slot = tl.load(r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
                k_off = slot[:, None] * stride_kn + kv_head_k  # [BLOCK_N, 1]
                k = tl.load(K + k_off + offs_d[None, :],
                            mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [N, BLOCK_D]
                qk = tl.dot(k.to(qt.dtype), qt, input_precision=DOT_PRECISION)  # [N, BLOCK_H]
                if BLOCK_DPE > 0:
                    kpe = tl.load(K + k_off + offs_dpe[None, :],
                                  mask=mask_n[:, None] & mask_dpe[None, :], other=0.0)
                    qk += tl.dot(kpe.to(qpet.dtype), qpet, input_precision=DOT_PRECISION)
                qk = qk * qk_scale
                qk = tl.where(mask_n[:, None], qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 0))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(qk - m_new[None, :])  # [N, BLOCK_H]
                l_i = l_i * alpha + tl.sum(p, 0)
                if V_IS_K_PREFIX:
                    v_t = tl.trans(k)  # [BLOCK_DV = BLOCK_D, N]: the same tile, read transposed
                else:
                    v_t = tl.load(V + (slot[None, :] * stride_vn + kv_head_v) + offs_dv[:, None],
                                  mask=mask_n[None, :] & mask_dv[:, None], other=0.0)
                acc_t = acc_t * alpha[None, :] + tl.dot(v_t.to(qt.dtype), p.to(qt.dtype),
                                                        input_precision=DOT_PRECISION)
                m_i = m_new
            tl.store(MidO + mid_row[None, :] + offs_dv[:, None], acc_t / l_i[None, :] * v_scale,
                     mask=mask_h[None, :] & mask_dv[:, None])
        else:
            q = tl.load(Q + q_row[:, None] + offs_d[None, :],
                        mask=mask_h[:, None] & mask_d[None, :], other=0.0)
            q = mma_operand(q, K.dtype.element_ty.is_fp8())
            if BLOCK_DPE > 0:
                qpe = tl.load(Q + q_row[:, None] + offs_dpe[None, :],
                              mask=mask_h[:, None] & mask_dpe[None, :], other=0.0)
                qpe = mma_operand(qpe, K.dtype.element_ty.is_fp8())
            acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
            for start_n in range(start, end, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                mask_n = offs_n < end
                slot = tl.load(r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
                k_off = slot[None, :] * stride_kn + kv_head_k  # [1, BLOCK_N]
                k = tl.load(K + k_off + offs_d[:, None],
                            mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
                k = k.to(q.dtype)  # an FP8 tile is converted once, also for its V use below
                qk = tl.dot(q, k, input_precision=DOT_PRECISION)
                if BLOCK_DPE > 0:
                    kpe = tl.load(K + k_off + offs_dpe[:, None],
                                  mask=mask_n[None, :] & mask_dpe[:, None], other=0.0)
                    qk += tl.dot(qpe, kpe.to(qpe.dtype), input_precision=DOT_PRECISION)
                qk = qk * qk_scale
                # Every tile has >= 1 valid column, so row maxima stay finite (padded head rows have
                # q = 0, hence finite scores too).
                qk = tl.where(mask_n[None, :], qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(qk - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                if V_IS_K_PREFIX:
                    v = tl.trans(k)  # MLA: the value rows are the first Lv = BLOCK_D key columns
                else:
                    v = tl.load(V + (slot[:, None] * stride_vn + kv_head_v) + offs_dv[None, :],
                                mask=mask_n[:, None] & mask_dv[None, :], other=0.0)  # [N, DV]
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                                    input_precision=DOT_PRECISION)
                m_i = m_new
            tl.store(MidO + mid_row[:, None] + offs_dv[None, :], acc / l_i[:, None] * v_scale,
                     mask=mask_h[:, None] & mask_dv[None, :])
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # natural log
        tl.store(MidLse + lse_row, lse, mask=mask_h)


def decode_attention_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         o: torch.Tensor, req_to_token: torch.Tensor,
                         req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                         num_kv_splits: torch.Tensor, max_kv_splits: int,
                         attn_logits: torch.Tensor, attn_lse: torch.Tensor,
                         sm_scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Decode attention of one query token per request over its cached tokens; writes `o`.

    Args:
        q: [bs, H, Lk] queries (any float dtype; strides along bs and H are free, Lk contiguous).
        k_buffer: [S, Hkv, Lk] key pool (slot-major); Lk contiguous.
        v_buffer: [S, Hkv, Lv] value pool; may be a strided view of k_buffer (MLA absorbed:
            Hkv = 1, Lk = 576, Lv = 512, v_buffer = k_buffer[..., :512]); Lv contiguous.
            K/V are cast to q's dtype before the dot products; fp8 pools (float8_e4m3fn /
            float8_e5m2) hold value / scale.
        o: [bs, H, Lv] output, written in o's dtype (Lv contiguous).
        req_to_token: [R, C] int32, slot of token j of the request in row r (row-contiguous).
        req_pool_indices: [bs] int32/int64, row of each request.
        seq_lens: [bs] int32/int64, tokens to attend over (includes the query token, whose KV is
            already in the pool); 0 for padded rows, whose output is zeros.
        num_kv_splits: [bs] int32 from `get_num_kv_splits` (clamped to [1, max_kv_splits]).
        max_kv_splits: the split dimension of the workspaces (grid size; host int).
        attn_logits: [bs, H, max_kv_splits, Lv] fp32 workspace (partial outputs).
        attn_lse: [bs, H, max_kv_splits] fp32 workspace (partial log-sum-exps, natural log).
        sm_scale: softmax scale applied to q·k.
        k_scale, v_scale: per-tensor dequantization scales of an FP8 pool (key = stored ·
            k_scale, value = stored · v_scale); 1.0 for other pools.
    Raises:
        ValueError: inconsistent shapes, H not a multiple of Hkv, a non-contiguous last dim, or
            workspaces too small / not fp32.
    """
    bs, num_heads, lk = q.shape
    _, num_kv_heads, lk_k = k_buffer.shape
    lv = v_buffer.shape[-1]
    if lk_k != lk or v_buffer.shape[1] != num_kv_heads or tuple(o.shape) != (bs, num_heads, lv):
        raise ValueError(f"decode_attention_fwd: shapes q {tuple(q.shape)}, k "
                         f"{tuple(k_buffer.shape)}, v {tuple(v_buffer.shape)}, o {tuple(o.shape)}")
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("o", o),
                    ("req_to_token", req_to_token)):
        if t.stride(-1) != 1:
            raise ValueError(f"decode_attention_fwd: {name} needs a contiguous last dim")
    if (attn_logits.dtype != torch.float32 or attn_lse.dtype != torch.float32
            or attn_logits.shape[0] < bs or attn_logits.shape[1] != num_heads
            or attn_logits.shape[2] < max_kv_splits or attn_logits.shape[3] < lv
            or attn_lse.shape[0] < bs or attn_lse.shape[1] != num_heads
            or attn_lse.shape[2] < max_kv_splits or attn_logits.stride(-1) != 1):
        raise ValueError(f"decode_attention_fwd: workspaces {tuple(attn_logits.shape)} "
                         f"{attn_logits.dtype}, {tuple(attn_lse.shape)} {attn_lse.dtype} too small "
                         f"for bs {bs}, H {num_heads}, splits {max_kv_splits}, Lv {lv}")
    if bs == 0:
        return
    if (ws_batch(bs) and num_kv_heads == 1 and lv == 512
            and v_buffer.data_ptr() == k_buffer.data_ptr()
            and v_buffer.stride()[:2] == k_buffer.stride()[:2]):
        # imported on first use: it needs triton's Gluon (>= 3.6), which no other path here does
        from .decode_attention_ws import mla_decode_ws_fwd, ws_supported

        if ws_supported(q, k_buffer):
            mla_decode_ws_fwd(q, k_buffer, o, req_to_token, req_pool_indices, seq_lens,
                              num_kv_splits, max_kv_splits, attn_logits, attn_lse, sm_scale,
                              k_scale, v_scale)
            return
    hpp = heads_per_program(num_heads, num_kv_heads, lv)
    group = num_heads // num_kv_heads
    blocks_per_kv = triton.cdiv(group, hpp)
    block_d, block_dpe = _split_head_dim(lk)
    block_dv = max(16, triton.next_power_of_2(lv))
    wide = block_d + block_dpe > 256
    swap = transposed_path(bs, lk, k_buffer.dtype)
    # MLA: v_buffer is k_buffer[..., :Lv] and the first key part is exactly Lv wide, so the loaded
    # K tile doubles as the V tile (no second gather of the same bytes).
    v_is_k_prefix = ((swap or REUSE_K_TILE_AS_V) and v_buffer.data_ptr() == k_buffer.data_ptr()
                     and v_buffer.stride()[:2] == k_buffer.stride()[:2]
                     and v_buffer.dtype == k_buffer.dtype and lv == block_d and lv < lk)
    small = small_batch_tiles(bs, lk, k_buffer.dtype)
    block_n = block_n_for(lk, bs, k_buffer.dtype)
    block_h = max(16, triton.next_power_of_2(hpp))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"

    grid = (bs, num_kv_heads * blocks_per_kv, max_kv_splits)
    pdl = use_pdl(q)
    _decode_split_kernel[grid](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, num_kv_splits,
        attn_logits, attn_lse, sm_scale * k_scale, v_scale,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse.stride(0), attn_lse.stride(1), attn_lse.stride(2),
        Lk=lk, Lv=lv, GROUP=group, HEADS_PER_PROG=hpp, BLOCKS_PER_KV=blocks_per_kv,
        MAX_KV_SPLITS=max_kv_splits, BLOCK_D=block_d, BLOCK_DPE=block_dpe, BLOCK_DV=block_dv,
        BLOCK_N=block_n, BLOCK_H=block_h, DOT_PRECISION=precision, V_IS_K_PREFIX=v_is_k_prefix,
        SWAP_AB=swap, num_warps=STAGE1_NUM_WARPS,
        num_stages=(SMALL_BS_NUM_STAGES if small else STAGE1_NUM_STAGES_SWAP if swap
                    else STAGE1_NUM_STAGES_WIDE if wide else STAGE1_NUM_STAGES),
        **launch_options(pdl),
    )
    merge_splits_kernel[(bs, num_heads)](
        attn_logits, attn_lse, o, seq_lens, num_kv_splits,
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse.stride(0), attn_lse.stride(1), attn_lse.stride(2), o.stride(0), o.stride(1),
        Lv=lv, MAX_KV_SPLITS=max_kv_splits, BLOCK_DV=block_dv, SPLIT_ALIGN=block_n,
        SPLIT_BLOCK=merge_split_block(max_kv_splits),
        num_warps=4 if block_dv >= 256 else 2, num_stages=2, **launch_options(pdl),
    )
