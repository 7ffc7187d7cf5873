"""`mla_kernels.bmm_gemv.bmm_gemv` (per-head GEMV of absorbed MLA) vs its twin `reference.bmm_ref`.

CPU (CI): under TRITON_INTERPRET=1 (tests/kernels/conftest.py) in fp32, shapes crossing the
BLOCK_N / BLOCK_K edges, strided x / w / out (a column slice of a wider buffer, as the absorbed
query's first 512 of 576 columns), and the prefetch split. GPU (`gpu` marker): bf16 at
DeepSeek-V2-Lite's w_kc / w_vc shapes against fp32, with and without PDL.
"""

from __future__ import annotations

import pytest
import torch

from mla_kernels.bmm_gemv import bmm_gemv, bmm_gemv_config
from mla_kernels.reference import bmm_ref
from tests.kernels.test_gemv import BF16, DEVICE, FP32, _rand  # same tolerances and inputs


@pytest.mark.parametrize("t,h,k,n", [(1, 3, 40, 70), (2, 2, 128, 16), (3, 1, 20, 5),
                                     (1, 4, 300, 24)])
@pytest.mark.parametrize("prefetch", [False, True])
def test_bmm_gemv_vs_ref(t, h, k, n, prefetch):
    x, w = _rand(t, h, k, seed=k), _rand(h, k, n, seed=n)
    cfg = dict(BLOCK_N=16, BLOCK_K=32, num_warps=1, PREFETCH=prefetch)
    out = bmm_gemv(x, w, config=cfg)
    assert out.shape == (t, h, n) and out.dtype == x.dtype
    torch.testing.assert_close(out.cpu(), bmm_ref(x.cpu(), w.cpu()), **FP32)


def test_bmm_gemv_strided_views_and_default_config():
    # x: the nope part of a [T, H, 48] query; out: the first 64 of 72 columns of a wider buffer;
    # w: a head-strided view (every other head of a bigger stack)
    q = _rand(2, 3, 48, seed=1)
    x = q[..., :32]
    w = _rand(6, 32, 64, seed=2)[::2]
    buf = torch.full((2, 3, 72), 5.0, device=DEVICE)
    out = bmm_gemv(x, w, out=buf[..., :64], static_weight=True)
    assert out.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf[..., :64].cpu(), bmm_ref(x.cpu(), w.cpu()), **FP32)
    assert (buf[..., 64:] == 5.0).all()  # columns outside the view untouched


def test_bmm_gemv_config_shapes():
    assert bmm_gemv_config(128, 512) == {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4}
    assert bmm_gemv_config(512, 128) == {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4}
    assert bmm_gemv_config(64, 32) == {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4}


def test_bmm_gemv_bad_arguments():
    x, w = _rand(1, 2, 8, seed=0), _rand(2, 8, 4, seed=1)
    with pytest.raises(ValueError, match="need"):
        bmm_gemv(x, w[:1])
    with pytest.raises(ValueError, match="is torch.float32"):
        bmm_gemv(x, w.double())
    with pytest.raises(ValueError, match="out must be"):
        bmm_gemv(x, w, out=torch.empty(1, 2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous last dim"):
        bmm_gemv(x, w.transpose(1, 2).contiguous().transpose(1, 2))
    assert bmm_gemv(x[:0], w).shape == (0, 2, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k,n", [(128, 512), (512, 128)])  # V2-Lite w_kc, w_vc
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("static_weight", [False, True])
def test_bmm_gemv_bf16_on_gpu(k, n, t, static_weight):
    x = _rand(t, 16, k, seed=k, dtype=torch.bfloat16)
    w = (0.05 * _rand(16, k, n, seed=n)).to(torch.bfloat16)
    out = torch.empty(t, 16, n + 64, device="cuda", dtype=torch.bfloat16)[..., :n]
    bmm_gemv(x, w, out=out, static_weight=static_weight)
    torch.testing.assert_close(out.float().cpu(), bmm_ref(x.cpu(), w.cpu()), **BF16)
