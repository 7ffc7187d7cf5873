"""`fp8_quant.quantize_fp8` (two-launch per-tensor e4m3 quantization),
`fp8_quant.quantize_fp8_per_token` (one launch, one scale per row) and `bmm_fp8.bmm_fp8`
(batched FP8 GEMM quantizing x on load) against their float32 twins in `reference`.

Tolerances:
- quantization (alone, and inside the GEMM with identity weights, where every output is one
  product): bit-exact; the interpreter rounds to e4m3 in float32 arithmetic (`_to_e4m3`).
- the GEMM in float32: |y - ref| <= 2 (K + 2) 2^-24 (|q| @ |w|) * x_scale * w_scale (+ 1e-30),
  the standard bound on two float32 sums of the same exact products in different orders
  (fp8 x fp8 products are exact in float32) plus the rounding of the final scaling. Measured
  differences are ~1e-7 relative to max |ref|.
- bf16 output: the bound above plus 2^-7 |ref|: triton's interpreter truncates float32 -> bf16
  (no rounding: an error below one bf16 ulp, 2^-7 relative); GPUs round (half of that).
GPU (`gpu` marker): bf16 inputs, engine-sized shapes. Hopper's fp8 tensor cores add within
each 128-deep K chunk at reduced precision (the kernel promotes to fp32 between chunks), with
errors seen up to about 4.5e-4 of max |ref|, so the float32 bound there is 1e-3 of max |ref|.
"""

from __future__ import annotations

import pytest
import torch

from mla_backend.layers import quantization as Q
from mla_kernels import fp8_quant
from mla_kernels.bmm_fp8 import bmm_fp8
from mla_kernels.fp8_quant import (FP8_DTYPE, quantize_fp8, quantize_fp8_per_token,
                                   quantize_per_token)
from mla_kernels.reference import bmm_fp8_ref, quantize_fp8_per_token_ref, quantize_fp8_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: kernels in the interpreter
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8).cpu()


def _twin(x: torch.Tensor, scale: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_ref` on the CPU, where torch divides by 448 as the kernels do (IEEE); on
    CUDA torch multiplies by the reciprocal, which can change the scale's last bit."""
    return quantize_fp8_ref(x.cpu(), None if scale is None else scale.cpu())


def _weights(h: int, k: int, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[H, K, N] fp8, column-major per head (as `quantize_fp8_bmm_weight`), + scale."""
    return Q.quantize_fp8_bmm_weight((torch.randn(h, k, n, generator=g) * 0.05).to(DEVICE))


def _check_gemm(y: torch.Tensor, x, w, ws, xs, extra_rel: float = 0.0) -> None:
    q, s = quantize_fp8_ref(x, xs)
    ref = bmm_fp8_ref(x, w, ws, xs)
    k = x.shape[-1]
    bound = 2 * (k + 2) * 2.0**-24 * torch.bmm(q.float().abs(), w.float().abs()) * s * ws
    bound = bound + extra_rel * ref.abs() + 1e-30
    err = (y.float() - ref).abs()
    assert (err <= bound).all(), f"max err {err.max():.3e} > {bound.flatten()[err.argmax()]:.3e}"


def test_constants_match_engine():
    assert fp8_quant.MIN_SCALE == Q._MIN_SCALE and fp8_quant.FP8_MAX == Q.FP8_MAX


# ---------------------------------------------------------------------------- quantize_fp8
def _layouts(g: torch.Generator):
    yield "2d", torch.randn(37, 53, generator=g)
    yield "2d-T", torch.randn(53, 37, generator=g).t()
    base = torch.randn(5, 3, 40 + 8, generator=g)  # [T, H, K+8] -> [H, T, K] strided
    yield "3d-view", base[..., :40].transpose(0, 1)
    yield "4d", torch.randn(2, 3, 4, 50, generator=g)
    yield "bf16", torch.randn(9, 130, generator=g).bfloat16()


@pytest.mark.parametrize("static", [False, True])
def test_quantize_matches_twin(static):
    g = torch.Generator().manual_seed(0)
    for name, x in _layouts(g):
        x = (x * torch.logspace(-5, 2, x.shape[-1]).to(x.dtype)).to(DEVICE)
        scale = torch.tensor(0.05, device=DEVICE) if static else None
        q, s = quantize_fp8(x, scale)
        qr, sr = _twin(x, scale)
        assert q.dtype == FP8_DTYPE and q.shape == x.shape and q.is_contiguous(), name
        assert s.dtype == torch.float32 and s.dim() == 0, name
        assert torch.equal(s.cpu(), sr), name
        assert torch.equal(_bytes(q), _bytes(qr)), name
        if static:  # the static scale saturates the largest columns
            assert (q.float().abs() == 448).any(), name


def test_quantize_ties_subnormals_saturation():
    vals = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    vals = vals[vals.isfinite()].unique()  # every finite e4m3 value, sorted
    mids = (vals[1:] + vals[:-1]) / 2  # exact ties: round to nearest even
    x = torch.cat([vals, mids, mids.nextafter(torch.tensor(0.0)), torch.tensor(
        [449.0, 464.0, 480.0, -500.0, 1e30, -1e30, 2.0**-10, -2.0**-10, 2.0**-11, -0.0])])
    x = x.to(DEVICE)
    one = torch.tensor(1.0, device=DEVICE)
    q, _ = quantize_fp8(x, one)
    qr, _ = quantize_fp8_ref(x, one)
    assert torch.equal(_bytes(q), _bytes(qr))
    assert q.float().abs().max() == 448


def test_quantize_zero_gets_floor_scale():
    x = torch.zeros(4, 33, device=DEVICE)
    q, s = quantize_fp8(x)
    _, sr = Q.quantize_fp8_per_tensor(x.cpu())  # the engine's torch path
    assert float(s) == float(sr) == float(torch.tensor(Q._MIN_SCALE))
    assert (q.float() == 0).all()


def test_quantize_grid_stride(monkeypatch):
    """More blocks than programs: every program strides over several blocks."""
    monkeypatch.setattr(fp8_quant, "_BLOCK", 32)
    monkeypatch.setattr(fp8_quant, "MAX_PARTIALS", 16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5000, generator=g)
    x[4999] = -37.0  # the amax sits in the last (partial) block
    x = x.to(DEVICE)
    assert fp8_quant.fp8_amax_partials(x).numel() == 16
    q, s = quantize_fp8(x)
    qr, sr = _twin(x)
    assert torch.equal(s.cpu(), sr) and torch.equal(_bytes(q), _bytes(qr))


def test_quantize_errors():
    with pytest.raises(TypeError):
        quantize_fp8(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError):
        quantize_fp8(torch.zeros(4), torch.ones(2))


# ---------------------------------------------------------------------------- per token
def _rows(g: torch.Generator):
    yield "2d", torch.randn(37, 53, generator=g)
    yield "2d-T", torch.randn(53, 37, generator=g).t()
    yield "col-slice", torch.randn(9, 70, generator=g)[:, 3:67]
    yield "bf16", torch.randn(9, 130, generator=g).bfloat16()
    yield "fp16", torch.randn(4, 16, generator=g).half()
    yield "one-row", torch.randn(1, 2048, generator=g)


def test_per_token_matches_twin_and_engine_path():
    g = torch.Generator().manual_seed(5)
    for name, x in _rows(g):
        # rows of very different magnitude, and one all-zero row (floor scale)
        x = x * torch.logspace(-6, 3, x.shape[0]).to(x.dtype)[:, None]
        if x.shape[0] > 2:
            x[2] = 0
        x = x.to(DEVICE)
        q, s = quantize_fp8_per_token(x)
        qr, sr = quantize_fp8_per_token_ref(x.cpu())  # CPU: torch's IEEE division by 448
        assert q.dtype == FP8_DTYPE and q.shape == x.shape and q.is_contiguous(), name
        assert s.dtype == torch.float32 and s.shape == (x.shape[0], 1), name
        assert torch.equal(s.cpu(), sr) and torch.equal(_bytes(q), _bytes(qr)), name
        qe, se = quantize_per_token(x.cpu())  # the engine's torch path
        assert torch.equal(se, sr) and torch.equal(_bytes(qe), _bytes(qr)), name


def test_per_token_ties_subnormals_saturation():
    """A row whose amax is 448 has scale 1: every e4m3 value, tie and neighbour quantizes as the
    twin's cast does (round to nearest even); a second row saturates nothing (its own scale)."""
    vals = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    vals = vals[vals.isfinite()].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    row = torch.cat([vals, mids, mids.nextafter(torch.tensor(0.0)),
                     torch.tensor([2.0**-10, -2.0**-10, 2.0**-11, -0.0])])
    x = torch.stack([row, row * 1e6])
    q, s = quantize_fp8_per_token(x.to(DEVICE))
    qr, sr = quantize_fp8_per_token_ref(x)
    assert float(s[0]) == 1.0 and torch.equal(s.cpu(), sr)
    assert torch.equal(_bytes(q), _bytes(qr))


def test_per_token_long_rows_two_passes(monkeypatch):
    """Rows longer than a program's block: the amax pass and the quantize pass both loop."""
    monkeypatch.setattr(fp8_quant, "PER_TOKEN_MAX_BLOCK", 32)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 101, generator=g)
    x[1, 100] = -37.0  # the amax in the last (partial) block
    q, s = quantize_fp8_per_token(x.to(DEVICE))
    qr, sr = quantize_fp8_per_token_ref(x)
    assert float(s[1]) == pytest.approx(37.0 / 448)
    assert torch.equal(s.cpu(), sr) and torch.equal(_bytes(q), _bytes(qr))


def test_per_token_empty_and_errors():
    q, s = quantize_fp8_per_token(torch.zeros(0, 8, device=DEVICE))
    assert q.shape == (0, 8) and s.shape == (0, 1)
    q, s = quantize_fp8_per_token(torch.zeros(3, 0, device=DEVICE))
    assert q.shape == (3, 0) and (s == fp8_quant.MIN_SCALE).all()
    with pytest.raises(TypeError):
        quantize_fp8_per_token(torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError):
        quantize_fp8_per_token(torch.zeros(2, 3, 4))


# ---------------------------------------------------------------------------- bmm_fp8
@pytest.mark.parametrize("h", [1, 3])
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("k,n", [(128, 32), (48, 64)])
@pytest.mark.parametrize("static", [False, True])
def test_bmm_matches_twin(h, m, k, n, static):
    g = torch.Generator().manual_seed(h * 100 + m * 10 + k + n)
    x = torch.randn(m, h, k + 5, generator=g)[..., :k].to(DEVICE).transpose(0, 1)  # like q_nope
    w, ws = _weights(h, k, n, g)
    xs = torch.tensor(0.004, device=DEVICE) if static else None  # static: some values saturate
    y = bmm_fp8(x, w, ws, xs)
    assert y.shape == (h, m, n) and y.dtype == torch.float32
    _check_gemm(y, x, w, ws, xs)
    if static:
        assert (quantize_fp8_ref(x, xs)[0].float().abs() == 448).any()


@pytest.mark.parametrize("static", [False, True])
def test_bmm_quantizes_on_load_exactly(static):
    """Identity weights: every output is one product, so y == q * x_scale bit for bit."""
    g = torch.Generator().manual_seed(2)
    h, m, k = 2, 9, 48
    x = (torch.randn(h, m, k, generator=g) * torch.logspace(-4, 1, k)).to(DEVICE)
    w = torch.eye(k).expand(h, k, k).to(FP8_DTYPE).to(DEVICE)
    xs = torch.tensor(0.01, device=DEVICE) if static else None
    y = bmm_fp8(x, w, torch.tensor(1.0, device=DEVICE), xs)
    q, s = _twin(x, xs)
    assert torch.equal(y.cpu(), q.float() * s)


def test_bmm_zero_and_saturation():
    g = torch.Generator().manual_seed(3)
    w, ws = _weights(2, 32, 32, g)
    y = bmm_fp8(torch.zeros(2, 5, 32, device=DEVICE), w, ws)  # floor scale, no 0/0
    assert torch.equal(y, torch.zeros_like(y))
    x = torch.randn(2, 5, 32, generator=g).to(DEVICE)
    x = torch.sign(x) * (1 + x.abs())
    small = torch.tensor(1e-3, device=DEVICE)  # every |x| / scale >= 1000 saturates
    y = bmm_fp8(x, w, ws, small)
    sat = torch.bmm(torch.sign(x) * 448, w.float()) * (small * ws)
    torch.testing.assert_close(y, sat, atol=1e-6, rtol=1e-5)
    x[0, 0, 0] = 1e30  # dynamic: huge but finite scale, finite result
    assert torch.isfinite(bmm_fp8(x, w, ws)).all()


def test_bmm_bf16_out_strides_and_weight_layout():
    """bf16 x, output into a [M, H, N] buffer (transposed view), row-major weights too."""
    g = torch.Generator().manual_seed(4)
    h, m, k, n = 3, 17, 128, 64
    x = torch.randn(m, h, k, generator=g).bfloat16().to(DEVICE).transpose(0, 1)
    w, ws = _weights(h, k, n, g)
    buf = torch.empty(m, h, n, dtype=torch.bfloat16, device=DEVICE)
    y = bmm_fp8(x, w, ws, out=buf.transpose(0, 1))
    assert y.data_ptr() == buf.data_ptr() and y.dtype == torch.bfloat16
    _check_gemm(y, x, w, ws, None, extra_rel=2.0**-7)
    y2 = bmm_fp8(x, w.contiguous(), ws, out_dtype=torch.float32)  # row-major w[h]
    _check_gemm(y2, x, w, ws, None)


def test_bmm_wrong_w_scale_is_caught():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 7, 48, generator=g).to(DEVICE)
    w, ws = _weights(2, 48, 32, g)
    ref = bmm_fp8_ref(x, w, ws)
    for bad in (torch.ones_like(ws), ws * 1.01):
        y = bmm_fp8(x, w, bad)
        assert not torch.allclose(y, ref, rtol=1e-3, atol=1e-5)


def test_bmm_errors():
    w = torch.zeros(2, 16, 16).to(FP8_DTYPE)
    one = torch.tensor(1.0)
    with pytest.raises(TypeError):
        bmm_fp8(torch.zeros(2, 3, 16), w.float(), one)
    with pytest.raises(ValueError):
        bmm_fp8(torch.zeros(2, 3, 8), w, one)
    with pytest.raises(ValueError):
        bmm_fp8(torch.zeros(2, 3, 16), w, torch.ones(2))
    with pytest.raises(ValueError):
        bmm_fp8(torch.zeros(2, 3, 16), w, one, out=torch.empty(2, 3, 8))
    assert bmm_fp8(torch.zeros(2, 0, 16), w, one).shape == (2, 0, 16)


# ---------------------------------------------------------------------------- GPU (H200)
@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("m", [1, 64, 256])
@pytest.mark.parametrize("k,n", [(128, 512), (512, 128)])
def test_gpu_bmm_bf16(m, k, n):
    g = torch.Generator().manual_seed(m + k)
    h = 16
    x = torch.randn(m, h, k + 64, generator=g).bfloat16().cuda()[..., :k].transpose(0, 1)
    wf = torch.randn(h, k, n, generator=g).cuda() * 0.05
    w, ws = Q.quantize_fp8_bmm_weight(wf)
    ref = bmm_fp8_ref(x, w, ws)
    y = bmm_fp8(x, w, ws)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=2.0**-7, atol=1e-3 * float(ref.abs().max()))
    y32 = bmm_fp8(x, w, ws, out_dtype=torch.float32)
    torch.testing.assert_close(y32, ref, rtol=0, atol=1e-3 * float(ref.abs().max()))
    eng = Q.fp8_per_tensor_bmm(x, w, ws)  # the engine's wiring (output [T, H, N] storage)
    assert eng.transpose(0, 1).is_contiguous()
    torch.testing.assert_close(eng.float(), y.float(), rtol=0, atol=0)
    ident = torch.eye(k).expand(h, k, k).to(FP8_DTYPE).cuda()  # quantization alone: exact
    one = torch.tensor(1.0, device="cuda")
    for s in (torch.tensor(0.01, device="cuda"), quantize_fp8(x)[1]):  # static; dynamic's
        q, _ = quantize_fp8_ref(x, s)
        assert torch.equal(bmm_fp8(x, ident, one, x_scale=s, out_dtype=torch.float32),
                           q.float() * s)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("k", [576, 2048, 7168, 10944, 14336])
@pytest.mark.parametrize("m", [1, 768])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_per_token_matches_cpu_twin(m, k, dtype):
    """Engine shapes on the GPU, one pass (K <= 4096) and two (K > 4096: 8 warps), against the
    CPU twin bit for bit (the kernel divides as IEEE, as torch does on the CPU)."""
    g = torch.Generator().manual_seed(k + m)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-4, 3, m)[:, None]).to(dtype)
    q, s = quantize_fp8_per_token(x.cuda())
    qr, sr = quantize_fp8_per_token_ref(x)
    assert torch.equal(s.cpu(), sr) and torch.equal(_bytes(q), _bytes(qr))


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("shape", [(1, 7168), (256, 7168), (4096, 2048), (3, 5, 700)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_quantize_matches_torch(shape, dtype):
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).cuda()
    for scale in (None, torch.tensor(0.01, device="cuda")):
        q, s = quantize_fp8(x, scale)
        _, sr = quantize_fp8_ref(x, scale)
        # torch on CUDA divides by the Python scalar 448 as a multiplication by its
        # reciprocal, the kernel divides (IEEE): the scales may differ in the last bit
        torch.testing.assert_close(s, sr, rtol=2.0 ** -22, atol=0)
        qr, _ = quantize_fp8_ref(x, s)  # with the kernel's scale: q bit for bit
        assert torch.equal(_bytes(q), _bytes(qr))
        q2, s2 = Q.quantize_fp8_per_tensor(x, scale)  # the engine's wiring
        assert torch.equal(s2, s) and torch.equal(_bytes(q2), _bytes(q))
