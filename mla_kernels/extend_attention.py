"""Extend (prefill) attention: new tokens over their cached prefix plus the causal new part.

Owns `extend_attention_fwd`, its triton kernel and the block-size choice. Layout (page size 1,
SGLang-style): request i has `prefix_lens[i]` cached tokens at `req_to_token[req_pool_indices[i],
:prefix_len]` and `extend_lens[i]` new tokens at rows `extend_start_loc[i]` onward of the packed
`q_extend` / `k_extend` / `v_extend`. Grid (bs, H, cdiv(max_extend_len, BLOCK_M)):
- phase 1: the cached prefix in BLOCK_N tiles gathered through `req_to_token` (length mask only);
- phase 2: the new tokens' own k/v, tiles below the diagonal unmasked, diagonal tiles causal.
One online softmax (base 2, fp32 max / sum / accumulator) spans both phases. Non-power-of-two
head dims split into a power-of-two part plus a masked tail (576 = 512 + 64, 192 = 128 + 64);
the V width is padded to a power of two and masked. Covers MHA, GQA, MQA, MLA decompressed
prefill (qk 192 / v 128, no prefix) and MLA absorbed extend (qk 576, v = first 512 columns).

FP8 pools (float8_e4m3fn / float8_e5m2, per-tensor `k_scale` / `v_scale`) are read in phase 1
only, converted to q's dtype on load (bf16 q rounded to fp16, `decode_attention.mma_operand`);
k_scale is folded into the softmax scale, v_scale into P·V. Phase 2's k/v are unquantized.
Pool offsets are 64-bit (slot × stride may exceed 2^31). No host sync: lengths are read on the
device, only `max_extend_len` comes from the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention import _FP8_DTYPES, mma_operand


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation; IEEE (fp32 inputs) forbids TF32 rounding."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_tile(acc, l_i, m_i, q, q_pe, k_ptrs, kpe_ptrs, v_ptrs, k_mask, kpe_mask, v_mask,
                 score_mask, qk_scale, v_scale, HAS_PE: tl.constexpr, USE_MASK: tl.constexpr,
                 IEEE_DOT: tl.constexpr, SCALE_V: tl.constexpr):
    """One BLOCK_N key tile of the online softmax. Returns updated (acc, l_i, m_i).

    q: [BLOCK_M, BLOCK_D]; k tile [BLOCK_D, BLOCK_N]; v tile [BLOCK_N, BLOCK_DV];
    score_mask: [BLOCK_M, BLOCK_N] bool, used only when USE_MASK. qk_scale includes the key's
    dequantization scale; SCALE_V: multiply this tile's P·V by v_scale (FP8 pool tiles).
    """
    k = tl.load(k_ptrs, mask=k_mask, other=0.0).to(q.dtype)
    qk = _dot(q, k, IEEE_DOT)
    if HAS_PE:
        k_pe = tl.load(kpe_ptrs, mask=kpe_mask, other=0.0).to(q.dtype)
        qk += _dot(q_pe, k_pe, IEEE_DOT)
    qk = qk * qk_scale  # log2 domain
    if USE_MASK:
        qk = tl.where(score_mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=v_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None]
    if SCALE_V:
        acc += _dot(p.to(q.dtype), v, IEEE_DOT) * v_scale
    else:
        acc += _dot(p.to(q.dtype), v, IEEE_DOT)
    return acc, l_i, m_new


@triton.jit
def _extend_attention_kernel(
    Q, K_ext, V_ext, O, K_buf, V_buf, Req_to_token, Req_pool_indices, Prefix_lens, Extend_lens,
    Extend_start_loc, qk_scale, prefix_qk_scale, prefix_v_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_req,
    KV_GROUP: tl.constexpr, LQ: tl.constexpr, LV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_PE: tl.constexpr,
    HAS_PREFIX: tl.constexpr, IEEE_DOT: tl.constexpr, SCALE_PREFIX_V: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    block_m = tl.program_id(2)
    kv_head = head // KV_GROUP

    extend_len = tl.load(Extend_lens + req).to(tl.int32)
    m_start = block_m * BLOCK_M
    if m_start >= extend_len:
        return
    ext_start = tl.load(Extend_start_loc + req).to(tl.int64)

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dpe = BLOCK_D + tl.arange(0, BLOCK_DPE)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < extend_len
    mask_d = offs_d < LQ
    mask_dpe = offs_dpe < LQ
    mask_dv = offs_dv < LV

    # queries: [BLOCK_M, BLOCK_D] (+ [BLOCK_M, BLOCK_DPE])
    q_rows = (ext_start + offs_m.to(tl.int64)) * stride_qt + head * stride_qh
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :],
                other=0.0)
    q_pe = q  # placeholder when there is no tail part
    if HAS_PE:
        q_pe = tl.load(Q + q_rows[:, None] + offs_dpe[None, :],
                       mask=mask_m[:, None] & mask_dpe[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # ---- phase 1: cached prefix, gathered through req_to_token; length mask only ----
    if HAS_PREFIX:
        prefix_len = tl.load(Prefix_lens + req).to(tl.int32)
        row = tl.load(Req_pool_indices + req).to(tl.int64)
        r2t = Req_to_token + row * stride_req
        # the products with an FP8 pool's tiles run in fp16 (`mma_operand`); the new tokens'
        # own K/V (phase 2) keep q's dtype
        q_pool = mma_operand(q, K_buf.dtype.element_ty.is_fp8())
        qpe_pool = mma_operand(q_pe, K_buf.dtype.element_ty.is_fp8())
        for start_n in range(0, prefix_len, BLOCK_N):
            cur_n = start_n + offs_n
            mask_n = cur_n < prefix_len
            slot = tl.load(r2t + cur_n, mask=mask_n, other=0).to(tl.int64)
            k_base = K_buf + slot * stride_kbs + kv_head * stride_kbh
            v_base = V_buf + slot * stride_vbs + kv_head * stride_vbh
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q_pool, qpe_pool,
                k_base[None, :] + offs_d[:, None], k_base[None, :] + offs_dpe[:, None],
                v_base[:, None] + offs_dv[None, :],
                mask_n[None, :] & mask_d[:, None], mask_n[None, :] & mask_dpe[:, None],
                mask_n[:, None] & mask_dv[None, :], mask_n[None, :], prefix_qk_scale,
                prefix_v_scale, HAS_PE, True, IEEE_DOT, SCALE_PREFIX_V)

    # ---- phase 2: the new tokens themselves (causal) ----
    # keys strictly before this query block are visible to every row: no score mask
    full_end = (m_start // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        cur_n = (start_n + offs_n).to(tl.int64)
        k_base = K_ext + (ext_start + cur_n) * stride_kt + kv_head * stride_kh
        v_base = V_ext + (ext_start + cur_n) * stride_vt + kv_head * stride_vh
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pe,
            k_base[None, :] + offs_d[:, None], k_base[None, :] + offs_dpe[:, None],
            v_base[:, None] + offs_dv[None, :],
            mask_d[:, None], mask_dpe[:, None], mask_dv[None, :], mask_m[:, None], qk_scale,
            1.0, HAS_PE, False, IEEE_DOT, False)
    # diagonal tiles: causal mask and length mask
    diag_end = tl.minimum(m_start + BLOCK_M, extend_len)
    for start_n in range(full_end, diag_end, BLOCK_N):
        cur_n = start_n + offs_n
        mask_n = cur_n < extend_len
        k_base = K_ext + (ext_start + cur_n.to(tl.int64)) * stride_kt + kv_head * stride_kh
        v_base = V_ext + (ext_start + cur_n.to(tl.int64)) * stride_vt + kv_head * stride_vh
        causal = (offs_m[:, None] >= cur_n[None, :]) & mask_n[None, :]
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pe,
            k_base[None, :] + offs_d[:, None], k_base[None, :] + offs_dpe[:, None],
            v_base[:, None] + offs_dv[None, :],
            mask_n[None, :] & mask_d[:, None], mask_n[None, :] & mask_dpe[:, None],
            mask_n[:, None] & mask_dv[None, :], causal, qk_scale,
            1.0, HAS_PE, True, IEEE_DOT, False)

    out = acc / l_i[:, None]
    o_rows = (ext_start + offs_m.to(tl.int64)) * stride_ot + head * stride_oh
    tl.store(O + o_rows[:, None] + offs_dv[None, :], out.to(O.dtype.element_ty),
             mask=mask_m[:, None] & mask_dv[None, :])


def split_head_dim(lq: int) -> tuple[int, int]:
    """Split a QK head dim into (main, tail) power-of-two block widths, tail 0 if none is needed.

    main = the largest power of two <= lq (at least 16); tail = the next power of two >= the rest
    (at least 16), masked beyond lq. Examples: 128 → (128, 0), 576 → (512, 64), 192 → (128, 64),
    96 → (64, 32), 80 → (64, 16), 8 → (16, 0).
    """
    if lq < 1:
        raise ValueError(f"head dim must be >= 1, got {lq}")
    main = max(16, 1 << (lq.bit_length() - 1))
    rest = lq - main
    tail = 0 if rest <= 0 else max(16, triton.next_power_of_2(rest))
    return main, tail


# BLOCK_M of the wide-head (MLA absorbed, lq > 256) extend over an FP8 pool on sm_90+, or None for
# the 16-bit pool's 32. Compiled for sm_90 on the CPU (triton 3.6; bf16 q, 8 warps,
# BLOCK_N 64): the e4m3 / e5m2 pool variant spills 932 bytes per thread at BLOCK_M 32 (the bf16
# pool's: 80) and none at 16 (238 registers). Not yet timed on a GPU, so not the default:
# `benchmarks/bench_extend_attention.py --kv-dtype fp8_e4m3 --fp8-block-m 16` compares them.
FP8_POOL_WIDE_BLOCK_M: int | None = None


def extend_block_sizes(lq: int, device: torch.device,
                       dtype: torch.dtype = torch.bfloat16,
                       pool_dtype: torch.dtype | None = None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a QK head dim `lq`, input dtype and pool dtype (None:
    no pool, or a 16-bit one) on `device`.

    CUDA follows SGLang's tuned values: sm90+ (128, 64) for lq <= 256, (32, 64) above (MLA 576;
    BLOCK_M `FP8_POOL_WIDE_BLOCK_M` instead when set and the pool is FP8);
    sm80 (128, 128) for lq <= 128, (64, 64) for lq <= 256, (32, 64) above; other archs (64, 64) /
    (32, 32). 8 warps when lq > 64, else 4. Non-CUDA (the triton interpreter): small blocks,
    (32, 16) for lq <= 256, (16, 16) above, so tests reach block boundaries cheaply. fp32 inputs
    on CUDA (tests only) use (64, 32) / (16, 32) so the tiles fit registers and shared memory.
    """
    if device.type != "cuda":
        return (32, 16, 4) if lq <= 256 else (16, 16, 4)
    warps = 8 if lq > 64 else 4
    if dtype == torch.float32:
        return ((64, 32) if lq <= 256 else (16, 32)) + (warps,)
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 9:
        bm, bn = (128, 64) if lq <= 256 else (32, 64)
        if (lq > 256 and FP8_POOL_WIDE_BLOCK_M is not None
                and pool_dtype in _FP8_DTYPES):
            bm = FP8_POOL_WIDE_BLOCK_M
    elif (major, minor) == (8, 0):
        bm, bn = (128, 128) if lq <= 128 else (64, 64) if lq <= 256 else (32, 64)
    else:
        bm, bn = (64, 64) if lq <= 256 else (32, 32)
    return bm, bn, warps


def _check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"extend_attention_fwd: {name} must have stride 1 in its last dim, "
                         f"got strides {tuple(t.stride())}")


def extend_attention_fwd(q_extend: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor,
                         o_extend: torch.Tensor, k_buffer: torch.Tensor | None,
                         v_buffer: torch.Tensor | None, req_to_token: torch.Tensor,
                         req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                         extend_lens: torch.Tensor, extend_start_loc: torch.Tensor,
                         max_extend_len: int, sm_scale: float, k_scale: float = 1.0,
                         v_scale: float = 1.0) -> None:
    """Attention of the new (extend) tokens of a batch over their cached prefix and themselves.

    Args:
        q_extend: [T, H, Lq] queries of all new tokens, requests packed in order (T = Σ extend).
        k_extend: [T, Hkv, Lq] the new tokens' keys (H % Hkv == 0).
        v_extend: [T, Hkv, Lv] the new tokens' values; may be a strided view (e.g. MLA absorbed:
            `k_extend[..., :512]`), last-dim stride must be 1.
        o_extend: [T, H, Lv] output, written in place (its dtype; fp32 accumulation inside).
        k_buffer: [S, Hkv, Lq] key pool, or None when every prefix_len is 0 (then not read).
        v_buffer: [S, Hkv, Lv] value pool (may be a view of k_buffer), or None with k_buffer.
        req_to_token: [R, C] int32 slot table; row `req_pool_indices[i]` maps positions to slots.
        req_pool_indices: [bs] int64 rows of req_to_token.
        prefix_lens: [bs] integer, cached tokens per request (read on the device).
        extend_lens: [bs] integer, new tokens per request (>= 0).
        extend_start_loc: [bs] integer, first row of each request in the packed q/k/v/o.
        max_extend_len: host int >= max(extend_lens) (sizes the grid; larger is only slower).
        sm_scale: softmax scale applied to q·k.
        k_scale, v_scale: per-tensor dequantization scales of an FP8 pool (prefix key = stored
            · k_scale, value = stored · v_scale); 1.0 for other pools. The new tokens' k/v are
            used as given.
    Raises:
        ValueError: mismatched shapes, H not a multiple of Hkv, a last dim that is not
            contiguous, or only one of k_buffer / v_buffer given.
    Rows of o_extend beyond Σ extend_lens (if T is padded) are left untouched.
    """
    t, h, lq = q_extend.shape
    hkv = k_extend.shape[1]
    lv = v_extend.shape[2]
    if k_extend.shape != (t, hkv, lq) or v_extend.shape != (t, hkv, lv):
        raise ValueError(f"extend_attention_fwd: k_extend {tuple(k_extend.shape)} / v_extend "
                         f"{tuple(v_extend.shape)} do not match q_extend {tuple(q_extend.shape)}")
    if o_extend.shape != (t, h, lv):
        raise ValueError(f"extend_attention_fwd: o_extend {tuple(o_extend.shape)} != {(t, h, lv)}")
    if h % hkv:
        raise ValueError(f"extend_attention_fwd: {h} query heads not a multiple of {hkv} kv heads")
    if (k_buffer is None) != (v_buffer is None):
        raise ValueError("extend_attention_fwd: pass both k_buffer and v_buffer, or neither")
    has_prefix = k_buffer is not None
    if has_prefix:
        if k_buffer.shape[1:] != (hkv, lq) or v_buffer.shape[1:] != (hkv, lv):
            raise ValueError(f"extend_attention_fwd: pool shapes {tuple(k_buffer.shape)} / "
                             f"{tuple(v_buffer.shape)} do not match [S, {hkv}, {lq}] / "
                             f"[S, {hkv}, {lv}]")
        _check_last_dim_contiguous("k_buffer", k_buffer)
        _check_last_dim_contiguous("v_buffer", v_buffer)
        if req_to_token.stride(1) != 1:
            raise ValueError("extend_attention_fwd: req_to_token rows must be contiguous")
    for name, x in (("q_extend", q_extend), ("k_extend", k_extend), ("v_extend", v_extend),
                    ("o_extend", o_extend)):
        _check_last_dim_contiguous(name, x)
    bs = extend_lens.shape[0]
    if bs == 0 or t == 0 or max_extend_len <= 0:
        return

    block_d, block_dpe = split_head_dim(lq)
    has_pe = block_dpe > 0
    block_dv = max(16, triton.next_power_of_2(lv))
    block_m, block_n, num_warps = extend_block_sizes(
        lq, q_extend.device, q_extend.dtype, k_buffer.dtype if has_prefix else None)
    kb = k_buffer if has_prefix else k_extend  # dummies: never dereferenced without a prefix
    vb = v_buffer if has_prefix else v_extend
    grid = (bs, h, triton.cdiv(max_extend_len, block_m))
    _extend_attention_kernel[grid](
        q_extend, k_extend, v_extend, o_extend, kb, vb, req_to_token, req_pool_indices,
        prefix_lens, extend_lens, extend_start_loc, sm_scale * 1.4426950408889634,
        sm_scale * k_scale * 1.4426950408889634, v_scale,
        q_extend.stride(0), q_extend.stride(1), k_extend.stride(0), k_extend.stride(1),
        v_extend.stride(0), v_extend.stride(1), o_extend.stride(0), o_extend.stride(1),
        kb.stride(0), kb.stride(1), vb.stride(0), vb.stride(1), req_to_token.stride(0),
        KV_GROUP=h // hkv, LQ=lq, LV=lv, BLOCK_D=block_d, BLOCK_DPE=max(block_dpe, 16),
        BLOCK_DV=block_dv, BLOCK_M=block_m, BLOCK_N=block_n, HAS_PE=has_pe, HAS_PREFIX=has_prefix,
        IEEE_DOT=q_extend.dtype == torch.float32, SCALE_PREFIX_V=v_scale != 1.0,
        num_warps=num_warps, num_stages=1,
    )


__all__ = ["extend_attention_fwd", "extend_block_sizes", "split_head_dim"]
