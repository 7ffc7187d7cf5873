"""`mla_kernels.gemv.gemv` (batch-size-1 linear) vs its twin `reference.linear_ref`, and the
dispatch of `mla_backend.layers.linear` to it.

CPU (CI): under TRITON_INTERPRET=1 (tests/kernels/conftest.py) in fp32, on small shapes that
still cross the kernel's N and K block edges. GPU (`gpu` marker): bf16 on the decode shapes of
DeepSeek-V2-Lite against fp32.
"""

from __future__ import annotations

import pytest
import torch

from mla_kernels.gemv import gemv
from mla_kernels.reference import linear_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32 = dict(atol=1e-4, rtol=1e-4)
# bf16 output vs fp32: one bf16 rounding (2^-8 relative) of sums of K products
BF16 = dict(atol=2e-2, rtol=1.6e-2)


def _rand(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


# N around the block sizes (4, 8, 16) and K around BLOCK_K, including K not a multiple of 16
@pytest.mark.parametrize("n,k", [(3, 40), (37, 300), (1024, 96), (4100, 33), (8, 512)])
@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_vs_ref(n, k, t, with_bias):
    x, w = _rand(t, k, seed=n + k), _rand(n, k, seed=n * k + 1)
    bias = _rand(n, seed=n) if with_bias else None
    out = gemv(x, w, bias)
    assert out.shape == (t, n) and out.dtype == x.dtype
    torch.testing.assert_close(out.cpu(), linear_ref(x.cpu(), w.cpu(), None if bias is None
                                                     else bias.cpu()), **FP32)


def test_gemv_strided_rows_out_and_config():
    x = _rand(2, 80, seed=1)[:, 8:72]  # row stride 80
    w = _rand(40, 96, seed=2)[:, 16:80]  # row stride 96
    out = torch.full((2, 50), 7.0, device=DEVICE)[:, 5:45]
    got = gemv(x, w, out=out, config=dict(BLOCK_N=8, BLOCK_K=32, NUM_STAGES=2, num_warps=1))
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.cpu(), linear_ref(x.cpu(), w.cpu()), **FP32)


# PREFETCH_K: the first columns read before the (PDL) grid-dependency wait, the rest in the
# loop; K below, equal to and above the prefetch width, with and without loop iterations left
@pytest.mark.parametrize("n,k,prefetch_k,block_k", [(9, 20, 32, 16), (9, 64, 64, 16),
                                                      (13, 100, 32, 16), (5, 300, 64, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_prefetch_split_vs_ref(n, k, prefetch_k, block_k, with_bias):
    x, w = _rand(2, k, seed=k), _rand(n, k, seed=n + 3)
    bias = _rand(n, seed=n) if with_bias else None
    cfg = dict(BLOCK_N=4, BLOCK_K=block_k, NUM_STAGES=2, num_warps=1, PREFETCH_K=prefetch_k)
    out = gemv(x, w, bias, config=cfg, static_weight=True)
    torch.testing.assert_close(out.cpu(), linear_ref(x.cpu(), w.cpu(), None if bias is None
                                                     else bias.cpu()), **FP32)


def test_gemv_16bit_x_fp32_weight_gives_fp32():
    # the router's case: bf16 hidden states, fp32 gate weight, fp32 logits, x never cast
    x = _rand(1, 300, seed=5, dtype=torch.bfloat16)
    w = _rand(64, 300, seed=6)
    out = gemv(x, w)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), linear_ref(x.cpu(), w.cpu()), **FP32)


def test_gemv_empty_shapes():
    w = _rand(6, 4, seed=3)
    assert gemv(torch.empty(0, 4, device=DEVICE), w).shape == (0, 6)
    b = _rand(6, seed=4)
    out = gemv(torch.empty(2, 0, device=DEVICE), torch.empty(6, 0, device=DEVICE), b)
    assert torch.equal(out.cpu(), b.cpu().expand(2, 6))


@pytest.mark.parametrize("x,w,match", [
    ((2, 4), (3, 5), "need"), ((4,), (3, 4), "need"), ((2, 4), (3, 4, 1), "need")])
def test_gemv_bad_shapes(x, w, match):
    with pytest.raises(ValueError, match=match):
        gemv(torch.zeros(x, device=DEVICE), torch.zeros(w, device=DEVICE))


def test_gemv_bad_dtype_and_strides():
    with pytest.raises(ValueError, match="weight"):
        gemv(torch.zeros(1, 4, device=DEVICE), torch.zeros(3, 4, device=DEVICE,
                                                           dtype=torch.float64))
    with pytest.raises(ValueError, match="weight"):  # a 16-bit weight needs a 16-bit x
        gemv(torch.zeros(1, 4, device=DEVICE), torch.zeros(3, 4, device=DEVICE,
                                                           dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        gemv(torch.zeros(1, 4, device=DEVICE), torch.zeros(4, 3, device=DEVICE).t())
    with pytest.raises(ValueError, match="bias"):
        gemv(torch.zeros(1, 4, device=DEVICE), torch.zeros(3, 4, device=DEVICE),
             torch.zeros(4, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(3072, 2048), (576, 2048), (5632, 2048), (2048, 2816),
                                 (102400, 2048), (2048, 10944)])
@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("static_weight", [False, True], ids=["plain", "pdl-prefetch"])
def test_gemv_bf16_on_gpu(n, k, t, static_weight):
    x = _rand(t, k, seed=k, dtype=torch.bfloat16)
    w = (0.02 * _rand(n, k, seed=n, dtype=torch.float32)).to(torch.bfloat16)
    got = gemv(x, w, static_weight=static_weight)
    torch.testing.assert_close(got.float().cpu(), linear_ref(x.cpu(), w.cpu()), **BF16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gemv_pdl_chain_in_a_cuda_graph():
    """A chain of PDL-launched gemvs, each reading the previous one's output, captured in a
    CUDA graph: every link must wait for the one in front (a missing wait reads stale x)."""
    import mla_kernels.pdl as pdl

    if not pdl.use_pdl(torch.zeros(1, device="cuda")):
        pytest.skip("no PDL on this device")
    n = 2048
    ws = [(0.022 * _rand(n, n, seed=i, dtype=torch.float32)).to(torch.bfloat16) for i in range(6)]
    x0 = _rand(1, n, seed=99, dtype=torch.bfloat16)
    bufs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in ws]

    def chain():
        x = x0
        for w, b in zip(ws, bufs):
            x = gemv(x, w, out=b, static_weight=True)
        return x

    want = x0.float().cpu()
    for w in ws:
        want = linear_ref(want.to(torch.bfloat16).float(), w.float().cpu()).to(torch.bfloat16)
    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for _ in range(3):
        for b in bufs:  # an early read would now see zeros, not last replay's values
            b.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(bufs[-1].float().cpu(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_linear_layer_dispatch_on_gpu():
    from mla_backend.layers import quantization
    from mla_backend.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(2048, 3072, bias=True).to("cuda", torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.02)
    torch.nn.init.normal_(layer.bias, std=0.1)
    for t in (1, quantization.GEMV_MAX_ROWS, quantization.GEMV_MAX_ROWS + 1):
        x = _rand(t, 2048, seed=t, dtype=torch.bfloat16)
        want = linear_ref(x.cpu(), layer.weight.detach().cpu(), layer.bias.detach().cpu())
        torch.testing.assert_close(layer(x).float().cpu(), want, **BF16)


def _fp8_weight(n: int, k: int, seed: int):
    """(w e4m3 [n, k], w_scale [1, n]) on DEVICE: a per-tensor weight scale repeated per column
    (a fused matrix's parts would differ: the last quarter of the columns gets another)."""
    g = torch.Generator().manual_seed(seed)
    wq = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = torch.full((1, n), 0.002)
    ws[:, 3 * n // 4:] = 0.0005
    return wq.to(DEVICE), ws.to(DEVICE)


@pytest.mark.parametrize("n,k,t,x_dtype", [  # both tile configs, ragged K, bf16 on CUDA
    (37, 300, 2, torch.float32), (1024, 96, 1, torch.float32), (4100, 33, 1, torch.float32),
    pytest.param(2048, 2048, 1, torch.bfloat16, marks=pytest.mark.gpu)])
def test_gemv_fp8_weight_only_vs_twin(n, k, t, x_dtype):
    """A float x with an FP8 weight (weight-only FP8: no activation quantization): the fp32
    sums of x times the exact e4m3 weights, scaled per column, equal the twin within fp32
    summation order (or one rounding to bf16), in x's dtype; the weight scales matter."""
    from mla_kernels.reference import fp8_weight_only_gemv_ref

    if x_dtype != torch.float32 and DEVICE != "cuda":
        pytest.skip("16-bit x: CUDA only")
    wq, ws = _fp8_weight(n, k, n + k + t)
    x = _rand(t, k, seed=n + t, dtype=x_dtype)
    out = gemv(x, wq, w_scale=ws)
    assert out.shape == (t, n) and out.dtype == x_dtype
    want = fp8_weight_only_gemv_ref(x.cpu(), wq.cpu(), ws.cpu())
    tol = FP32 if x_dtype == torch.float32 else BF16
    torch.testing.assert_close(out.float().cpu(), want, **tol)
    assert not torch.allclose(fp8_weight_only_gemv_ref(x.cpu(), wq.cpu(), ws.cpu() * 2),
                              want, **tol)
    out32 = gemv(x, wq, w_scale=ws, out_dtype=torch.float32)
    torch.testing.assert_close(out32.cpu(), want, **FP32 if x_dtype == torch.float32 else BF16)


def test_gemv_fp8_errors():
    wq, ws = _fp8_weight(8, 32, 0)
    x = _rand(1, 32, seed=0)
    with pytest.raises(ValueError, match="w_scale"):
        gemv(x, wq)  # the weight's scales are required
    with pytest.raises(ValueError, match="w_scale"):
        gemv(x, wq, w_scale=ws[:, :4])
    with pytest.raises(ValueError, match="a float x"):
        gemv(x.to(torch.float8_e4m3fn), wq, w_scale=ws)  # x is not quantized
    with pytest.raises(ValueError, match="FP8 weight only"):
        gemv(x, wq.float(), w_scale=ws)  # scales without an FP8 weight


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(3648, 2048), (2048, 2048), (5632, 2048), (2048, 2816),
                                 (2048, 10944)])
def test_fp8_linear_one_bf16_row_is_weight_only_on_gpu(n, k, monkeypatch):
    """`fp8_per_token_mm` at one bf16 row (decode at batch size 1; V2-Lite's FP8 linear shapes)
    launches only the weight-only gemv (no quantization of x, even with an x_fp8 at hand) and
    gives the twin's values; at two rows it quantizes x per token (torch._scaled_mm)."""
    import mla_kernels.gemv as gemv_mod

    from mla_backend.layers import quantization as Q
    from mla_kernels.fp8_quant import quantize_per_token
    from mla_kernels.reference import fp8_weight_only_gemv_ref

    wq, ws = _fp8_weight(n, k, n)
    x = _rand(2, k, seed=8, dtype=torch.bfloat16)
    calls = []
    real = gemv_mod.gemv
    monkeypatch.setattr(gemv_mod, "gemv", lambda *a, **kw: calls.append(a[0].dtype) or
                        real(*a, **kw))
    one = Q.fp8_per_token_mm(x[:1], wq.t(), ws, x_fp8=quantize_per_token(x[:1]))
    assert calls == [torch.bfloat16] and one.dtype == torch.bfloat16
    want = fp8_weight_only_gemv_ref(x[:1].cpu(), wq.cpu(), ws.cpu())
    torch.testing.assert_close(one.float().cpu(), want, **BF16)
    Q.fp8_per_token_mm(x, wq.t(), ws)
    assert calls == [torch.bfloat16]  # two rows: quantized, torch._scaled_mm


def test_pdl_override_restores_the_switch():
    """`pdl.override(on)` (benchmarks' A/B runs): off inside when asked, never on when the
    switch was off, and the switch restored after the block, also when it raises."""
    import mla_kernels.pdl as pdl

    before = pdl.ENABLED
    with pdl.override(False):
        assert pdl.ENABLED is False
    with pytest.raises(RuntimeError):
        with pdl.override(True):
            assert pdl.ENABLED == before
            raise RuntimeError("inside")
    assert pdl.ENABLED == before
