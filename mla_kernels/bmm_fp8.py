"""Batched FP8 GEMM with per-tensor scales, the activation quantized on load: the absorbed-MLA
products (q_nope . w_kc and o . w_vc) of `mla_backend.layers.quantization.fp8_per_tensor_bmm`.

Owns `bmm_fp8`: y[h] = e4m3(x[h] / x_scale) @ w[h] * x_scale * w_scale for x [H, M, K] in the
model dtype (any strides: the engine passes a [T, H, K] tensor transposed to [H, T, K]) and w
[H, K, N] float8_e4m3fn (any strides; `quantize_fp8_bmm_weight` stores each w[h] column-major).
No quantized copy of x is written: with a dynamic scale the call is `fp8_quant`'s amax pass
(launch 1, partials) plus one GEMM launch whose programs each reduce the partials to the scale.
Float32 twin: `reference.bmm_fp8_ref`.

Quantization in the GEMM equals `fp8_quant.quantize_fp8` (IEEE division by the scale,
saturation to +-448, round to nearest even; the interpreter rounds in float32 first, see
`fp8_quant._to_e4m3`). The products run as tl.dot on the fp8 tiles with fp32
accumulation (tensor cores; CUDA needs sm89+, Ada / Hopper, as triton's float8e4nv and
`torch._scaled_mm` do). Triton's interpreter (CPU tests) runs the fp8 tl.dot itself (it upcasts
both tiles to fp16, exactly, and multiplies in float32), so the same code path is tested there;
its float32 -> bf16/fp16 output cast truncates instead of rounding (GPUs round).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_quant import FP8_DTYPE, MAX_PARTIALS, _scale_from_partials, _to_e4m3, fp8_amax_partials


@triton.jit(do_not_specialize=["M", "n_parts"])  # one compile for every token count
def _bmm_fp8_kernel(x_ptr, w_ptr, y_ptr, xs_ptr, ws_ptr, M, N, K, n_parts,
                    sxh, sxm, sxk, swh, swk, swn, syh, sym, syn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_P: tl.constexpr, DYNAMIC: tl.constexpr, EXACT: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of head program_id(2); grid (N tiles, M tiles, H)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    if DYNAMIC:
        xs = _scale_from_partials(xs_ptr, n_parts, BLOCK_P)
    else:
        xs = tl.load(xs_ptr)
    ws = tl.load(ws_ptr)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = (x_ptr + h * sxh + offs_m.to(tl.int64)[:, None] * sxm
              + offs_k.to(tl.int64)[None, :] * sxk)  # [BM, BK]
    w_ptrs = (w_ptr + h * swh + offs_k.to(tl.int64)[:, None] * swk
              + offs_n.to(tl.int64)[None, :] * swn)  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a = _to_e4m3(tl.math.div_rn(x.to(tl.float32), xs), EXACT)  # quantize on load
        b = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        # fp8 x fp8 -> fp32. Hopper's fp8 wgmma accumulates at reduced precision, so each
        # BLOCK_K (128) chunk is a fresh dot added to the fp32 acc (DeepSeek-V3's promotion
        # interval, arXiv:2412.19437 §3.3.2)
        acc += tl.dot(a, b)
        x_ptrs += BLOCK_K * sxk
        w_ptrs += BLOCK_K * swk
    y = acc * (xs * ws)
    y_ptrs = (y_ptr + h * syh + offs_m.to(tl.int64)[:, None] * sym
              + offs_n.to(tl.int64)[None, :] * syn)
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _config(m: int, n: int, cuda: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for M rows per head and N columns."""
    if not cuda:  # interpreter: cost per program and op, so few large tiles (masks still hit)
        return 32, 64, 64, 4, 1
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64 if m <= 64 or n < 128 else 128
    return block_m, block_n, 128, 4, 3


def bmm_fp8(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
            x_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y[h] = e4m3(x[h] / x_scale) @ w[h] * x_scale * w_scale, fp32 accumulation.

    Args:
        x: [H, M, K] float32 / bfloat16 / float16, any strides (unquantized activations).
        w: [H, K, N] float8_e4m3fn, any strides (column-major per head is the fast layout).
        w_scale: float32, one element, on x's device (per-tensor weight scale).
        x_scale: static scale (one float32 element on x's device) or None = dynamic,
            max(amax(|x|) / 448, 1e-12) over the whole x (one amax launch, reduced in the GEMM).
        out: optional [H, M, N] output of any strides (e.g. a [M, H, N] buffer transposed, so
            the caller gets token-major rows without a copy); its dtype is the output dtype.
        out_dtype: output dtype when out is None (default x's dtype).
    Returns:
        [H, M, N] (`out` when given). Values of x beyond +-448 * x_scale saturate.
    Raises:
        TypeError: x not float32/bfloat16/float16, or w not float8_e4m3fn.
        ValueError: shapes that do not match, a scale with more than one element, or
            tensors on different devices.
    """
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"x must be float32/bfloat16/float16, got {x.dtype}")
    if w.dtype != FP8_DTYPE:
        raise TypeError(f"w must be float8_e4m3fn, got {w.dtype}")
    if x.dim() != 3 or w.dim() != 3 or x.shape[0] != w.shape[0] or x.shape[2] != w.shape[1]:
        raise ValueError(f"x [H, M, K] and w [H, K, N] do not match: {tuple(x.shape)}, "
                         f"{tuple(w.shape)}")
    h, m, k = x.shape
    n = w.shape[2]
    for name, s in (("w_scale", w_scale), ("x_scale", x_scale)):
        if s is not None and s.numel() != 1:
            raise ValueError(f"{name} must have one element, got shape {tuple(s.shape)}")
    devices = {t.device for t in (x, w, w_scale, x_scale, out) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"tensors on different devices: {devices}")
    if out is None:
        out = torch.empty(h, m, n, dtype=out_dtype or x.dtype, device=x.device)
    elif tuple(out.shape) != (h, m, n):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(h, m, n)}")
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    w_scale = w_scale.float().reshape(1)
    if x_scale is None:
        xs, dynamic = fp8_amax_partials(x), True
    else:
        xs, dynamic = x_scale.float().reshape(1), False
    cuda = x.is_cuda
    block_m, block_n, block_k, warps, stages = _config(m, n, cuda)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), h)
    _bmm_fp8_kernel[grid](
        x, w, out, xs, w_scale, m, n, k, xs.numel(),
        x.stride(0), x.stride(1), x.stride(2), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_P=MAX_PARTIALS,
        DYNAMIC=dynamic, EXACT=not cuda, num_warps=warps, num_stages=stages,
    )
    return out


__all__ = ["bmm_fp8"]
