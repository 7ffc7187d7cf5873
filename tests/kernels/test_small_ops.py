"""Small fused ops (rmsnorm, fused_add_rmsnorm, silu_and_mul, rotary) vs their fp32 twins in
`mla_kernels/reference.py`, and the layer classes' triton path (`forward_cuda`) vs `forward_native`.

CPU (CI): kernels run under TRITON_INTERPRET=1 in fp32 on device "cpu" (tests/kernels/conftest.py
sets it when CUDA is absent); the layers' `forward_cuda` is called directly on CPU tensors, which
exercises the same kernels through the interpreter. GPU (`gpu` marker, H200): bf16 kernels vs the
fp32 reference, and the layers' dispatching `forward` on CUDA vs `forward_native`.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # in case the conftest has not set it (it does normally)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from mla_backend.layers.activation import SiluAndMul  # noqa: E402
from mla_backend.layers.layernorm import RMSNorm  # noqa: E402
from mla_backend.layers.rotary_deepseek import DeepseekRotaryEmbedding  # noqa: E402
from mla_backend.layers.rotary_embedding import get_rope  # noqa: E402
from mla_kernels.activation import silu_and_mul  # noqa: E402
from mla_kernels.reference import (  # noqa: E402
    fused_add_rmsnorm_ref,
    quantize_fp8_per_token_ref,
    rmsnorm_ref,
    rotary_ref,
    silu_and_mul_ref,
)
from mla_kernels.rmsnorm import fused_add_rmsnorm, rmsnorm  # noqa: E402
from mla_kernels.rotary import rotary_embedding  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FP32 = dict(atol=1e-5, rtol=1e-5)
# bf16 outputs vs an fp32 oracle: one bf16 rounding (2^-8 relative) plus fp32 reduction order.
BF16 = dict(atol=1e-2, rtol=1.6e-2)
EPS = 1e-6


def _rand(*shape: int, seed: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(device=DEV, dtype=dtype)


def _rope_ref(positions, x, cache, is_neox, rot):
    """rotary_ref on the first `rot` dims, the rest passed through; fp32 [T, H, D]."""
    cos, sin = cache.float()[positions.long()].chunk(2, dim=-1)
    out = rotary_ref(x.float()[..., :rot], cos, sin, is_neox)
    return torch.cat([out, x.float()[..., rot:]], dim=-1)


# ------------------------------------------------------------------ rmsnorm
@pytest.mark.parametrize("d", [576, 80, 1408, 96])
@pytest.mark.parametrize("t", [1, 7])
def test_rmsnorm_vs_ref(t, d):
    x, w = _rand(t, d, seed=d + t, scale=3.0), 1 + _rand(d, seed=1, scale=0.3)
    out = rmsnorm(x, w, EPS)
    assert out.shape == (t, d) and out.dtype == x.dtype
    torch.testing.assert_close(out, rmsnorm_ref(x, w, EPS), **FP32)


def test_rmsnorm_strided_rows_out_and_in_place():
    big = _rand(5, 600, seed=3)
    x, w = big[:, 10:586], _rand(576, seed=4)  # row stride 600, not contiguous
    want = rmsnorm_ref(x, w, 1e-5)
    torch.testing.assert_close(rmsnorm(x, w, 1e-5), want, **FP32)
    before = big.clone()
    rmsnorm(x, w, 1e-5, out=x)  # in place on a view: only the viewed columns change
    torch.testing.assert_close(x, want, **FP32)
    assert torch.equal(big[:, :10], before[:, :10]) and torch.equal(big[:, 586:], before[:, 586:])


def test_rmsnorm_zero_rows_and_errors():
    w = _rand(80, seed=0)
    assert rmsnorm(_rand(0, 80, seed=0), w, EPS).shape == (0, 80)
    with pytest.raises(ValueError):
        rmsnorm(_rand(3, 96, seed=0), w, EPS)
    with pytest.raises(ValueError):
        rmsnorm(_rand(80, 3, seed=0).t(), w, EPS)  # strided last dim


@pytest.mark.parametrize("d", [576, 80, 1408, 96])
@pytest.mark.parametrize("t", [1, 5])
def test_fused_add_rmsnorm_in_place_vs_ref(t, d):
    x, r = _rand(t, d, seed=d, scale=2.0), _rand(t, d, seed=d + 1)
    w = 1 + _rand(d, seed=2, scale=0.3)
    want_out, want_res = fused_add_rmsnorm_ref(x, r, w, EPS)
    assert fused_add_rmsnorm(x, r, w, EPS) is None
    torch.testing.assert_close(r, want_res, **FP32)
    torch.testing.assert_close(x, want_out, **FP32)


def test_fused_add_rmsnorm_out_of_place_leaves_inputs():
    x, r, w = _rand(3, 1408, seed=5), _rand(3, 1408, seed=6), _rand(1408, seed=7)
    x0, r0 = x.clone(), r.clone()
    out, res_out = torch.empty_like(x), torch.empty_like(r)
    fused_add_rmsnorm(x, r, w, EPS, out=out, residual_out=res_out)
    want_out, want_res = fused_add_rmsnorm_ref(x0, r0, w, EPS)
    torch.testing.assert_close(out, want_out, **FP32)
    torch.testing.assert_close(res_out, want_res, **FP32)
    assert torch.equal(x, x0) and torch.equal(r, r0)
    with pytest.raises(ValueError):
        fused_add_rmsnorm(x, r[:2], w, EPS)


def _fp8_bufs(t: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((t, d), float("nan"), device=DEV).to(torch.float8_e4m3fn),
            torch.full((t, 1), float("nan"), device=DEV))


def _assert_per_token_fp8(fp8_out, normed):
    """fp8_out is `quantize_fp8_per_token` of the stored normed rows, bit for bit."""
    want_q, want_s = quantize_fp8_per_token_ref(normed.cpu())
    assert torch.equal(fp8_out[1].cpu(), want_s)
    assert torch.equal(fp8_out[0].cpu().view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", [2048, 80])
def test_rmsnorm_fp8_out_is_per_token_quantization_of_the_output(d, dtype):
    """`fp8_out`: the normed rows as stored (x's dtype) quantized per row, exactly as a dynamic
    FP8 linear would (`fp8_quant.quantize_fp8_per_token`); a zero row gets the 1e-12 floor and
    zeros, rows of very different size keep their own scale."""
    t = 5
    x = _rand(t, d, seed=d, scale=2.0, dtype=dtype)
    x[1] = 0.0
    x[3] *= 1e4
    w = (1 + _rand(d, seed=3, scale=0.3)).to(dtype)
    fp8 = _fp8_bufs(t, d)
    out = rmsnorm(x, w, EPS, fp8_out=fp8)
    # on CUDA the extra store changes triton's layout, hence the reduction order (last bits)
    same = dict(atol=0, rtol=0) if DEV == "cpu" else (FP32 if dtype == torch.float32 else BF16)
    torch.testing.assert_close(out.float(), rmsnorm(x, w, EPS).float(), **same)
    _assert_per_token_fp8(fp8, out)
    assert fp8[1][1].item() == torch.tensor(1e-12).item() and not fp8[0][1].float().any()
    # the residual form: the normed sum quantized, the sum stored as before
    r = _rand(t, d, seed=d + 1, dtype=dtype)
    want_out, want_res = torch.empty_like(x), torch.empty_like(r)
    fused_add_rmsnorm(x, r, w, EPS, out=want_out, residual_out=want_res)
    out, res = torch.empty_like(x), torch.empty_like(r)
    fp8 = _fp8_bufs(t, d)
    fused_add_rmsnorm(x, r, w, EPS, out=out, residual_out=res, fp8_out=fp8)
    assert torch.equal(res, want_res)
    torch.testing.assert_close(out.float(), want_out.float(), **same)
    _assert_per_token_fp8(fp8, out)


def test_rmsnorm_fp8_out_errors():
    x, w = _rand(3, 80, seed=0), _rand(80, seed=1)
    q, s = _fp8_bufs(3, 80)
    for bad in ((q[:2], s), (q, s[:2]), (q.float(), s), (q, s.double()), (q[:, :40], s)):
        with pytest.raises(ValueError, match="fp8"):
            rmsnorm(x, w, EPS, fp8_out=bad)
    with pytest.raises(ValueError, match="fp8"):
        fused_add_rmsnorm(x, x.clone(), w, EPS, fp8_out=(q, s[:1]))


# ------------------------------------------------------------------ silu_and_mul
@pytest.mark.parametrize("n", [1408, 80, 96, 1500])  # 1500 > one 1024-column block
@pytest.mark.parametrize("t", [1, 6])
def test_silu_and_mul_vs_ref(t, n):
    x = _rand(t, 2 * n, seed=n + t, scale=4.0)
    out = silu_and_mul(x)
    assert out.shape == (t, n)
    torch.testing.assert_close(out, silu_and_mul_ref(x), **FP32)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_silu_and_mul_strided_rows_extremes_and_errors():
    big = _rand(4, 300, seed=9, scale=4.0)
    big[0, :5] = torch.tensor([-100.0, 100.0, -1e4, 0.0, 1e4])  # exp overflow must give 0/x
    x = big[:, :192]  # row stride 300
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **FP32)
    assert silu_and_mul(_rand(0, 8, seed=0)).shape == (0, 4)
    with pytest.raises(ValueError):
        silu_and_mul(_rand(2, 7, seed=0))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [2816, 1500, 96])
def test_silu_and_mul_fp8_out_is_per_token_quantization_of_the_output(n, dtype):
    """`fp8_out`: the output rows as stored quantized per row, exactly as a dynamic FP8 down
    projection would (`fp8_quant.quantize_fp8_per_token`); whole rows wider than one column
    block (1500, 2816: DeepSeek-V2-Lite's shared experts) in one program; a zero row gets the
    1e-12 floor."""
    t = 4
    x = _rand(t, 2 * n, seed=n, scale=2.0, dtype=dtype)
    x[2] = 0.0
    x[1] *= 50.0
    fp8 = _fp8_bufs(t, n)
    out = silu_and_mul(x, fp8_out=fp8)
    assert torch.equal(out, silu_and_mul(x))
    _assert_per_token_fp8(fp8, out)
    assert not fp8[0][2].float().any()
    with pytest.raises(ValueError, match="fp8_out"):
        silu_and_mul(x, fp8_out=(fp8[0][:, :-1], fp8[1]))
    with pytest.raises(ValueError, match="fp8_out"):
        silu_and_mul(x, fp8_out=(fp8[0], fp8[1][:2]))


# ------------------------------------------------------------------ rotary
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("d,rot,hq,hk", [
    (64, 64, 16, 1),   # DeepSeek rope part, MLA's single shared k_pe head
    (128, 128, 4, 2),
    (80, 80, 3, 3),    # non-power-of-two head dim
    (96, 48, 4, 1),    # partial rotary, half = 24 (non-power-of-two)
    (128, 64, 2, 2),   # partial rotary
])
def test_rotary_in_place_vs_ref(is_neox, d, rot, hq, hk):
    t, max_pos = 6, 160_001
    cache = _rand(max_pos, rot, seed=11)  # arbitrary table: the kernel must just look rows up
    positions = torch.tensor([0, 160_000, 7, 7, 123_457, 1], device=DEV)
    q, k = _rand(t, hq, d, seed=12), _rand(t, hk, d, seed=13)
    want_q = _rope_ref(positions, q, cache, is_neox, rot)
    want_k = _rope_ref(positions, k, cache, is_neox, rot)
    rotary_embedding(positions, q, k, cache, is_neox, rot)
    torch.testing.assert_close(q, want_q, **FP32)
    torch.testing.assert_close(k, want_k, **FP32)


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_strided_views_out_of_place_and_int32_positions(is_neox):
    t, hq, hk, d, rot = 5, 3, 1, 80, 64
    qkv = _rand(t, (hq + 2 * hk) * d, seed=20)
    q = qkv[:, : hq * d].view(t, hq, d)  # column slices of a fused projection
    k = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
    cache = _rand(50, rot, seed=21)
    positions = torch.tensor([3, 49, 0, 17, 17], device=DEV, dtype=torch.int32)
    qkv0 = qkv.clone()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    rotary_embedding(positions, q, k, cache, is_neox, q_out=q_out, k_out=k_out)
    assert torch.equal(qkv, qkv0)  # out of place: inputs untouched
    torch.testing.assert_close(q_out, _rope_ref(positions, q, cache, is_neox, rot), **FP32)
    torch.testing.assert_close(k_out, _rope_ref(positions, k, cache, is_neox, rot), **FP32)
    rotary_embedding(positions.long(), q, k, cache, is_neox)  # in place through the views
    torch.testing.assert_close(q, q_out, **FP32)
    torch.testing.assert_close(k, k_out, **FP32)
    assert torch.equal(qkv[:, (hq + hk) * d:], qkv0[:, (hq + hk) * d:])  # v untouched


def test_rotary_per_token_table_and_t1():
    q, k = _rand(1, 16, 64, seed=30), _rand(1, 1, 64, seed=31)
    table = _rand(1, 64, seed=32)  # positions=None: row t for token t
    pos = torch.zeros(1, dtype=torch.long, device=DEV)
    want_q, want_k = (_rope_ref(pos, x, table, False, 64) for x in (q, k))
    rotary_embedding(None, q, k, table, False)
    torch.testing.assert_close(q, want_q, **FP32)
    torch.testing.assert_close(k, want_k, **FP32)


def test_rotary_errors():
    q, k, cache = _rand(2, 2, 64, seed=0), _rand(2, 1, 64, seed=0), _rand(8, 64, seed=0)
    pos = torch.zeros(2, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError):
        rotary_embedding(pos, q, k, cache, True, rot_dim=32)  # table width != rot_dim
    with pytest.raises(ValueError):
        rotary_embedding(pos, q, _rand(3, 1, 64, seed=0), cache, True)  # token count
    with pytest.raises(ValueError):
        rotary_embedding(pos, q, k, cache, True, q_out=torch.empty_like(q))  # k_out missing
    with pytest.raises(ValueError):
        rotary_embedding(pos[:1], q, k, cache, True)


# ------------------------------------------------------------------ layers through the kernels
def _layers():
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data.copy_(1 + 0.3 * torch.randn(96, generator=torch.Generator().manual_seed(0)))
    rope_neox = get_rope(80, 40, 4096, 10000.0, True,
                         {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 512})
    yarn = {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
    return norm, rope_neox, DeepseekRotaryEmbedding(64, 10000.0, yarn)


def _check_layers(dtype, tol, call):
    """call(module, name, *args) runs the triton path; compared with forward_native."""
    norm, rope, ds_rope = (m.to(DEV) for m in _layers())  # rope tables stay fp32, as built
    norm.to(dtype)  # the weight in the model dtype (as under the runner's default dtype)
    x, r = _rand(7, 96, seed=40, scale=2, dtype=dtype), _rand(7, 96, seed=41, dtype=dtype)
    x0, r0 = x.clone(), r.clone()
    torch.testing.assert_close(call(norm, x), norm.forward_native(x), **tol)
    out, res = call(norm, x, r)
    want_out, want_res = norm.forward_native(x, r)
    torch.testing.assert_close(res, want_res, **tol)
    torch.testing.assert_close(out, want_out, **tol)
    assert torch.equal(x, x0) and torch.equal(r, r0)  # layers never modify their inputs

    g = _rand(2, 3, 2 * 48, seed=42, scale=3, dtype=dtype)  # leading dims [2, 3]
    torch.testing.assert_close(call(SiluAndMul(), g), SiluAndMul().forward_native(g), **tol)

    positions = torch.tensor([0, 4095, 17, 1000, 2], device=DEV)
    qkv = _rand(5, (4 + 2 + 2) * 80, seed=43, dtype=dtype)
    q, k = qkv[:, : 4 * 80], qkv[:, 4 * 80: 6 * 80]  # flat [T, H * D] column slices
    for got, want in zip(call(rope, positions, q, k), rope.forward_native(positions, q, k)):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, **tol)

    positions = torch.tensor([0, 160_000, 33, 9], device=DEV)
    q_full = _rand(4, 8, 192, seed=44, dtype=dtype)
    q_pe = q_full[..., 128:]  # strided rope slice, as in DeepseekV2Attention
    k_pe = _rand(4, 576, seed=45, dtype=dtype)[:, 512:].unsqueeze(1)
    for got, want in zip(call(ds_rope, positions, q_pe, k_pe),
                         ds_rope.forward_native(positions, q_pe, k_pe)):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, **tol)
    # the table a model builds once per forward gives the same rotation on both paths
    table = ds_rope.table(positions)
    assert table.shape == (4, 64) and table.dtype == torch.float32
    for got, want in zip(call(ds_rope, positions, q_pe, k_pe, table),
                         ds_rope.forward_native(positions, q_pe, k_pe)):
        torch.testing.assert_close(got, want, **tol)
    for got, want in zip(ds_rope.forward_native(positions, q_pe, k_pe, table),
                         ds_rope.forward_native(positions, q_pe, k_pe)):
        assert torch.equal(got, want)


def test_layers_forward_cuda_path_matches_native_fp32():
    """forward_cuda (the kernels, here in the interpreter on CPU) == forward_native in fp32."""
    _check_layers(torch.float32, FP32, lambda m, *a: m.forward_cuda(*a))


def test_layers_dispatch_native_on_cpu():
    norm, rope, _ = _layers()
    x = torch.randn(3, 96)
    assert torch.equal(norm(x), norm.forward_native(x))
    pos, q, k = torch.tensor([1, 2, 3]), torch.randn(3, 160), torch.randn(3, 80)
    assert all(torch.equal(a, b) for a, b in zip(rope(pos, q, k), rope.forward_native(pos, q, k)))


# ------------------------------------------------------------------ GPU (bf16)
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", [7168, 576, 80, 1408])
def test_gpu_rmsnorm_bf16(d):
    t = 37
    x, r = _rand(t, d, seed=1, scale=3, dtype=torch.bfloat16), _rand(t, d, seed=2,
                                                                     dtype=torch.bfloat16)
    w = (1 + _rand(d, seed=3, scale=0.3)).bfloat16()
    torch.testing.assert_close(rmsnorm(x, w, EPS).float(), rmsnorm_ref(x.float(), w.float(), EPS),
                               **BF16)
    want_out, want_res = fused_add_rmsnorm_ref(x, r, w, EPS)  # sum rounded to bf16 as the kernel
    fused_add_rmsnorm(x, r, w, EPS)
    if DEV == "cuda":  # fp32 add then one round-to-nearest-even: bit-exact on the device
        assert torch.equal(r, want_res)
    torch.testing.assert_close(r.float(), want_res.float(), **BF16)  # (interpreter: truncates)
    torch.testing.assert_close(x.float(), rmsnorm_ref(want_res.float(), w.float(), EPS), **BF16)
    torch.testing.assert_close(x.float(), want_out.float(), **BF16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n", [18432, 1408, 80])
def test_gpu_silu_and_mul_bf16(n):
    x = _rand(33, 2 * n, seed=4, scale=3, dtype=torch.bfloat16)
    torch.testing.assert_close(silu_and_mul(x).float(), silu_and_mul_ref(x.float()), **BF16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("d,rot,hq,hk", [(64, 64, 128, 1), (128, 128, 32, 8), (96, 48, 5, 1)])
def test_gpu_rotary_bf16(is_neox, d, rot, hq, hk):
    t = 61
    cache = _rand(200_000, rot, seed=5)
    positions = torch.randint(0, 200_000, (t,), device=DEV)
    positions[0] = 199_999
    q = _rand(t, hq, d, seed=6, dtype=torch.bfloat16)
    k = _rand(t, hk, d, seed=7, dtype=torch.bfloat16)
    want_q = _rope_ref(positions, q, cache, is_neox, rot)
    want_k = _rope_ref(positions, k, cache, is_neox, rot)
    rotary_embedding(positions, q, k, cache, is_neox, rot)
    torch.testing.assert_close(q.float(), want_q, **BF16)
    torch.testing.assert_close(k.float(), want_k, **BF16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, dict(atol=1e-5, rtol=1e-5)),
                                       (torch.bfloat16, dict(atol=2e-2, rtol=2e-2))])
def test_gpu_layers_match_native(dtype, tol):
    """The dispatching forward on CUDA (the kernels) vs forward_native. bf16: forward_native
    rounds the normed value before the weight multiply, the kernel once, so up to ~2 ulps."""
    _check_layers(dtype, tol, lambda m, *a: m(*a))
