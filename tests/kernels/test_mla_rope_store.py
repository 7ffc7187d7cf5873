"""mla_norm_rope_store against its torch twin and against the three separate kernels it replaces.

CPU (CI): the triton interpreter in fp32 — V2 shapes (512 + 64, 16 heads) and odd ones (latent
not a power of two, 3 heads, rope 32), strided inputs (column slices of a fused projection, the
rope columns of the absorbed query), the padding sink, rows outside `loc` left untouched; FP8
pools (e4m3, e5m2) against the fp32 twin quantized as the pool's own store does.
GPU (`gpu` marker, H200): bf16 against the fp32 twin and against rmsnorm + rotary + store_kv
(the rotated query bit-equal, the stored rows within the norm's reduction order), at 1 and 64
tokens, and a slot near the end of a large pool.
"""

from __future__ import annotations

import pytest
import torch

from mla_kernels.mla_rope_store import mla_norm_rope_store
from mla_kernels.reference import mla_norm_rope_store_ref

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

EPS = 1e-6
DEVICE_IS_CPU = not torch.cuda.is_available()
DEV = "cpu" if DEVICE_IS_CPU else "cuda"  # fp32 tests: the interpreter on CPU, else the GPU


def _case(t: int, heads: int, lora: int, rope: int, n_slots: int, dtype: torch.dtype,
          device: str, seed: int = 0):
    """A fused projection row [T, heads*(128+rope) + lora + rope] whose column slices are q_pe
    and kv_a, an absorbed query [T, H, lora + rope] to receive q_out, a random pool, slots."""
    g = torch.Generator().manual_seed(seed)
    nope = 128
    proj = torch.randn(t, heads * (nope + rope) + lora + rope, generator=g)
    pos = torch.randint(0, 4096, (t,), generator=g).float()
    inv = 1.0 / (10000 ** (torch.arange(0, rope, 2).float() / rope))
    ang = pos[:, None] * inv[None, :]
    table = torch.cat([ang.cos(), ang.sin()], -1) * 1.3  # a YaRN-like mscale
    weight = 1 + 0.1 * torch.randn(lora, generator=g)
    pool = torch.randn(n_slots, 1, lora + rope, generator=g)
    loc = torch.randperm(n_slots - 1, generator=g)[:t] + 1
    q_full = torch.randn(t, heads, lora + rope, generator=g)
    proj, weight, pool, q_full = (x.to(dtype).to(device) for x in (proj, weight, pool, q_full))
    table, loc = table.to(device), loc.to(device)
    q_pe = proj[:, : heads * (nope + rope)].view(t, heads, nope + rope)[..., nope:]
    kv_a = proj[:, heads * (nope + rope):]
    return kv_a, weight, q_pe, table, pool, loc, q_full


def _run_both(args, lora):
    kv_a, weight, q_pe, table, pool, loc, q_full = args
    pool_ref, q_ref = pool.clone(), q_full.clone()
    mla_norm_rope_store_ref(kv_a.float(), weight.float(), EPS, q_pe.float(), table,
                            pool_ref, loc, q_ref[..., lora:])
    mla_norm_rope_store(kv_a, weight, EPS, q_pe, table, pool, loc, q_full[..., lora:])
    return pool, pool_ref, q_full, q_ref


@pytest.mark.parametrize("t,heads,lora,rope", [(1, 16, 512, 64), (5, 3, 200, 32),
                                                (4, 16, 512, 64)])
def test_matches_reference_fp32(t, heads, lora, rope):
    args = _case(t, heads, lora, rope, 24, torch.float32, DEV, seed=t)
    pool_before, q_before = args[4].clone(), args[6].clone()
    pool, pool_ref, q_full, q_ref = _run_both(args, lora)
    loc = args[5]
    torch.testing.assert_close(pool, pool_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q_full, q_ref, rtol=1e-5, atol=1e-5)
    # untouched: slots outside loc, the query's latent columns
    others = torch.ones(pool.shape[0], dtype=torch.bool, device=DEV)
    others[loc] = False
    assert torch.equal(pool[others], pool_before[others])
    assert torch.equal(q_full[..., :lora], q_before[..., :lora])
    # the rows really changed (a no-op kernel would fail here)
    assert not torch.allclose(pool[loc], pool_before[loc])


def test_padding_sink_rows():
    """Padded rows all write slot 0; real slots get exactly their row."""
    kv_a, weight, q_pe, table, pool, loc, q_full = _case(6, 4, 64, 16, 12, torch.float32, DEV)
    loc = loc.clone()
    loc[[1, 4]] = 0
    args = (kv_a, weight, q_pe, table, pool, loc, q_full)
    pool, pool_ref, _, _ = _run_both(args, 64)
    real = loc[loc > 0]
    torch.testing.assert_close(pool[real], pool_ref[real], rtol=1e-5, atol=1e-5)


def _fp8_rows_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """got, want: FP8 rows of one dtype; finite, saturated alike, equal except where
    - (CPU) triton's interpreter rounds an fp32 -> fp8 conversion that should carry into the
      next power of two: it keeps the old exponent and gives half the value (want -128, got
      -64; a few percent of values);
    - (GPU, hardware round-to-nearest-even) the norm's reduction order moved a value across a
      rounding midpoint: then got is want's neighbour, one FP8 step away (under 1% of values)."""
    fmax = torch.finfo(want.dtype).max
    g, w = got.float(), want.float()
    assert torch.isfinite(g).all()
    assert torch.equal(w.abs() == fmax, g.abs() == fmax)
    off = g != w
    if DEVICE_IS_CPU:
        pow2 = torch.log2(w.abs()).frac() == 0
        assert (pow2 & (g == w / 2))[off].all()
        assert off.float().mean().item() < 0.1
    else:
        mantissa_bits, smallest = (3, 2.0 ** -9) if want.dtype == torch.float8_e4m3fn else (
            2, 2.0 ** -16)
        step = torch.clamp(torch.maximum(g.abs(), w.abs()) * 2.0 ** -mantissa_bits,
                           min=smallest)
        assert ((g - w).abs() <= step)[off].all()
        assert off.float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pool_rows_are_quantized_with_the_k_scale(dtype):
    """An FP8 pool gets the row the pool's own store would write: value / k_scale, saturated
    at the format's max (k_scale small enough that some latent values saturate in e4m3)."""
    from mla_backend.mem_cache.memory_pool import quantize_fp8

    lora, rope, k_scale = 200, 32, 0.005
    kv_a, weight, q_pe, table, pool, loc, q_full = _case(5, 3, lora, rope, 24, torch.float32,
                                                         DEV, seed=7)
    pool8 = pool.to(dtype)
    before = pool8.clone()
    ref_pool, q_ref = pool.clone(), q_full.clone()
    mla_norm_rope_store_ref(kv_a, weight, EPS, q_pe, table, ref_pool, loc, q_ref[..., lora:])
    mla_norm_rope_store(kv_a, weight, EPS, q_pe, table, pool8, loc, q_full[..., lora:],
                        k_scale=k_scale)
    want = quantize_fp8(ref_pool[loc], k_scale, dtype)
    _fp8_rows_close(pool8[loc], want)
    if dtype == torch.float8_e4m3fn:  # the saturation was exercised
        assert (pool8[loc].float().abs() == torch.finfo(dtype).max).any()
    torch.testing.assert_close(q_full, q_ref, rtol=1e-5, atol=1e-5)  # the query: unquantized
    others = torch.ones(pool8.shape[0], dtype=torch.bool, device=DEV)
    others[loc] = False
    assert torch.equal(pool8[others].view(torch.uint8), before[others].view(torch.uint8))


def test_bad_input():
    kv_a, weight, q_pe, table, pool, loc, q_full = _case(2, 4, 64, 16, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="mla_norm_rope_store"):
        mla_norm_rope_store(kv_a, weight[:-1], EPS, q_pe, table, pool, loc, q_full[..., 64:])
    with pytest.raises(ValueError, match="k_scale"):
        mla_norm_rope_store(kv_a, weight, EPS, q_pe, table, pool.to(torch.float8_e4m3fn), loc,
                            q_full[..., 64:], k_scale=0.0)
    q_out_strided = torch.empty(2, 16, 4).transpose(1, 2)  # [T, H, R], last-dim stride 4
    with pytest.raises(ValueError, match="contiguous"):
        mla_norm_rope_store(kv_a, weight, EPS, q_pe, table, pool, loc, q_out_strided)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 64])
def test_gpu_bf16_equals_separate_kernels(t):
    from mla_kernels.rmsnorm import rmsnorm
    from mla_kernels.rotary import rotary_embedding
    from mla_kernels.store_kv import store_kv

    lora, rope, heads = 512, 64, 16
    kv_a, weight, q_pe, table, pool, loc, q_full = _case(t, heads, lora, rope, 4096,
                                                         torch.bfloat16, "cuda", seed=t)
    # the separate kernels (the generic absorbed path of models/deepseek_v2.py)
    pool_sep, q_sep = pool.clone(), q_full.clone()
    k_full = torch.empty(t, 1, lora + rope, dtype=torch.bfloat16, device="cuda")
    rmsnorm(kv_a[:, :lora], weight, EPS, out=k_full[:, 0, :lora])
    rotary_embedding(None, q_pe, kv_a[:, None, lora:], table, False, rope,
                     q_out=q_sep[..., lora:], k_out=k_full[..., lora:])
    store_kv(pool_sep, None, loc, k_full, None)
    pool_ref, q_ref = pool.clone().float(), q_full.clone().float()
    mla_norm_rope_store_ref(kv_a.float(), weight.float(), EPS, q_pe.float(), table, pool_ref,
                            loc, q_ref[..., lora:])
    mla_norm_rope_store(kv_a, weight, EPS, q_pe, table, pool, loc, q_full[..., lora:])
    torch.cuda.synchronize()
    # one bf16 rounding from the fp32 twin; equal to the separate kernels up to the norm's
    # reduction order (at most one bf16 ulp on a few entries)
    torch.testing.assert_close(pool.float(), pool_ref, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(q_full.float(), q_ref, rtol=8e-3, atol=8e-3)
    assert torch.equal(q_full, q_sep)
    diff = (pool[loc].float() - pool_sep[loc].float()).abs()  # the written rows only
    assert diff.max().item() <= 2 ** -7 * pool_sep[loc].float().abs().max().item()
    assert (diff > 0).float().mean().item() < 0.05
    others = torch.ones(pool.shape[0], dtype=torch.bool, device="cuda")
    others[loc] = False
    assert torch.equal(pool[others], pool_sep[others])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_slot_near_end_of_large_pool():
    """slot * stride beyond 2^31 elements: 64-bit offsets (a 3.9M-slot x 576 bf16 pool, 4.5 GB)."""
    lora, rope = 512, 64
    n_slots = (2 ** 31) // (lora + rope) + 1000
    kv_a, weight, q_pe, table, _, _, q_full = _case(2, 16, lora, rope, 8, torch.bfloat16, "cuda")
    pool = torch.zeros(n_slots, 1, lora + rope, dtype=torch.bfloat16, device="cuda")
    loc = torch.tensor([n_slots - 1, n_slots - 700], device="cuda")
    mla_norm_rope_store(kv_a, weight, EPS, q_pe, table, pool, loc, q_full[..., lora:])
    ref = torch.zeros(2, 1, lora + rope, dtype=torch.float32, device="cuda")
    mla_norm_rope_store_ref(kv_a.float(), weight.float(), EPS, q_pe.float(), table, ref,
                            torch.tensor([0, 1], device="cuda"), q_full.float()[..., lora:])
    torch.testing.assert_close(pool[loc].float(), ref, rtol=8e-3, atol=8e-3)
    assert pool[: n_slots - 700].abs().sum().item() == 0
    del pool
    torch.cuda.empty_cache()
