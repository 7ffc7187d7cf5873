"""`mla_kernels.moe_sum.moe_sum` (the routed experts' top-k combine, plus an optional addend)
against its float32 / float64 twin `reference.moe_sum_ref`.

CPU (CI): the kernel under TRITON_INTERPRET=1 (tests/kernels/conftest.py), float32 inputs
against the float64 twin; GPU (`gpu` marker): bf16 at DeepSeek-V2-Lite's shape (k 6, H 2048)
against the float32 twin, and against what it replaces (torch.sum over k, then the addition in
bf16).
"""

from __future__ import annotations

import pytest
import torch

from mla_kernels.moe_sum import moe_sum
from mla_kernels.reference import moe_sum_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rand(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEV, dtype=dtype)


@pytest.mark.parametrize("with_add", [False, True], ids=["sum", "sum+add"])
@pytest.mark.parametrize("t,k,h", [(1, 6, 2048), (5, 2, 1500), (3, 8, 96), (4, 1, 7)])
def test_moe_sum_vs_ref(t, k, h, with_add):
    y = _rand(t, k, h, seed=t * 100 + k)
    add = _rand(t, h, seed=7) if with_add else None
    out = torch.full((t, h), float("nan"), device=DEV)
    assert moe_sum(y, out, add) is out
    # float32 accumulation against the float64 twin: k + 1 additions of N(0, 1) values
    ref = moe_sum_ref(y.double(), None if add is None else add.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-6)


def test_moe_sum_strided_views_in_place_add_and_empty():
    # y a column slice of a wider buffer (row stride > k * H), out a strided view, out = add.
    base = _rand(4, 3, 80, seed=1)
    y = base[:, :, :64]
    assert y.stride(1) == 80
    buf = _rand(4, 100, seed=2)
    out = buf[:, 10:74]
    add = out.clone()
    expect = moe_sum_ref(y, add)
    moe_sum(y, out, out)  # out is its own addend
    torch.testing.assert_close(out, expect, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(buf[:, :10], _rand(4, 100, seed=2)[:, :10])  # untouched
    # no experts per token: out = add, or zeros
    z = torch.empty(2, 0, 16, device=DEV)
    o = torch.full((2, 16), 3.0, device=DEV)
    assert torch.equal(moe_sum(z, o), torch.zeros(2, 16, device=DEV))
    a = _rand(2, 16, seed=3)
    assert torch.equal(moe_sum(z, o, a), a)
    # no tokens: nothing to do, no launch
    e = torch.empty(0, 4, 16, device=DEV)
    assert moe_sum(e, torch.empty(0, 16, device=DEV)).shape == (0, 16)


def test_moe_sum_errors():
    y = _rand(3, 2, 16, seed=4)
    with pytest.raises(ValueError, match="y must be"):
        moe_sum(y[0], torch.empty(2, 16, device=DEV))
    with pytest.raises(ValueError, match="out must be"):
        moe_sum(y, torch.empty(3, 15, device=DEV))
    with pytest.raises(ValueError, match="add must be"):
        moe_sum(y, torch.empty(3, 16, device=DEV), torch.empty(2, 16, device=DEV))
    with pytest.raises(ValueError, match="contiguous last dim"):
        moe_sum(y, torch.empty(16, 3, device=DEV).t())
    with pytest.raises(ValueError, match="y must have a contiguous"):
        moe_sum(_rand(3, 16, 2, seed=5).transpose(1, 2), torch.empty(3, 16, device=DEV))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [1, 512, 6144])
def test_gpu_moe_sum_bf16(t):
    y = _rand(t, 6, 2048, seed=t, dtype=torch.bfloat16)
    add = _rand(t, 2048, seed=t + 1, dtype=torch.bfloat16)
    out = torch.empty(t, 2048, dtype=torch.bfloat16, device=DEV)
    moe_sum(y, out, add)
    ref = moe_sum_ref(y.float(), add.float())  # float32, not rounded
    # one bf16 rounding of the float32 sum (2^-8 relative) plus float32 summation order
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=8e-3)
    # what it replaces rounds twice: within a bf16 step of it
    old = torch.sum(y, dim=1) + add
    torch.testing.assert_close(out.float(), old.float(), atol=3e-2, rtol=1.6e-2)
    moe_sum(y, out)
    torch.testing.assert_close(out, torch.sum(y, dim=1), atol=1e-2, rtol=8e-3)
