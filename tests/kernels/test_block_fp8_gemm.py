"""Block-scaled FP8 GEMM (`mla_kernels.block_fp8_gemm`) vs its fp32 twin
`reference.block_fp8_matmul_ref`, and the torch quantization helpers.

CPU (CI): the kernel runs under TRITON_INTERPRET=1 (fp8 tiles upcast to fp32; the interpreter
reads fp8 exactly). Shapes sweep M = 1, odd M, M across tiles; N and K not multiples of 128
(ragged last weight blocks and activation groups); block sizes (128, 128) as DeepSeek-V3, a
row-expanded scale (bn = 1, what merged linears use) and small blocks. Tolerance: both sides
multiply the same fp8 values by the same scales, only the kernel's fp32 summation order differs
from the float64 reference: |diff| <= 1e-5 * (max |ref| + |ref|) (observed <= ~2e-6 relative to
max |ref|; the weight rows span 4 decades so a wrong block scale is far outside).
GPU (`gpu` marker): the fp8 tensor-core dot (fp8_dot) against the same reference.
"""

from __future__ import annotations

import pytest
import torch

from mla_kernels.block_fp8_gemm import (
    FP8_MAX,
    block_fp8_matmul,
    dequant_weight_block_fp8,
    per_token_group_quant_fp8,
    quant_weight_block_fp8,
)
from mla_kernels.reference import block_fp8_matmul_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    """|out - ref| <= rel * (max |ref| + |ref|), ref float64."""
    out, ref = out.cpu().double(), ref.cpu().double()
    assert out.shape == ref.shape
    bound = rel * (ref.abs().max() + ref.abs())
    worst = ((out - ref).abs() / bound).max().item()
    assert worst <= 1.0, f"{worst:.2f} x the bound"


def _ref(xq, wq, xs, ws, block):
    return block_fp8_matmul_ref(xq.cpu(), wq.cpu(), xs.cpu().double(), ws.cpu().double(), block)


def _problem(m: int, n: int, k: int, block: tuple[int, int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    w = torch.randn(n, k, generator=g) / k ** 0.5
    # blocks of very different magnitude, so a wrong scale index shows
    w = w * torch.logspace(-2, 2, n).unsqueeze(1)
    wq, ws = quant_weight_block_fp8(w, block)
    xq, xs = per_token_group_quant_fp8(x, block[1])
    return x, w, wq.to(DEV), ws.to(DEV), xq.to(DEV), xs.to(DEV)


@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("n,k", [(128, 128), (200, 300), (70, 96), (257, 384)])
def test_matches_reference_deepseek_blocks(m, n, k):
    _, _, wq, ws, xq, xs = _problem(m, n, k, (128, 128), seed=m * 1000 + n + k)
    out = block_fp8_matmul(xq, wq, xs, ws, (128, 128), out_dtype=torch.float32)
    assert out.shape == (m, n) and out.dtype == torch.float32
    _assert_close(out, _ref(xq, wq, xs, ws, (128, 128)))


@pytest.mark.parametrize("block", [(1, 128), (32, 32), (64, 16), (128, 64)])
@pytest.mark.parametrize("m,n,k", [(5, 90, 100), (16, 64, 130)])
def test_matches_reference_other_blocks(block, m, n, k):
    _, _, wq, ws, xq, xs = _problem(m, n, k, block, seed=sum(block) + m)
    out = block_fp8_matmul(xq, wq, xs, ws, block, out_dtype=torch.float32)
    _assert_close(out, _ref(xq, wq, xs, ws, block))


def test_unquantized_activations_and_bf16_output():
    """Activation quantization off: fp32 A with unit scales = x @ dequantized(W)^T."""
    x, _, wq, ws, _, _ = _problem(9, 150, 200, (128, 128), seed=3)
    ones = torch.ones(9, 2, device=DEV)
    out = block_fp8_matmul(x.to(DEV), wq, ones, ws, (128, 128), out_dtype=torch.float32)
    exact = x.double() @ dequant_weight_block_fp8(wq.cpu(), ws.cpu()).double().T
    _assert_close(out, exact)
    out16 = block_fp8_matmul(x.to(DEV), wq, ones, ws, (128, 128), out_dtype=torch.bfloat16)
    assert out16.dtype == torch.bfloat16
    _assert_close(out16.float(), exact, rel=2 ** -8)


def test_quantized_gemm_close_to_exact_product():
    """FP8 (weights and activations) vs the unquantized fp32 product: e4m3's 3 mantissa bits
    give ~2-3% relative error per element; the product's relative RMS error stays < 5%."""
    x, w, wq, ws, xq, xs = _problem(12, 256, 384, (128, 128), seed=4)
    out = block_fp8_matmul(xq, wq, xs, ws, (128, 128), out_dtype=torch.float32).cpu()
    exact = x @ w.T
    rel = ((out - exact).norm() / exact.norm()).item()
    assert rel < 0.05, rel


def test_ignoring_weight_scales_is_detected():
    _, _, wq, ws, xq, xs = _problem(4, 128, 256, (128, 128), seed=5)
    good = block_fp8_matmul(xq, wq, xs, ws, (128, 128), out_dtype=torch.float32)
    bad = block_fp8_matmul(xq, wq, xs, torch.ones_like(ws), (128, 128), out_dtype=torch.float32)
    assert (bad - good).abs().max() > 100 * good.abs().max() * 1e-3


def test_empty_and_bad_shapes():
    wq, ws = quant_weight_block_fp8(torch.randn(64, 128), (128, 128))
    xq, xs = per_token_group_quant_fp8(torch.randn(0, 128), 128)
    assert block_fp8_matmul(xq.to(DEV), wq.to(DEV), xs.to(DEV), ws.to(DEV),
                            (128, 128)).shape == (0, 64)
    xq, xs = per_token_group_quant_fp8(torch.randn(3, 128), 128)
    with pytest.raises(ValueError, match="b_scale"):
        block_fp8_matmul(xq, wq, xs, torch.ones(2, 1), (128, 128))
    with pytest.raises(ValueError, match="a_scale"):
        block_fp8_matmul(xq, wq, xs[:, :0], ws, (128, 128))
    with pytest.raises(ValueError, match="K mismatch"):
        block_fp8_matmul(xq[:, :64], wq, xs, ws, (128, 128))
    with pytest.raises(ValueError, match="multiple of 16"):
        block_fp8_matmul(xq, wq, torch.ones(3, 13), torch.ones(64, 13), (1, 10))


# ------------------------------------------------------------------ torch quantization helpers
@pytest.mark.parametrize("k,group", [(128, 128), (300, 128), (7, 128), (96, 32)])
def test_per_token_group_quant_definition(k, group):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(2, 3, k, generator=g) * torch.logspace(-3, 3, k)
    q, s = per_token_group_quant_fp8(x, group)
    groups = -(-k // group)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (2, 3, groups)
    for gi in range(groups):
        blk = x[..., gi * group:(gi + 1) * group]
        torch.testing.assert_close(s[..., gi], blk.abs().amax(-1) / FP8_MAX)
        deq = q[..., gi * group:(gi + 1) * group].float() * s[..., gi:gi + 1]
        # e4m3 rounding: relative error <= 2^-4 for normal values, absolute <= scale * 2^-9 near 0
        bound = blk.abs() * 2 ** -4 + s[..., gi:gi + 1] * 2 ** -9 + 1e-12
        assert ((deq - blk).abs() <= bound).all()
    # the largest element of each group maps to exactly +-448
    assert q.float().abs().amax() == FP8_MAX


def test_per_token_group_quant_saturates_never_nan():
    x = torch.tensor([[0.0] * 4 + [1e30, -1e38, float("inf"), float("-inf")],
                      [0.0] * 8])
    q, s = per_token_group_quant_fp8(x, 4)
    assert not torch.isnan(q.float()).any() and not torch.isnan(s).any()
    assert torch.isfinite(s).all() and (s > 0).all()  # all-zero groups: tiny positive scale
    assert q[0, 6].float() == FP8_MAX and q[0, 7].float() == -FP8_MAX
    assert (q[1].float() == 0).all() and (q[0, :4].float() == 0).all()
    # bf16 input works the same (math in fp32)
    qb, sb = per_token_group_quant_fp8(torch.randn(5, 64).bfloat16(), 32)
    assert qb.dtype == torch.float8_e4m3fn and sb.shape == (5, 2)


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((200, 130), (128, 128)),
                                         ((5, 7), (128, 128)), ((96, 64), (32, 16))])
def test_weight_block_quant_round_trip(shape, block):
    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(*shape, generator=g) * torch.logspace(-2, 2, shape[0]).unsqueeze(1)
    wq, s = quant_weight_block_fp8(w, block)
    nb, kb = -(-shape[0] // block[0]), -(-shape[1] // block[1])
    assert wq.dtype == torch.float8_e4m3fn and wq.shape == w.shape and s.shape == (nb, kb)
    assert s[0, 0] == w[: block[0], : block[1]].abs().max() / FP8_MAX
    deq = dequant_weight_block_fp8(wq, s, block)
    full = s.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]
    assert ((deq - w).abs() <= w.abs() * 2 ** -4 + full * 2 ** -9).all()
    with pytest.raises(ValueError, match="weight_scale_inv shape"):
        dequant_weight_block_fp8(wq, s[:, :0], block)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m,n,k", [(1, 7168, 2048), (37, 576, 7168), (256, 1536, 7168)])
def test_gpu_fp8_dot_matches_reference(m, n, k):
    _, _, wq, ws, xq, xs = _problem(m, n, k, (128, 128), seed=m)
    for fp8_dot in (True, False):
        out = block_fp8_matmul(xq, wq, xs, ws, (128, 128), out_dtype=torch.float32,
                               fp8_dot=fp8_dot)
        _assert_close(out, _ref(xq, wq, xs, ws, (128, 128)), rel=1e-4)
