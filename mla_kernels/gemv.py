"""Dense matrix-vector product for decode at batch size 1: `gemv`, out = x W^T (+ bias).

Owns `gemv` and its launch configuration `gemv_config`; float32 twin `reference.linear_ref`.
At one token per step every linear layer is a read of its whole weight with almost no math, and
cuBLAS's kernels for M = 1 reach well under the card's copy bandwidth on the shapes of
DeepSeek-V2-Lite. Here each program owns BLOCK_N output features and streams their weight rows
through K in BLOCK_K chunks (the loads software-pipelined over NUM_STAGES), with the fp32
accumulation in registers; the grid covers N for every token row (rows beyond the first re-read the
weight), so it is meant for one row: at two it already loses to cuBLAS on large weights
(`benchmarks/bench_gemv.py --rows 2`).

Layout: x [T, K] and W [N, K] (the `nn.Linear` weight), last dims contiguous, any row stride;
out [T, N] in x's dtype, or fp32 for a 16-bit x with an fp32 W (DeepSeek's fp32 router over
bf16 hidden states, without casting x first). Weight-only FP8 (a float x, an e4m3 W with
per-column scales: the dynamic FP8 linear at one token row, `layers.quantization.fp8_per_token_mm`):
the same loop over half the weight bytes, the scales applied to the fp32 sums, and no
quantization of x; its twin is `reference.fp8_weight_only_gemv_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_trigger, pdl_wait, use_pdl


@triton.jit
def _gemv_kernel(X, W, B, Out, WS, N, K, stride_xt, stride_wn, stride_ot,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr,
                 SCALED: tl.constexpr = False):
    pid_n = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    pdl_trigger(USE_PDL)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = X + t * stride_xt + offs_k
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    y = tl.zeros([BLOCK_N], dtype=tl.float32)
    k_start = 0
    if PREFETCH_K > 0:
        # The first PREFETCH_K columns of the (static) weight are read before the grid-dependency
        # wait, so with PDL their memory latency overlaps the kernel in front (mla_kernels/pdl.py).
        offs_p = tl.arange(0, PREFETCH_K)
        mask_p = offs_p < K
        wp = tl.load(W + offs_n[:, None].to(tl.int64) * stride_wn + offs_p[None, :],
                     mask=mask_n[:, None] & mask_p[None, :], other=0.0)
        pdl_wait(USE_PDL)
        xp = tl.load(X + t * stride_xt + offs_p, mask=mask_p, other=0.0)
        y = tl.sum(wp.to(tl.float32) * xp.to(tl.float32)[None, :], axis=1)
        k_start = PREFETCH_K
    else:
        pdl_wait(USE_PDL)
    for k0 in tl.range(k_start, K, BLOCK_K, num_stages=NUM_STAGES):
        mask_k = offs_k + k0 < K
        w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_ptrs + k0, mask=mask_k, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y += tl.sum(acc, axis=1)
    if SCALED:  # FP8 weight: each output column's weight scale
        y = y * tl.load(WS + offs_n, mask=mask_n, other=0.0)
    if HAS_BIAS:
        y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Out + t * stride_ot + offs_n, y.to(Out.dtype.element_ty), mask=mask_n)


def gemv_config(n: int, k: int, prefetch: bool = False) -> dict:
    """Launch settings for an [N, K] weight: BLOCK_N, BLOCK_K, NUM_STAGES, num_warps, PREFETCH_K.

    From the sweep of `benchmarks/bench_gemv.py --sweep` (one token row): below 4096 outputs the
    narrowest tiles with the longest K chunks won (4 x 512, 2 warps: more programs for the few
    rows), above it 8 x 256 (within 4% of each shape's best). `prefetch` (a static weight launched
    with PDL): PREFETCH_K columns of each program's rows are read before the grid-dependency wait —
    up to 2048 at 4 rows per program (64 bf16 registers per thread at 2 warps), 1024 at 8 — and the
    rest in the loop."""
    if n < 4096:
        block_n, block_k = 4, 512
    else:
        block_n, block_k = 8, 256
    block_k = min(block_k, triton.next_power_of_2(max(k, 16)))
    prefetch_k = 0
    if prefetch:
        prefetch_k = min(2048 if block_n == 4 else 1024, triton.next_power_of_2(max(k, 16)))
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "NUM_STAGES": 4, "num_warps": 2,
            "PREFETCH_K": prefetch_k}


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None, config: dict | None = None,
         static_weight: bool = False, w_scale: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out = x @ weight.T (+ bias), math in fp32, one rounding to the output dtype.

    Weight-only FP8 (the dynamic FP8 linear at one token row): a float x (fp32 / bf16 / fp16)
    and a float8_e4m3fn weight with w_scale [1, N] (or [N]) float32: out[t, n] =
    (sum_k x[t, k] w[n, k]) * w_scale[n], half the weight bytes of bf16.

    Args:
        x: [T, K] float (T small: every row re-reads the weight), last dim contiguous.
        weight: [N, K] of x's dtype, fp32 (then the output is fp32), or float8_e4m3fn
            (weight-only FP8); last dim contiguous (any row stride).
        w_scale: the FP8 weight's column scales (required with an FP8 weight, refused
            otherwise).
        out_dtype: FP8 weight only: the output dtype (default x's dtype).
        bias: optional [N].
        out: optional [T, N] destination of the output dtype, last dim contiguous.
        config: launch settings (`gemv_config`'s keys) instead of `gemv_config(N, K, ...)`.
        static_weight: the caller guarantees that no kernel writes `weight` (or `bias`) while
            this one may run (a model parameter). Then, on a device with programmatic dependent
            launch (`pdl.use_pdl`), the kernel is launched with PDL and reads the first part of
            the weight before waiting for the kernel in front (mla_kernels/pdl.py). Otherwise the
            kernel runs in plain stream order.
    Returns:
        out, or a new [T, N] tensor.
    Raises:
        ValueError: shapes or dtypes disagree, or a last dim is strided.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: need [T, K] "
                         "and [N, K]")
    t, k = x.shape
    n = weight.shape[0]
    fp8 = weight.dtype == torch.float8_e4m3fn
    if x.dtype == torch.float8_e4m3fn or (x.dtype != weight.dtype
                                          and weight.dtype != torch.float32 and not fp8):
        raise ValueError(f"x is {x.dtype}, weight {weight.dtype} (a float x; a weight of x's "
                         "dtype, fp32 or float8_e4m3fn)")
    if fp8:
        if (w_scale is None or w_scale.dtype != torch.float32 or w_scale.numel() != n
                or not w_scale.is_contiguous()):
            raise ValueError(f"an FP8 weight needs a contiguous float32 w_scale [1, {n}]")
        out_dtype = out_dtype or x.dtype
    elif w_scale is not None or out_dtype is not None:
        raise ValueError("w_scale and out_dtype are for an FP8 weight only")
    else:
        out_dtype = weight.dtype if weight.dtype == torch.float32 else x.dtype
    if (t and k and x.stride(1) != 1) or (n and k and weight.stride(1) != 1):
        raise ValueError("x and weight must have contiguous last dims")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if out is None:
        out = torch.empty((t, n), dtype=out_dtype, device=x.device)
    if tuple(out.shape) != (t, n) or out.dtype != out_dtype or (t and n and out.stride(1) != 1):
        raise ValueError(f"out must be [{t}, {n}] {out_dtype} with a contiguous last dim")
    if t == 0 or n == 0:
        return out
    pdl = static_weight and use_pdl(x)
    cfg = dict(config or gemv_config(n, k, prefetch=pdl))
    prefetch_k = cfg.get("PREFETCH_K", 0)  # also without PDL when a config asks (tests)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), t)
    _gemv_kernel[grid](x, weight, bias if bias is not None else weight, out, w_scale,
                       n, k, x.stride(0), weight.stride(0), out.stride(0),
                       HAS_BIAS=bias is not None, BLOCK_N=cfg["BLOCK_N"],
                       BLOCK_K=cfg["BLOCK_K"], NUM_STAGES=cfg["NUM_STAGES"],
                       PREFETCH_K=prefetch_k, SCALED=fp8, num_warps=cfg["num_warps"],
                       **launch_options(pdl))
    return out


__all__ = ["gemv", "gemv_config"]
