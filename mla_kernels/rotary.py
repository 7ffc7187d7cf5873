"""Rotary position embedding (RoPE) applied to q and k by one triton kernel.

Owns `rotary_embedding`; float32 twin `reference.rotary_ref`.

API (shared by both rotary layers): rotation angles come from a cos/sin table
`cos_sin_cache` [N, rot_dim] fp32 whose row p is cos(θ_p) ‖ sin(θ_p) (rot_dim/2 each, any
magnitude — DeepSeek YaRN's mscale is folded into the table), and `positions` picks each token's
row. `positions=None` means token t uses row t: that is how a caller that computes cos/sin per
call (DeepSeek YaRN, `layers.rotary_deepseek`) passes its [T, rot_dim] table without building
an index. Only the first `rot_dim` dims of each head rotate; the rest pass through.

Layouts: `is_neox=True` rotates the halves (x[i], x[i + rot_dim/2]); `is_neox=False` rotates
interleaved pairs (x[2i], x[2i+1]) (GPT-J, DeepSeek MLA). Math in fp32, one rounding to the
output dtype. In place by default; `q_out`/`k_out` give out-of-place results (the pass-through
dims are then copied).

Grid (T, cdiv(Hq, BLOCK_H) + cdiv(Hk, BLOCK_H)): each program rotates BLOCK_H heads of q or of k
of one token. Token offsets are 64-bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_enter, use_pdl


@triton.jit
def _rotate_heads(in_ptr, out_ptr, stride_it, stride_ih, stride_ot, stride_oh, tok, h0, H,
                  cos, sin, HALF, PASS, IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr, COPY_PASS: tl.constexpr,
                  BLOCK_PASS: tl.constexpr):
    heads = h0 + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    hmask = heads < H
    mask = hmask[:, None] & (offs < HALF)[None, :]
    in_row = in_ptr + tok * stride_it + heads.to(tl.int64)[:, None] * stride_ih
    out_row = out_ptr + tok * stride_ot + heads.to(tl.int64)[:, None] * stride_oh
    if IS_NEOX:
        i1 = offs[None, :]
        i2 = offs[None, :] + HALF
    else:
        i1 = 2 * offs[None, :]
        i2 = 2 * offs[None, :] + 1
    x1 = tl.load(in_row + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(in_row + i2, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(out_row + i1, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_row + i2, o2.to(out_ptr.dtype.element_ty), mask=mask)
    if COPY_PASS:
        poffs = tl.arange(0, BLOCK_PASS)
        pmask = hmask[:, None] & (poffs < PASS)[None, :]
        pcol = 2 * HALF + poffs[None, :]
        xp = tl.load(in_row + pcol, mask=pmask, other=0.0)
        tl.store(out_row + pcol, xp.to(out_ptr.dtype.element_ty), mask=pmask)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, qo_ptr, ko_ptr, cache_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache,
                   HQ, HK, HALF, PASS,
                   HAS_POS: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, COPY_PASS: tl.constexpr,
                   BLOCK_PASS: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    if HAS_POS:
        pos = tl.load(pos_ptr + tok).to(tl.int64)
    else:
        pos = tok
    offs = tl.arange(0, BLOCK_HALF)
    cmask = offs < HALF
    crow = cache_ptr + pos * stride_cache
    cos = tl.load(crow + offs, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(crow + HALF + offs, mask=cmask, other=0.0).to(tl.float32)
    n_qb = tl.cdiv(HQ, BLOCK_H)
    if hb < n_qb:
        _rotate_heads(q_ptr, qo_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, tok,
                      hb * BLOCK_H, HQ, cos, sin, HALF, PASS, IS_NEOX, BLOCK_H, BLOCK_HALF,
                      COPY_PASS, BLOCK_PASS)
    else:
        _rotate_heads(k_ptr, ko_ptr, stride_kt, stride_kh, stride_kot, stride_koh, tok,
                      (hb - n_qb) * BLOCK_H, HK, cos, sin, HALF, PASS, IS_NEOX, BLOCK_H,
                      BLOCK_HALF, COPY_PASS, BLOCK_PASS)


def _check_heads(name: str, t: torch.Tensor, n_tok: int, d: int) -> None:
    if t.dim() != 3 or t.shape[0] != n_tok or t.shape[2] != d:
        raise ValueError(f"{name} must be [{n_tok}, H, {d}], got {tuple(t.shape)}")
    if t.numel() and t.stride(2) != 1:
        raise ValueError(f"{name} must have a contiguous last dim")


def rotary_embedding(positions: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox: bool, rot_dim: int | None = None,
                     *, q_out: torch.Tensor | None = None,
                     k_out: torch.Tensor | None = None) -> None:
    """Rotate the first `rot_dim` dims of every head of q and k by each token's angles.

    Args:
        positions: [T] int64/int32 rows of `cos_sin_cache` (each < N; not checked, no host
            sync), or None for row t ↔ token t (then N >= T).
        q: [T, Hq, D] any float dtype, last dim contiguous (token/head strides free, so a
            column slice of a fused projection works); rotated in place unless `q_out` is given.
        k: [T, Hk, D] likewise (Hk may differ from Hq, e.g. 1 for MLA's shared k_pe).
        cos_sin_cache: [N, rot_dim] (fp32 normally): cos ‖ sin halves per row; last dim
            contiguous.
        is_neox: True rotates halves, False interleaved pairs.
        rot_dim: rotary dims (even, <= D); None means cos_sin_cache.shape[1].
        q_out, k_out: optional destinations shaped like q / k (last dim contiguous); give both
            or neither. The pass-through dims rot_dim..D are copied into them.
    Raises:
        ValueError: shape/stride mismatch, odd or too large rot_dim, a table narrower than
            rot_dim, or only one of q_out/k_out.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got {tuple(q.shape)}")
    n_tok, d = q.shape[0], q.shape[2]
    rot_dim = cos_sin_cache.shape[1] if rot_dim is None else int(rot_dim)
    _check_heads("q", q, n_tok, d)
    _check_heads("k", k, n_tok, d)
    if rot_dim % 2 or rot_dim <= 0 or rot_dim > d:
        raise ValueError(f"rot_dim {rot_dim} must be even, positive and <= head dim {d}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rot_dim:
        raise ValueError(f"cos_sin_cache must be [N, {rot_dim}], got "
                         f"{tuple(cos_sin_cache.shape)}")
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must have a contiguous last dim")
    if positions is not None and tuple(positions.shape) != (n_tok,):
        raise ValueError(f"positions must be [{n_tok}], got {tuple(positions.shape)}")
    if (q_out is None) != (k_out is None):
        raise ValueError("give both q_out and k_out or neither")
    out_of_place = q_out is not None
    q_out = q if q_out is None else q_out
    k_out = k if k_out is None else k_out
    if tuple(q_out.shape) != tuple(q.shape) or tuple(k_out.shape) != tuple(k.shape):
        raise ValueError("q_out/k_out must have the shapes of q/k")
    _check_heads("q_out", q_out, n_tok, d)
    _check_heads("k_out", k_out, n_tok, d)
    hq, hk = q.shape[1], k.shape[1]
    if n_tok == 0 or hq + hk == 0:
        return
    half, n_pass = rot_dim // 2, d - rot_dim
    block_half = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(hq, hk)), max(1, 1024 // block_half)))
    copy_pass = out_of_place and n_pass > 0
    block_pass = triton.next_power_of_2(n_pass) if copy_pass else 1
    grid = (n_tok, triton.cdiv(hq, block_h) + triton.cdiv(hk, block_h))
    pos = positions if positions is not None else cos_sin_cache  # dummy pointer when unused
    _rotary_kernel[grid](
        pos, q, k, q_out, k_out, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_sin_cache.stride(0), hq, hk, half, n_pass,
        HAS_POS=positions is not None, IS_NEOX=bool(is_neox), BLOCK_H=block_h,
        BLOCK_HALF=block_half, COPY_PASS=copy_pass, BLOCK_PASS=block_pass,
        num_warps=4 if block_h * block_half >= 512 else 1, **launch_options(use_pdl(q)))


__all__ = ["rotary_embedding"]
