"""KV store: scatter the new tokens' K (and V) rows into a per-layer KV pool at given slots.

Owns `store_kv` and its triton-language kernel. Pools use page size 1 (`buffer[slot]` is one
token's [heads, dim] row); slot 0 is the padding sink: padded rows (e.g. of a CUDA-graph batch)
carry loc 0 and all write there concurrently — its content is garbage by contract, and a padded
row never touches a real slot. For the MLA latent pool pass only the 576-wide key row (latent ‖
rotated k_pe) and `v_buffer = v = None`: the value buffer is a view of the key buffer.

One program per (token, KV head, column block); slot offsets are 64-bit (slot × stride may
exceed 2^31 elements). Values are converted to the pool dtype on the store. No host
synchronisation.

FP8 pools (float8_e4m3fn / float8_e5m2, with per-tensor `k_scale` / `v_scale`): the store
quantizes, x · (1 / scale) with the reciprocal rounded to float32 on the host (`fp8_reciprocal`),
saturated to the format's largest finite value and rounded to nearest even: the same arithmetic,
hence the same bytes, as the pool's torch write (`mem_cache.memory_pool.quantize_fp8`); NaN stays
NaN. GPU only: triton's interpreter rounds float → fp8 wrongly where a value rounds up to the
next power of two, so CPU callers keep the torch write.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_enter, use_pdl


@triton.jit
def _to_pool(x, inv_scale, FMAX: tl.constexpr, dtype: tl.constexpr):
    # FMAX > 0: an FP8 pool's quantization (x * (1 / scale), saturated, round to nearest even)
    if FMAX > 0:
        x = x.to(tl.float32) * inv_scale
        x = tl.clamp(x, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
    return x.to(dtype)


@triton.jit
def _store_kv_kernel(K_buf, V_buf, Loc, K, V, k_inv_scale, v_inv_scale,
                     stride_kbs, stride_kbh, stride_vbs, stride_vbh,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     LK: tl.constexpr, LV: tl.constexpr, BLOCK: tl.constexpr,
                     HAS_V: tl.constexpr, FMAX: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    col = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(Loc + tok).to(tl.int64)
    if tl.program_id(2) * BLOCK < LK:
        mask = col < LK
        k = tl.load(K + tok * stride_kt + head * stride_kh + col, mask=mask)
        tl.store(K_buf + slot * stride_kbs + head * stride_kbh + col,
                 _to_pool(k, k_inv_scale, FMAX, K_buf.dtype.element_ty), mask=mask)
    if HAS_V:
        if tl.program_id(2) * BLOCK < LV:
            mask_v = col < LV
            v = tl.load(V + tok * stride_vt + head * stride_vh + col, mask=mask_v)
            tl.store(V_buf + slot * stride_vbs + head * stride_vbh + col,
                     _to_pool(v, v_inv_scale, FMAX, V_buf.dtype.element_ty), mask=mask_v)


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_reciprocal(scale: float) -> float:
    """1 / scale as float32 division rounds it (a Python float float32 holds exactly): the
    factor an FP8 pool's write multiplies by, here and in the pool's torch write
    (`mem_cache.memory_pool.quantize_fp8`, whose `fp8_reciprocal` is this formula again: kernels
    import no mla_backend code), so both write the same bytes. A float32 division done in double
    and rounded once is the correctly rounded float32 quotient (double has over twice float32's
    precision)."""
    f32 = struct.Struct("f")
    return f32.unpack(f32.pack(1.0 / f32.unpack(f32.pack(float(scale)))[0]))[0]


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor | None, loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor | None, k_scale: float = 1.0,
             v_scale: float = 1.0) -> None:
    """Write k[i] (and v[i]) at slot loc[i] of the pool, converting to the pool dtype (an FP8
    pool: quantized with k_scale / v_scale, module docstring).

    Args:
        k_buffer: [S, Hkv, Lk] key pool (MLA: [S, 1, 576] latent ‖ k_pe), written in place.
        v_buffer: [S, Hkv, Lv] value pool, or None (MLA: the value is a view of the key buffer).
        loc: [T] int64 slots, each in [0, S); 0 is the padding sink (may repeat). Real slots must
            be distinct (duplicate real slots race: one of the rows wins).
        k: [T, Hkv, Lk] new keys (any float dtype; last-dim stride 1).
        v: [T, Hkv, Lv] new values, or None exactly when v_buffer is None.
        k_scale, v_scale: an FP8 pool's per-tensor scales (stored = x / scale); ignored by
            other pools.
    Raises:
        ValueError: shapes that do not match, v given without v_buffer (or the reverse), a
            last dim that is not contiguous, loc not an integer tensor, an FP8 pool off CUDA
            or a scale that is not finite and positive.
    Slots are not bounds-checked on the device (that would need a host sync).
    """
    if (v_buffer is None) != (v is None):
        raise ValueError("store_kv: pass both v_buffer and v, or neither")
    t = loc.shape[0]
    if loc.dim() != 1 or loc.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"store_kv: loc must be a 1-D int64/int32 tensor, got {loc.dtype} "
                         f"{tuple(loc.shape)}")
    if k.shape[0] != t or k.shape[1:] != k_buffer.shape[1:]:
        raise ValueError(f"store_kv: k {tuple(k.shape)} does not match loc [{t}] and pool "
                         f"{tuple(k_buffer.shape)}")
    tensors = [("k_buffer", k_buffer), ("k", k)]
    if v is not None:
        if v.shape[0] != t or v.shape[1:] != v_buffer.shape[1:]:
            raise ValueError(f"store_kv: v {tuple(v.shape)} does not match loc [{t}] and pool "
                             f"{tuple(v_buffer.shape)}")
        tensors += [("v_buffer", v_buffer), ("v", v)]
    for name, x in tensors:
        if x.stride(-1) != 1:
            raise ValueError(f"store_kv: {name} must have stride 1 in its last dim")
    fmax, inv = 0.0, (1.0, 1.0)
    if k_buffer.dtype in _FP8_DTYPES:
        if not k_buffer.is_cuda:
            raise ValueError("store_kv: an FP8 pool's quantizing store runs on CUDA only "
                             "(use the pool's set_kv_buffer elsewhere)")
        if not all(0.0 < s < float("inf") for s in (k_scale, v_scale)):
            raise ValueError(f"store_kv: FP8 scales must be finite and > 0, got {k_scale}, "
                             f"{v_scale}")
        fmax = torch.finfo(k_buffer.dtype).max
        inv = (fp8_reciprocal(k_scale), fp8_reciprocal(v_scale))
    if t == 0:
        return
    hkv, lk = k.shape[1], k.shape[2]
    lv = v.shape[2] if v is not None else 0
    block = min(1024, triton.next_power_of_2(max(lk, lv)))
    grid = (t, hkv, triton.cdiv(max(lk, lv), block))
    vb = v_buffer if v is not None else k_buffer
    vv = v if v is not None else k
    _store_kv_kernel[grid](
        k_buffer, vb, loc, k, vv, *inv,
        k_buffer.stride(0), k_buffer.stride(1), vb.stride(0), vb.stride(1),
        k.stride(0), k.stride(1), vv.stride(0), vv.stride(1),
        LK=lk, LV=lv, BLOCK=block, HAS_V=v is not None, FMAX=fmax, num_warps=4,
        **launch_options(use_pdl(k)),
    )


__all__ = ["fp8_reciprocal", "store_kv"]
