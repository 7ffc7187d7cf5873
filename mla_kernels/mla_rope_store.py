"""Absorbed-MLA decode prologue in one triton kernel: latent RMSNorm, rope of k_pe and q_pe,
and the store of the new latent row into the KV pool (16-bit, fp32 or FP8: an FP8 pool's row is
quantized in the kernel with the layer's k scale).

Owns `mla_norm_rope_store`; float32 twin `reference.mla_norm_rope_store_ref`. It replaces three
small launches per layer in the absorbed decode path of `models/deepseek_v2.py`. The key row
never exists outside the pool: it is normalized, rotated and written straight to its slot, and
the decode attention reads it from there (the backend is called with `save_kv_cache=False`).

Math per token t (DeepSeek-V2, arXiv:2405.04434 §2.1.3; the model card's `modeling_deepseek.py`):
  c = kv_a[t, :L] (the compressed latent, L = kv_lora_rank), k_pe = kv_a[t, L:L + R]
  pool[loc[t], 0, :L]      = c / sqrt(mean(c^2) + eps) * weight   (fp32 math, one rounding)
  pool[loc[t], 0, L:L + R] = rope(k_pe)                          (interleaved pairs, GPT-J style)
  q_out[t, h, :R]          = rope(q_pe[t, h])                    for every head h
with rope's cos ‖ sin row `table[t]` ([R] fp32, YaRN's mscale folded in, as
`DeepseekRotaryEmbedding.table` builds it). Results equal the separate kernels (`rmsnorm`,
`rotary_embedding`, `store_kv`) up to the norm's reduction order. Grid (T,), one program per
token; slot offsets are 64-bit; padded rows of a CUDA-graph batch carry loc 0, the padding sink.
With programmatic dependent launch (`pdl.py`) the norm weight is read before the wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_trigger, pdl_wait, use_pdl


@triton.jit
def _rope_pairs(x_ptr, cols, mask, cos, sin):
    """Interleaved rope of the pairs (x[2i], x[2i+1]) addressed by x_ptr + 2 * cols (fp32)."""
    x1 = tl.load(x_ptr + 2 * cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + 2 * cols + 1, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _to_pool(x, k_scale, out_ty: tl.constexpr, FP8_MAX: tl.constexpr):
    """fp32 values in the pool's dtype: for an FP8 pool (FP8_MAX > 0) x / k_scale saturated to
    +-FP8_MAX, as `memory_pool.quantize_fp8` does; else a plain cast."""
    if FP8_MAX > 0:
        x = tl.minimum(tl.maximum(x / k_scale, -FP8_MAX), FP8_MAX)
    return x.to(out_ty)


@triton.jit
def _mla_norm_rope_store_kernel(
    KvA, NormW, QPe, Table, Loc, KBuf, QOut,
    stride_kvt, stride_qt, stride_qh, stride_tt, stride_ks, stride_qot, stride_qoh,
    L, HALF, H, eps, k_scale,
    BLOCK_L: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    FP8_MAX: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_trigger(USE_PDL)
    cols = tl.arange(0, BLOCK_L)
    mask = cols < L
    w = tl.load(NormW + cols, mask=mask, other=0.0).to(tl.float32)  # a parameter: before wait
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    row = KvA + t * stride_kvt
    dst = KBuf + slot * stride_ks
    out_ty = KBuf.dtype.element_ty

    c = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(c * c, axis=0) / L
    tl.store(dst + cols, _to_pool(c * tl.math.rsqrt(var + eps) * w, k_scale, out_ty, FP8_MAX),
             mask=mask)

    half = tl.arange(0, BLOCK_HALF)
    hmask = half < HALF
    cos = tl.load(Table + t * stride_tt + half, mask=hmask, other=0.0).to(tl.float32)
    sin = tl.load(Table + t * stride_tt + HALF + half, mask=hmask, other=0.0).to(tl.float32)
    o1, o2 = _rope_pairs(row + L, half, hmask, cos, sin)
    tl.store(dst + L + 2 * half, _to_pool(o1, k_scale, out_ty, FP8_MAX), mask=hmask)
    tl.store(dst + L + 2 * half + 1, _to_pool(o2, k_scale, out_ty, FP8_MAX), mask=hmask)

    heads = tl.arange(0, BLOCK_H)
    qmask = (heads < H)[:, None] & hmask[None, :]
    q_in = QPe + t * stride_qt + heads.to(tl.int64)[:, None] * stride_qh
    q1, q2 = _rope_pairs(q_in, half[None, :], qmask, cos[None, :], sin[None, :])
    q_dst = QOut + t * stride_qot + heads.to(tl.int64)[:, None] * stride_qoh + 2 * half[None, :]
    q_ty = QOut.dtype.element_ty
    tl.store(q_dst, q1.to(q_ty), mask=qmask)
    tl.store(q_dst + 1, q2.to(q_ty), mask=qmask)


def mla_norm_rope_store(kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        q_pe: torch.Tensor, table: torch.Tensor, k_buffer: torch.Tensor,
                        loc: torch.Tensor, q_out: torch.Tensor, k_scale: float = 1.0) -> None:
    """Normalize and rotate T new latent rows into the pool and rotate the queries' rope part.

    Args:
        kv_a: [T, L + R] output of kv_a_proj_with_mqa (latent ‖ k_pe), any float dtype, last
            dim contiguous (any row stride: e.g. a column slice of a fused projection).
        norm_weight: [L] kv_a_layernorm weight.
        eps: the norm's variance epsilon.
        q_pe: [T, H, R] rope part of the queries (strided views are fine; last dim contiguous).
        table: [T, R] fp32 cos ‖ sin rows of each token's position (row t for token t).
        k_buffer: [S, 1, L + R] the layer's latent pool buffer (written at rows `loc`, in its
            dtype: 16-bit, fp32, or FP8 (float8_e4m3fn / float8_e5m2), where the row is stored
            as value / k_scale saturated to the format's largest finite value, as the pool's
            own `set_kv_buffer` stores it).
        loc: [T] int64 slots (0 is the padding sink, may repeat; real slots distinct).
        q_out: [T, H, R] destination of the rotated q_pe (e.g. the rope columns of the absorbed
            query), last dim contiguous.
        k_scale: the layer's k scale of an FP8 pool (> 0); ignored otherwise.
    Raises:
        ValueError: shapes that do not match, an odd R, a non-positive k_scale for an FP8
            pool, or a strided last dim.
    """
    t = kv_a.shape[0]
    if kv_a.dim() != 2 or q_pe.dim() != 3 or q_pe.shape[0] != t:
        raise ValueError(f"mla_norm_rope_store: kv_a {tuple(kv_a.shape)}, q_pe "
                         f"{tuple(q_pe.shape)}")
    heads, rope = q_pe.shape[1], q_pe.shape[2]
    lora = kv_a.shape[1] - rope
    if (rope % 2 or lora <= 0 or tuple(norm_weight.shape) != (lora,)
            or tuple(table.shape) != (t, rope) or tuple(q_out.shape) != tuple(q_pe.shape)
            or k_buffer.dim() != 3 or k_buffer.shape[1:] != (1, lora + rope)
            or tuple(loc.shape) != (t,)):
        raise ValueError(f"mla_norm_rope_store: kv_a {tuple(kv_a.shape)}, weight "
                         f"{tuple(norm_weight.shape)}, q_pe {tuple(q_pe.shape)}, table "
                         f"{tuple(table.shape)}, k_buffer {tuple(k_buffer.shape)}, loc "
                         f"{tuple(loc.shape)}, q_out {tuple(q_out.shape)}")
    fp8_max = 0.0
    if k_buffer.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        if not k_scale > 0:
            raise ValueError(f"mla_norm_rope_store: k_scale must be > 0, got {k_scale}")
        fp8_max = float(torch.finfo(k_buffer.dtype).max)
    for name, x in (("kv_a", kv_a), ("q_pe", q_pe), ("table", table), ("k_buffer", k_buffer),
                    ("q_out", q_out)):
        if t and x.stride(-1) != 1:
            raise ValueError(f"mla_norm_rope_store: {name} needs a contiguous last dim")
    if t == 0:
        return
    block_l = triton.next_power_of_2(lora)
    _mla_norm_rope_store_kernel[(t,)](
        kv_a, norm_weight, q_pe, table, loc, k_buffer, q_out,
        kv_a.stride(0), q_pe.stride(0), q_pe.stride(1), table.stride(0), k_buffer.stride(0),
        q_out.stride(0), q_out.stride(1), lora, rope // 2, heads, float(eps),
        float(k_scale) if fp8_max else 1.0,
        BLOCK_L=block_l, BLOCK_HALF=triton.next_power_of_2(rope // 2),
        BLOCK_H=triton.next_power_of_2(heads), FP8_MAX=fp8_max,
        num_warps=4 if block_l >= 512 else 1,
        **launch_options(use_pdl(kv_a)))


__all__ = ["mla_norm_rope_store"]
