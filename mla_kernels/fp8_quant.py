"""FP8 (e4m3) activation quantization on the GPU, no host sync: per tensor (dynamic or static)
in two triton launches, per token (dynamic) in one.

Owns `quantize_fp8` (per tensor, what `layers.quantization.quantize_fp8_per_tensor` runs on
CUDA), `quantize_fp8_per_token` (one scale per row, one launch), `quantize_per_token` (that
kernel on CUDA, the same math in torch elsewhere; called by every dynamic FP8 linear and the FP8
MoE), `fp8_amax_partials` (the amax pass alone, for `bmm_fp8`) and the jit helpers
`_scale_from_partials` / `_to_e4m3` that `bmm_fp8` shares. Float32 twins:
`reference.quantize_fp8_ref`, `reference.quantize_fp8_per_token_ref`.

Math: scale = max(amax(|x|) / 448, 1e-12) (`MIN_SCALE`), q = e4m3(clamp(x / scale, -448, 448)),
round to nearest even, IEEE divisions (`div_rn`): bit for bit torch's CPU result (torch on CUDA
multiplies by 1/448, so its scale can differ in the last bit). Per token, q = e4m3(x * (1 /
scale)) with the reciprocal rounded once, as torch computes `x * (1 / scale)`: a division per
element made the kernel compute-bound. The two differ by one step only near an e4m3 tie.

Per tensor: `_amax_partials_kernel` writes max |x| of each program's blocks to partials[G]
(float32), then `_quant_kernel` reduces them to the scale and quantizes (a static scale skips
the first launch). x may be contiguous or strided with at most 3 dims; other layouts are copied.
NaN: on CUDA the amax ignores NaN and NaN quantizes to NaN (in torch it makes everything NaN).
The interpreter converts float32 -> fp8 wrongly for some values, so there (`EXACT=True`) values
are rounded to e4m3 in float32 first; NaN there gives an unspecified value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_SCALE = 1e-12  # floor of a dynamic scale (== mla_backend.layers.quantization._MIN_SCALE)
MAX_PARTIALS = 1024  # programs of both launches, so the partials every program reduces
_BLOCK = 1024  # elements per block


@triton.jit
def _to_e4m3(v, EXACT: tl.constexpr):
    """float32 v -> float8e4nv: saturate to +-448, round to nearest even.

    EXACT (interpreter): round in float32 first (normal range by mantissa bits, the subnormal
    range 2^-9 steps by the 2^23 trick) so the interpreter's cast only sees e4m3 values."""
    v = tl.minimum(tl.maximum(v, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0,
                   propagate_nan=tl.PropagateNan.ALL)
    if EXACT:
        bits = v.to(tl.int32, bitcast=True)
        sign = bits & -2147483648
        mag = bits & 0x7FFFFFFF
        a = mag.to(tl.float32, bitcast=True)
        normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & -1048576  # keep 3 mantissa bits, RTNE
        sub = ((a * 512.0 + 8388608.0) - 8388608.0) * 0.001953125  # multiple of 2^-9, RTNE
        r = tl.where(a < 0.015625, sub.to(tl.int32, bitcast=True), normal) | sign
        v = r.to(tl.float32, bitcast=True)
    return v.to(tl.float8e4nv)


@triton.jit
def _scale_from_partials(part_ptr, n_parts, BLOCK_P: tl.constexpr):
    """max(max(partials[:n_parts]) / 448, 1e-12) as a float32 scalar."""
    offs = tl.arange(0, BLOCK_P)
    p = tl.load(part_ptr + offs, mask=offs < n_parts, other=0.0)
    return tl.maximum(tl.math.div_rn(tl.max(p, axis=0), 448.0), 1e-12)


@triton.jit
def _addr(offs, D1, D2, s0, s1, s2, CONTIG: tl.constexpr):
    """Element offsets (int64) of flat indices `offs` of a [D0, D1, D2] view with strides."""
    if CONTIG:
        return offs
    i2 = offs % D2
    t = offs // D2
    return (t // D1) * s0 + (t % D1) * s1 + i2 * s2


# Sizes and strides vary with the token count: not specialized, so one compile serves them all.
# (D1, D2 as compile-time constants made a strided amax several times slower.)
@triton.jit(do_not_specialize=["numel", "D1", "D2", "s0", "s1", "s2"])
def _amax_partials_kernel(x_ptr, part_ptr, numel, D1, D2, s0, s1, s2,
                          BLOCK: tl.constexpr, CONTIG: tl.constexpr):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(pid.to(tl.int64) * BLOCK, numel, n_prog.to(tl.int64) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + _addr(offs, D1, D2, s0, s1, s2, CONTIG), mask=offs < numel,
                    other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    tl.store(part_ptr + pid, tl.max(acc, axis=0))


@triton.jit(do_not_specialize=["numel", "n_parts", "D1", "D2", "s0", "s1", "s2"])
def _quant_kernel(x_ptr, q_ptr, part_ptr, scale_ptr, numel, n_parts, D1, D2, s0, s1, s2,
                  BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, STATIC: tl.constexpr,
                  CONTIG: tl.constexpr, EXACT: tl.constexpr):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    if STATIC:
        scale = tl.load(scale_ptr)
    else:
        scale = _scale_from_partials(part_ptr, n_parts, BLOCK_P)
        if pid == 0:
            tl.store(scale_ptr, scale)
    for start in range(pid.to(tl.int64) * BLOCK, numel, n_prog.to(tl.int64) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < numel
        x = tl.load(x_ptr + _addr(offs, D1, D2, s0, s1, s2, CONTIG), mask=mask, other=0.0)
        q = _to_e4m3(tl.math.div_rn(x.to(tl.float32), scale), EXACT)
        tl.store(q_ptr + offs, q, mask=mask)


@triton.jit
def _quantize_row(x, EXACT: tl.constexpr):
    """One row held whole in registers (float32, masked entries 0) -> (e4m3 row, its scale
    max(amax / 448, 1e-12)), the row times the IEEE-rounded reciprocal of its scale: the
    per-token quantization every kernel that writes FP8 rows shares (`_per_token_quant_kernel`,
    and the `fp8_out` of `rmsnorm` and `silu_and_mul`), so their results agree bit for bit."""
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), 448.0), 1e-12)
    return _to_e4m3(x * tl.math.div_rn(1.0, scale), EXACT), scale


def check_per_token_pair(q: torch.Tensor, scale: torch.Tensor, m: int, k: int,
                         what: str) -> None:
    """Raises ValueError (naming `what`) unless (q, scale) can hold [m, k] rows quantized per
    token: q float8_e4m3fn [m, k] with a contiguous last dim, scale float32 [m, 1] contiguous.
    Shapes only: no device read (safe in CUDA graphs)."""
    if (q.dtype != FP8_DTYPE or tuple(q.shape) != (m, k) or (m and k and q.stride(1) != 1)
            or scale.dtype != torch.float32 or tuple(scale.shape) != (m, 1)
            or not scale.is_contiguous()):
        raise ValueError(f"{what} must be (float8_e4m3fn [{m}, {k}] with a contiguous last dim, "
                         f"contiguous float32 [{m}, 1]), got {q.dtype} {tuple(q.shape)}, "
                         f"{scale.dtype} {tuple(scale.shape)}")


# The row count varies with the batch: not specialized. The row strides (K for a contiguous
# x, fixed per layer) stay specialized, so triton may prove rows 16-byte aligned and vectorize.
@triton.jit(do_not_specialize=["M"])
def _per_token_quant_kernel(x_ptr, q_ptr, scale_ptr, M, K, stride_xm, stride_xk, stride_qm,
                      BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, EXACT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK)
    if ONE_BLOCK:  # the whole row in registers: one read
        mask = offs < K
        x = tl.load(x_row + offs.to(tl.int64) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        q, scale = _quantize_row(x, EXACT)
        tl.store(q_row + offs, q, mask=mask)
    else:  # amax over the row, then quantize it (the second read mostly hits L2)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, K, BLOCK):
            o = start + offs
            x = tl.load(x_row + o.to(tl.int64) * stride_xk, mask=o < K, other=0.0)
            acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.math.div_rn(tl.max(acc, axis=0), 448.0), 1e-12)
        inv = tl.math.div_rn(1.0, scale)
        for start in range(0, K, BLOCK):
            o = start + offs
            x = tl.load(x_row + o.to(tl.int64) * stride_xk, mask=o < K, other=0.0)
            tl.store(q_row + o, _to_e4m3(x.to(tl.float32) * inv, EXACT), mask=o < K)
    tl.store(scale_ptr + row, scale)


PER_TOKEN_MAX_BLOCK = 4096  # columns a program holds at once; longer rows take two passes


def _view3(x: torch.Tensor) -> tuple[torch.Tensor, bool, tuple[int, int], tuple[int, int, int]]:
    """(x or a contiguous copy, contiguous?, (D1, D2), strides (s0, s1, s2))."""
    if not x.is_contiguous() and x.dim() > 3:
        x = x.contiguous()
    if x.is_contiguous():
        return x, True, (1, 1), (0, 0, 1)
    shape = [1] * (3 - x.dim()) + list(x.shape)
    strides = [0] * (3 - x.dim()) + list(x.stride())
    return x, False, (shape[1], shape[2]), (strides[0], strides[1], strides[2])


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(x: torch.Tensor) -> None:
    if x.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"x must be float32/bfloat16/float16, got {x.dtype}")


def _dense_order(x: torch.Tensor) -> torch.Tensor:
    """x with its dims permuted by decreasing stride (size-1 dims first): contiguous when x
    is a permutation of a contiguous tensor (e.g. a [T, H, D] buffer viewed as [H, T, D]).
    The order of elements does not change a max, so the amax pass reads that instead: flat,
    without strided index arithmetic, several times faster for absorbed MLA's o [16, T, 512]
    viewed from [T, 16, 512] (benchmarks/bench_fp8_amax.py)."""
    order = sorted(range(x.dim()), key=lambda d: (x.shape[d] != 1, -x.stride(d)))
    return x.permute(order)


def fp8_amax_partials(x: torch.Tensor) -> torch.Tensor:
    """Launch 1 alone: per-program max |x| partials.

    Args:
        x: float32 / bfloat16 / float16, any shape (strided up to 3 dims).
    Returns:
        float32 [G], 1 <= G <= MAX_PARTIALS (G = 1 holding 0 for an empty x); the dynamic scale
        is max(max(partials) / 448, 1e-12) (`_scale_from_partials`).
    Raises:
        TypeError: another dtype.
    """
    _check(x)
    if not x.is_contiguous():
        dense = _dense_order(x)
        x = dense if dense.is_contiguous() else x  # memory order: no strided addressing
    x, contig, (d1, d2), (s0, s1, s2) = _view3(x)
    numel = x.numel()
    g = max(1, min(triton.cdiv(numel, _BLOCK), MAX_PARTIALS))
    part = torch.empty(g, dtype=torch.float32, device=x.device)
    if numel == 0:
        return part.zero_()
    _amax_partials_kernel[(g,)](x, part, numel, d1, d2, s0, s1, s2, BLOCK=_BLOCK,
                                CONTIG=contig, num_warps=4)
    return part


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Saturating per-tensor e4m3 quantization in two launches (one with a static scale).

    Args:
        x: float32 / bfloat16 / float16, any shape (contiguous, or strided with <= 3 dims; other
            layouts are copied).
        scale: static float32 scale (one element, on x's device), or None = dynamic
            max(amax(|x|) / 448, 1e-12).
    Returns:
        (q float8_e4m3fn contiguous with x's shape, q * scale ~ x, |q| <= 448;
         scale float32 0-dim on x's device: the dynamic scale, or `scale` reshaped).
    Raises:
        TypeError: x of another dtype. ValueError: a static scale with more than one element.
    """
    _check(x)
    shape = x.shape
    x, contig, (d1, d2), (s0, s1, s2) = _view3(x)
    numel = x.numel()
    q = torch.empty(shape, dtype=FP8_DTYPE, device=x.device)
    if scale is not None:
        if scale.numel() != 1:
            raise ValueError(f"static scale must have one element, got {tuple(scale.shape)}")
        scale = scale.to(device=x.device, dtype=torch.float32).reshape(())
        part = scale  # unused
    else:
        part = fp8_amax_partials(x)
        scale = torch.empty((), dtype=torch.float32, device=x.device)
        if numel == 0:
            return q, scale.fill_(MIN_SCALE)
    if numel == 0:
        return q, scale
    g = max(1, min(triton.cdiv(numel, _BLOCK), MAX_PARTIALS))
    _quant_kernel[(g,)](x, q, part, scale, numel, part.numel(), d1, d2, s0, s1, s2,
                        BLOCK=_BLOCK, BLOCK_P=MAX_PARTIALS, STATIC=part is scale,
                        CONTIG=contig, EXACT=not x.is_cuda, num_warps=4)
    return q, scale


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Saturating dynamic e4m3 quantization with one scale per row, in one launch.

    Args:
        x: [M, K] float32 / bfloat16 / float16, any strides.
    Returns:
        (q float8_e4m3fn [M, K] contiguous, q[m] * scale[m] ~ x[m], |q| <= 448;
         scale float32 [M, 1] contiguous, scale[m] = max(amax(|x[m]|) / 448, 1e-12)).
    Raises:
        TypeError: x of another dtype. ValueError: x not 2-D.
    """
    _check(x)
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8_per_token: x must be [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    if k == 0:
        return q, scale.fill_(MIN_SCALE)
    block = min(triton.next_power_of_2(k), PER_TOKEN_MAX_BLOCK)
    # 2 warps per 2,048 columns: for bf16 rows of 1,408 and 2,048 columns, 512 to 36,864 rows,
    # as fast as or faster than 4 (bench_fp8_epilogue.py)
    _per_token_quant_kernel[(m,)](x, q, scale, m, k, x.stride(0), x.stride(1), q.stride(0),
                            BLOCK=block, ONE_BLOCK=block >= k, EXACT=not x.is_cuda,
                            num_warps=max(1, min(8, block // 1024)))
    return q, scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_per_token`'s result for any x [M, K] float (any strides, any device): the
    kernel on CUDA (float32/bf16/fp16, outside torch.compile), else the same math in torch (the
    CPU engine, and what torch.compile traces): x times the reciprocal of its row's scale. Bit
    for bit the kernel's on the CPU; torch on CUDA multiplies by 1/448 instead of dividing for
    the scale, which can differ in the last bit."""
    if x.is_cuda and x.dtype in _KERNEL_DTYPES and not torch.compiler.is_compiling():
        return quantize_fp8_per_token(x)
    xf = x.float()
    if xf.shape[1] == 0:
        return xf.to(FP8_DTYPE), xf.new_full((xf.shape[0], 1), MIN_SCALE)
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (xf * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


__all__ = ["FP8_DTYPE", "FP8_MAX", "MAX_PARTIALS", "MIN_SCALE", "PER_TOKEN_MAX_BLOCK",
           "fp8_amax_partials", "quantize_fp8", "quantize_fp8_per_token", "quantize_per_token"]
