"""Per-head matrix-vector products for decode at few tokens: `bmm_gemv`, out[t, h] = x[t, h] @ w[h].

Owns `bmm_gemv` (one triton kernel) and its launch settings; float32 twin `reference.bmm_ref`.
Used by absorbed MLA (`mla_backend.models.deepseek_v2`) for q_nope · w_kc ([H, 128, 512]) and
o · w_vc ([H, 512, 128]) at one token row, in place of `torch.bmm` over [H, T, K] views: the
result is written straight into a strided destination (the first 512 columns of the [T, H, 576]
query the attention reads, or the [T, H, v] rows the o_proj reads), so no concatenation or
transposing copy follows, and the static weight is prefetched before the programmatic-dependent-
launch wait (mla_kernels/pdl.py).

Each program owns one (token, head, BLOCK_N columns) and walks K in BLOCK_K chunks of the
[K, BLOCK_N] weight tile (N contiguous), accumulating w * x[:, None] in fp32 and reducing over K
once. Every token row re-reads the head's weight (from L2 after the first: 2 MB for V2-Lite's
16 heads), so it is meant for a handful of rows.

Layout: x [T, H, K] (last dim contiguous, token/head strides free), w [H, K, N] (last dim
contiguous, head/row strides free), out [T, H, N] of x's dtype (last dim contiguous, strides
free). Math in fp32, one rounding to out's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_trigger, pdl_wait, use_pdl


@triton.jit
def _bmm_gemv_kernel(X, W, Out, K, N, stride_xt, stride_xh, stride_wh, stride_wk,
                     stride_ot, stride_oh, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     USE_PDL: tl.constexpr, PREFETCH: tl.constexpr):
    h = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    t = tl.program_id(2).to(tl.int64)
    pdl_trigger(USE_PDL)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + h * stride_wh + offs_k[:, None].to(tl.int64) * stride_wk + offs_n[None, :]
    x_ptrs = X + t * stride_xt + h * stride_xh + offs_k
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    k_start = 0
    if PREFETCH:  # the first K chunk of the (static) weight before the grid-dependency wait
        mask_k = offs_k < K
        w0 = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        pdl_wait(USE_PDL)
        x0 = tl.load(x_ptrs, mask=mask_k, other=0.0)
        acc += w0.to(tl.float32) * x0.to(tl.float32)[:, None]
        k_start = BLOCK_K
    else:
        pdl_wait(USE_PDL)
    for k0 in range(k_start, K, BLOCK_K):
        mask_k = offs_k + k0 < K
        w = tl.load(w_ptrs + k0 * stride_wk, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        x = tl.load(x_ptrs + k0, mask=mask_k, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[:, None]
    y = tl.sum(acc, axis=0)
    tl.store(Out + t * stride_ot + h * stride_oh + offs_n, y.to(Out.dtype.element_ty),
             mask=mask_n)


def bmm_gemv_config(k: int, n: int) -> dict:
    """BLOCK_N, BLOCK_K, num_warps for w [H, K, N]: 8192-element weight tiles (16 KB in bf16),
    at N >= 256 as 128 x 64 (q_nope · w_kc, N 512: 8 programs per head), else K-deep 512 x 16
    (o · w_vc, N 128: 8 programs per head), so 16 heads give 128 programs, about one per SM of
    a 132-SM GPU. Not tuned on the GPU yet."""
    block_n = 64 if n >= 256 else 16
    block_k = min(8192 // block_n, triton.next_power_of_2(max(k, 16)))
    return {"BLOCK_N": min(block_n, triton.next_power_of_2(max(n, 16))), "BLOCK_K": block_k,
            "num_warps": 4}


def bmm_gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
             config: dict | None = None, static_weight: bool = False) -> torch.Tensor:
    """out[t, h, :] = x[t, h, :] @ w[h] for every token t and head h.

    Args:
        x: [T, H, K] float, last dim contiguous (any token / head stride).
        w: [H, K, N] of x's dtype, last dim contiguous (any head / row stride).
        out: optional [T, H, N] destination of x's dtype, last dim contiguous (any strides,
            e.g. a column slice of a wider buffer).
        config: launch settings (`bmm_gemv_config`'s keys) instead of the defaults.
        static_weight: no kernel writes `w` while this one may run (a model buffer): on a
            device with programmatic dependent launch the kernel is launched with PDL and reads
            its first weight chunk before waiting for the kernel in front (mla_kernels/pdl.py).
    Returns:
        out, or a new contiguous [T, H, N] tensor.
    Raises:
        ValueError: shapes or dtypes disagree, or a last dim is strided.
    """
    if x.dim() != 3 or w.dim() != 3 or x.shape[1] != w.shape[0] or x.shape[2] != w.shape[1]:
        raise ValueError(f"bmm_gemv: x {tuple(x.shape)} and w {tuple(w.shape)}: need [T, H, K] "
                         "and [H, K, N]")
    if x.dtype != w.dtype:
        raise ValueError(f"bmm_gemv: x is {x.dtype}, w {w.dtype}")
    t, h, k = x.shape
    n = w.shape[2]
    if out is None:
        out = torch.empty((t, h, n), dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (t, h, n) or out.dtype != x.dtype:
        raise ValueError(f"bmm_gemv: out must be [{t}, {h}, {n}] {x.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if t == 0 or h == 0 or n == 0:
        return out
    for name, v in (("x", x), ("w", w), ("out", out)):
        if v.stride(-1) != 1:
            raise ValueError(f"bmm_gemv: {name} needs a contiguous last dim")
    cfg = dict(config or bmm_gemv_config(k, n))
    pdl = static_weight and use_pdl(x)
    grid = (h, triton.cdiv(n, cfg["BLOCK_N"]), t)
    _bmm_gemv_kernel[grid](x, w, out, k, n, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                           out.stride(0), out.stride(1), BLOCK_N=cfg["BLOCK_N"],
                           BLOCK_K=cfg["BLOCK_K"],
                           PREFETCH=cfg.get("PREFETCH", static_weight),
                           num_warps=cfg["num_warps"], **launch_options(pdl))
    return out


__all__ = ["bmm_gemv", "bmm_gemv_config"]
