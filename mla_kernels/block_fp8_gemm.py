"""Block-scaled FP8 GEMM (DeepSeek-V3's block-wise FP8 linear layers) and its torch helpers.

Format (DeepSeek-V3 `config.json` `quantization_config` = {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}; DeepSeek-V3 `inference/
kernel.py` (`weight_dequant`, `act_quant`, `fp8_gemm`), transformers' FineGrainedFP8 and SGLang's
`w8a8_block_fp8_matmul` implement the same math):

- weight `B` float8_e4m3fn [N, K] with `weight_scale_inv` float32 [ceil(N/bn), ceil(K/bk)]:
  the real weight is W[n, k] = B[n, k] * scale_inv[n // bn, k // bk] (ragged last blocks allowed);
- activations quantized dynamically per token per group of `bk` columns:
  scale[m, g] = amax(|x[m, g*bk:(g+1)*bk]|) / 448, A = x / scale saturated to [-448, 448] in e4m3.

Owns `block_fp8_matmul` (the triton kernel launch), `per_token_group_quant_fp8` (activation
quantization, torch), `quant_weight_block_fp8` / `dequant_weight_block_fp8` (torch; checkpoint
makers and load-time dequantization). Float32 twin: `reference.block_fp8_matmul_ref`. Callers:
`mla_backend.layers.linear.BlockFP8LinearMethod` (A = activations [M, K], B = the layer's weight).

Quantization is done in torch, not in a kernel: triton's interpreter (CPU tests) rounds float ->
fp8 wrongly for a few percent of values; its fp8 loads are exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_SCALE_EPS = 1e-10  # amax floor: an all-zero group gets a tiny scale, never 0 (no 0/0)


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int = 128
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group FP8 (e4m3) quantization of activations, in torch.

    Args:
        x: [..., K] any float dtype. K need not be a multiple of group_size (the last group is
            shorter).
        group_size: columns per group (the weight's block size along K, 128 in DeepSeek-V3).
    Returns:
        (x_q float8_e4m3fn [..., K], scale float32 [..., ceil(K / group_size)]) with
        x ~= x_q * scale per group; scale = max(amax, 1e-10) / 448. Values saturate at +-448
        (an infinite input gives +-448 with the largest finite scale), never NaN (unless x has
        NaN).
    Raises:
        ValueError: group_size < 1.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    k = x.shape[-1]
    groups = triton.cdiv(k, group_size)
    xf = x.float().reshape(-1, k)
    pad = groups * group_size - k
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    xg = xf.view(-1, groups, group_size)
    amax = xg.abs().amax(dim=-1).clamp(min=_SCALE_EPS, max=torch.finfo(torch.float32).max)
    scale = amax / FP8_MAX  # [rows, groups]
    q = (xg / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(-1, groups * group_size)[:, :k]
    return (q.reshape(x.shape).contiguous(),
            scale.reshape(*x.shape[:-1], groups).contiguous())


def quant_weight_block_fp8(w: torch.Tensor, block_size: tuple[int, int] = (128, 128)
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight into DeepSeek-V3's block format (as DeepSeek's `weight_quant`).

    Args:
        w: [N, K] float weight.
        block_size: (bn, bk) block shape (`weight_block_size`).
    Returns:
        (weight float8_e4m3fn [N, K], weight_scale_inv float32 [ceil(N/bn), ceil(K/bk)]) with
        scale_inv = max(block amax, 1e-10) / 448, weight = w / scale_inv saturated.
    Raises:
        ValueError: w is not 2-D.
    """
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D, got shape {tuple(w.shape)}")
    bn, bk = block_size
    n, k = w.shape
    nb, kb = triton.cdiv(n, bn), triton.cdiv(k, bk)
    wp = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    blocks = wp.view(nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=_SCALE_EPS)  # [nb, kb]
    scale_inv = amax / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * bn, kb * bk)[:n, :k].contiguous(), scale_inv.contiguous()


def dequant_weight_block_fp8(w: torch.Tensor, scale_inv: torch.Tensor,
                             block_size: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """W[n, k] = w[n, k] * scale_inv[n // bn, k // bk] (DeepSeek's `weight_dequant`).

    Args:
        w: [N, K] float8_e4m3fn (any dtype is accepted). scale_inv: [ceil(N/bn), ceil(K/bk)].
        block_size: (bn, bk).
    Returns:
        [N, K] float32.
    Raises:
        ValueError: scale_inv has the wrong shape for (N, K) and block_size.
    """
    bn, bk = block_size
    n, k = w.shape
    expected = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv shape {tuple(scale_inv.shape)}, expected {expected} "
                         f"for a [{n}, {k}] weight in {bn}x{bk} blocks")
    s = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return w.float() * s


@triton.jit(do_not_specialize=["M"])  # one compile for every token count
def _block_fp8_matmul_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr,
    M, N, K, group_n, group_k,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_as_m, stride_as_k, stride_bs_n, stride_bs_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8_DOT: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of C = sum_k (A * a_scale) (B * b_scale)^T.

    BLOCK_K divides group_k, so every K step lies inside one scale group: the partial product
    of the step is scaled by a_scale[m, g] * b_scale[n // group_n, g] and added in fp32.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BM, BK]
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn  # [BK, BN]
    as_ptrs = as_ptr + offs_m * stride_as_m
    bs_ptrs = bs_ptr + (offs_n // group_n) * stride_bs_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & mask_n[None, :], other=0.0)
        g = k0 // group_k
        a_s = tl.load(as_ptrs + g * stride_as_k, mask=mask_m, other=0.0)
        b_s = tl.load(bs_ptrs + g * stride_bs_k, mask=mask_n, other=0.0)
        if FP8_DOT:  # fp8 x fp8 tensor-core dot (GPU, fp8 A and B)
            part = tl.dot(a, b)
        else:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        acc += part * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _block_k(group_k: int) -> int:
    """Largest power of two <= 128 that divides group_k (>= 16 for tl.dot)."""
    bk = 128
    while bk > 16 and group_k % bk:
        bk //= 2
    if group_k % bk:
        raise ValueError(f"group_k {group_k} must be a multiple of 16")
    return bk


def block_fp8_matmul(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor,
                     b_scale: torch.Tensor, block_size: tuple[int, int],
                     out_dtype: torch.dtype = torch.bfloat16,
                     fp8_dot: bool | None = None) -> torch.Tensor:
    """C[m, n] = sum_k (a[m, k] * a_scale[m, k // bk]) * (b[n, k] * b_scale[n // bn, k // bk]).

    Args:
        a: [M, K] activations: float8_e4m3fn from `per_token_group_quant_fp8`, or any float dtype
            with a_scale = 1 (activation quantization off).
        b: [N, K] float8_e4m3fn weight (row-major, the checkpoint layout).
        a_scale: [M, ceil(K / bk)] float32. b_scale: [ceil(N / bn), ceil(K / bk)] float32
            (`weight_scale_inv`; bn = 1 means one scale row per weight row).
        block_size: (bn, bk); bk (the scale group along K, 128 in DeepSeek-V3) must be a
            multiple of 16.
        out_dtype: C's dtype (bfloat16 / float16 / float32). Accumulation is fp32.
        fp8_dot: multiply fp8 tiles directly (tensor cores; GPU with fp8 A and B only). None:
            on for CUDA tensors when both are fp8 and the device is sm89 or newer, else the
            tiles are upcast to fp32 (the only form triton's interpreter runs).
    Returns:
        [M, N] out_dtype on a's device.
    Raises:
        ValueError: mismatched shapes, a non-2-D operand, or a bk that is not a multiple of 16.
    """
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    m, k = a.shape
    n, kb_ = b.shape
    if k != kb_:
        raise ValueError(f"K mismatch: a {tuple(a.shape)} vs b {tuple(b.shape)}")
    bn, bk = block_size
    groups = triton.cdiv(k, bk)
    if tuple(a_scale.shape) != (m, groups):
        raise ValueError(f"a_scale shape {tuple(a_scale.shape)}, expected {(m, groups)}")
    if tuple(b_scale.shape) != (triton.cdiv(n, bn), groups):
        raise ValueError(f"b_scale shape {tuple(b_scale.shape)}, expected "
                         f"{(triton.cdiv(n, bn), groups)}")
    block_k = _block_k(bk)
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_()
    both_fp8 = a.dtype == FP8_DTYPE and b.dtype == FP8_DTYPE
    if fp8_dot is None:
        fp8_dot = (both_fp8 and a.is_cuda
                   and torch.cuda.get_device_capability(a.device) >= (8, 9))
    if fp8_dot and not both_fp8:
        raise ValueError("fp8_dot needs float8_e4m3fn a and b")
    if a.is_cuda:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        block_n, warps, stages = 128, 4, 3
    else:  # interpreter: its cost is per program and op, so few large tiles (masks still hit)
        block_m, block_n, warps, stages = 32, 128, 4, 1
    a_scale = a_scale.float()
    b_scale = b_scale.float()
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _block_fp8_matmul_kernel[grid](
        a, b, c, a_scale, b_scale, m, n, k, bn, bk,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP8_DOT=bool(fp8_dot),
        num_warps=warps, num_stages=stages,
    )
    return c


__all__ = ["FP8_DTYPE", "FP8_MAX", "block_fp8_matmul", "dequant_weight_block_fp8",
           "per_token_group_quant_fp8", "quant_weight_block_fp8"]
