"""store_kv against the torch twin `store_kv_ref`.

CPU (CI): the triton interpreter in fp32 — MHA and MLA layouts, permuted slots, the padding sink,
strided inputs; an FP8 pool refused off CUDA. GPU (`gpu` marker, H200): fp32 → bf16 conversion,
slots near the end of a pool of more than 2^31 elements, and the FP8 pools' quantizing store
against the pool's torch write (`MLATokenToKVPool` / `MHATokenToKVPool.set_kv_buffer`), byte
for byte.
"""

from __future__ import annotations

import pytest
import torch

from mla_kernels.reference import store_kv_ref
from mla_kernels.store_kv import store_kv

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LAYOUTS = {  # name: (Hkv, Lk, Lv or None for MLA)
    "mha-8x128": (8, 128, 128),
    "gqa-2x192x128": (2, 192, 128),
    "mha-3x80x96": (3, 80, 96),
    "mla-576": (1, 576, None),
    "wide-1x1100": (1, 1100, None),  # more than one 1024-column block per row
}


def _pools(n_slots: int, hkv: int, lk: int, lv: int | None, dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(n_slots)
    k_buf = torch.randn(n_slots, hkv, lk, generator=g).to(dtype).to(device)
    v_buf = None if lv is None else torch.randn(n_slots, hkv, lv, generator=g).to(dtype).to(device)
    return k_buf, v_buf


def _new_rows(t: int, hkv: int, lk: int, lv: int | None, dtype: torch.dtype, device: str,
              seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, hkv, lk, generator=g).to(dtype).to(device)
    v = None if lv is None else torch.randn(t, hkv, lv, generator=g).to(dtype).to(device)
    return k, v


def _check_against_ref(k_buf, v_buf, loc, k, v) -> None:
    k_ref, v_ref = k_buf.clone(), None if v_buf is None else v_buf.clone()
    store_kv_ref(k_ref, v_ref, loc, k, v)
    store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf, k_ref)
    if v_buf is not None:
        assert torch.equal(v_buf, v_ref)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_store_permuted_slots(layout):
    hkv, lk, lv = LAYOUTS[layout]
    n_slots, t = 40, 13
    k_buf, v_buf = _pools(n_slots, hkv, lk, lv, torch.float32, "cpu")
    loc = torch.randperm(n_slots - 1, generator=torch.Generator().manual_seed(1))[:t] + 1
    k, v = _new_rows(t, hkv, lk, lv, torch.float32, "cpu")
    _check_against_ref(k_buf, v_buf, loc, k, v)


def test_store_mla_value_view_sees_the_latent():
    # MLA: the value buffer is a view of the key buffer; writing K alone updates it
    k_buf = torch.zeros(10, 1, 576)
    v_view = k_buf[..., :512]
    k, _ = _new_rows(3, 1, 576, None, torch.float32, "cpu", seed=2)
    store_kv(k_buf, None, torch.tensor([7, 2, 9]), k, None)
    assert torch.equal(v_view[[7, 2, 9]], k[..., :512])
    assert torch.equal(k_buf[[0, 1, 3, 4, 5, 6, 8]], torch.zeros(7, 1, 576))


@pytest.mark.parametrize("layout", ["mha-8x128", "mla-576"])
def test_padding_rows_write_only_the_sink(layout):
    hkv, lk, lv = LAYOUTS[layout]
    k_buf, v_buf = _pools(20, hkv, lk, lv, torch.float32, "cpu")
    k_before = k_buf.clone()
    v_before = None if v_buf is None else v_buf.clone()
    loc = torch.tensor([5, 0, 11, 0, 0, 3])  # three padded rows, all at the sink
    k, v = _new_rows(6, hkv, lk, lv, torch.float32, "cpu", seed=3)
    store_kv(k_buf, v_buf, loc, k, v)
    real = loc != 0
    assert torch.equal(k_buf[loc[real]], k[real])
    untouched = torch.tensor([s for s in range(1, 20) if s not in (5, 11, 3)])
    assert torch.equal(k_buf[untouched], k_before[untouched])
    # slot 0 holds one of the padded rows (garbage by contract, but nothing else wrote there)
    assert any(torch.equal(k_buf[0], k[i]) for i in (1, 3, 4))
    if v_buf is not None:
        assert torch.equal(v_buf[loc[real]], v[real])
        assert torch.equal(v_buf[untouched], v_before[untouched])


def test_strided_inputs_and_int32_loc():
    # k / v as views (e.g. slices of a fused projection output); loc as int32
    fused = torch.randn(5, 2, 64 + 48 + 7)
    k, v = fused[..., :64], fused[..., 64:112]
    k_buf, v_buf = _pools(12, 2, 64, 48, torch.float32, "cpu")
    loc = torch.tensor([3, 1, 10, 4, 8], dtype=torch.int32)
    _check_against_ref(k_buf, v_buf, loc.long(), k, v)
    store_kv(k_buf, v_buf, loc, k, v)  # same values again through int32 loc
    assert torch.equal(k_buf[loc.long()], k)


def test_empty_batch_is_a_no_op():
    k_buf, v_buf = _pools(4, 1, 16, 16, torch.float32, "cpu")
    before = k_buf.clone()
    store_kv(k_buf, v_buf, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 1, 16),
             torch.zeros(0, 1, 16))
    assert torch.equal(k_buf, before)


def test_errors():
    k_buf, v_buf = _pools(8, 2, 32, 32, torch.float32, "cpu")
    k, v = _new_rows(3, 2, 32, 32, torch.float32, "cpu")
    loc = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="both"):
        store_kv(k_buf, v_buf, loc, k, None)
    with pytest.raises(ValueError, match="k "):
        store_kv(k_buf, v_buf, loc, k[:, :1], v)
    with pytest.raises(ValueError, match="loc"):
        store_kv(k_buf, v_buf, loc.float(), k, v)
    with pytest.raises(ValueError, match="stride 1"):
        store_kv(k_buf, v_buf, loc, torch.randn(3, 2, 64)[..., ::2], v)
    fp8 = torch.zeros(8, 2, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="CUDA only"):
        store_kv(fp8, fp8.clone(), loc, k, v, 0.5, 0.5)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_store_fp32_into_bf16_pool_gpu(layout):
    hkv, lk, lv = LAYOUTS[layout]
    k_buf, v_buf = _pools(300, hkv, lk, lv, torch.bfloat16, "cuda")
    loc = (torch.randperm(299, generator=torch.Generator().manual_seed(5))[:77] + 1).cuda()
    loc[::10] = 0  # padded rows at the sink
    k, v = _new_rows(77, hkv, lk, lv, torch.float32, "cuda", seed=6)
    k_ref, v_ref = k_buf.clone(), None if v_buf is None else v_buf.clone()
    real = loc != 0
    store_kv_ref(k_ref, v_ref, loc[real], k[real], None if v is None else v[real])
    store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf[1:], k_ref[1:])  # exact: same fp32 → bf16 rounding
    if v_buf is not None:
        assert torch.equal(v_buf[1:], v_ref[1:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["mha-8x128", "mla-576"])
def test_store_big_pool_gpu(layout):
    # pool of > 2^31 elements, writes into its last rows (slot × stride > 2^31)
    hkv, lk, lv = LAYOUTS[layout]
    n_slots = 2**31 // (hkv * lk) + 64
    k_buf = torch.zeros(n_slots, hkv, lk, dtype=torch.bfloat16, device="cuda")
    v_buf = None if lv is None else torch.zeros(n_slots, hkv, lv, dtype=torch.bfloat16,
                                                device="cuda")
    assert k_buf.numel() > 2**31
    loc = torch.tensor([n_slots - 1, n_slots - 40, 0, n_slots - 2], device="cuda")
    k, v = _new_rows(4, hkv, lk, lv, torch.bfloat16, "cuda", seed=7)
    store_kv(k_buf, v_buf, loc, k, v)
    real = loc != 0
    assert torch.equal(k_buf[loc[real]], k[real])
    # nothing else was written (a 32-bit offset would have wrapped to some other row)
    written = k_buf[1:].flatten(1).ne(0).any(dim=1).nonzero().flatten() + 1
    assert sorted(written.tolist()) == sorted(loc[real].tolist())
    if v_buf is not None:
        assert torch.equal(v_buf[loc[real]], v[real])
    del k_buf, v_buf
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("layout", ["mha-8x128", "mla-576"])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_fp8_quantizing_store_equals_the_pool_write_gpu(layout, dtype, in_dtype):
    """The quantizing store writes the bytes of the pool's torch write (x · fp32(1 / scale)
    saturated to the format's largest finite value, rounded to nearest even): magnitudes spread
    log-uniformly over the whole range and past it (saturated), zeros of both signs, scales that
    are not powers of two; NaN stays NaN."""
    from mla_backend.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    hkv, lk, lv = LAYOUTS[layout]
    n_slots, t = 300, 97
    if lv is None:
        pool = MLATokenToKVPool(n_slots, dtype, lk - 64, 64, 1, "cuda", kv_scales=[0.37])
    else:
        pool = MHATokenToKVPool(n_slots, dtype, hkv, lk, lv, 1, "cuda", k_scales=[0.37],
                                v_scales=[2.9])
    fmax = torch.finfo(dtype).max
    g = torch.Generator().manual_seed(11)

    def rows(width):  # log-uniform magnitudes from 1e-6 to 10x the largest, random signs
        mag = torch.exp(torch.empty(t, hkv, width).uniform_(-14, float(torch.log(
            torch.tensor(10 * fmax))), generator=g))
        x = mag * torch.randint(0, 2, mag.shape, generator=g).mul(2).sub(1)
        x[0, 0, :8] = torch.tensor([0.0, -0.0, 0.5, 1.5, 2.5, fmax, -fmax * 3, float("nan")])
        return x.to(in_dtype).cuda()

    k = rows(lk)
    v = None if lv is None else rows(lv)
    loc = (torch.randperm(n_slots - 1, generator=g)[:t] + 1).cuda()
    want = [b.clone() for b in pool.get_kv_buffer(0)]
    k_buf, v_buf = pool.get_kv_buffer(0)
    pool.set_kv_buffer(0, loc, k, v)  # the torch write
    ref = [b.clone().view(torch.uint8) for b in (k_buf, v_buf)]
    k_buf.copy_(want[0])
    if lv is not None:
        v_buf.copy_(want[1])
    ks, vs = pool.get_kv_scales(0)
    store_kv(k_buf, None if lv is None else v_buf, loc, k, v, ks, vs)
    assert torch.equal(k_buf.view(torch.uint8), ref[0])
    assert torch.equal(v_buf.view(torch.uint8), ref[1])
    assert torch.isnan(k_buf[loc[0], 0, 7].float())
