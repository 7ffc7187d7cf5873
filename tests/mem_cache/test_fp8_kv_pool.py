"""FP8 KV cache as a pool property: config key, quantize/dequantize, saturation, scales, the
checkpoint scale names, cell bytes and the capacity doubling against bf16 (CPU, seconds)."""

from __future__ import annotations

import pytest
import torch

from mla_backend.config import ConfigError, EngineConfig
from mla_backend.layers.radix_attention import load_kv_scale, match_kv_scale_name
from mla_backend.mem_cache.memory_pool import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    dequantize_fp8,
    quantize_fp8,
)
from mla_backend.model_executor.model_runner import kv_cell_bytes, resolve_kv_cache_dtype
from mla_tools.model_shapes import DEEPSEEK_V2_LITE

FP8 = [pytest.param(torch.float8_e4m3fn, 448.0, id="e4m3"),
       pytest.param(torch.float8_e5m2, 57344.0, id="e5m2")]


def test_config_key_validated():
    for name in ("auto", "fp8_e4m3", "fp8_e5m2"):
        assert EngineConfig.create(model_path="m", kv_cache_dtype=name).cache.kv_cache_dtype == name
    assert EngineConfig.create(model_path="m").cache.kv_cache_dtype == "auto"
    with pytest.raises(ConfigError,
                       match="kv_cache_dtype: must be one of auto, fp8_e4m3, fp8_e5m2"):
        EngineConfig.create(model_path="m", kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig.from_parameters({"model_path": {"string_value": "m"},
                                      "kv_cache_dtype": {"string_value": "int8"}})
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    with pytest.raises(ValueError):
        resolve_kv_cache_dtype("fp16", torch.float32)


@pytest.mark.parametrize("dtype,fmax", FP8)
def test_quantize_saturates_never_nan_or_inf(dtype, fmax):
    assert torch.finfo(dtype).max == fmax
    x = torch.tensor([1e30, -1e30, float("inf"), float("-inf"), 1e6, -1e6, fmax * 1.5, 3.0])
    q = quantize_fp8(x, 1.0, dtype)
    assert q.dtype == dtype and torch.isfinite(q.float()).all()
    assert q.float()[:7].abs().eq(fmax).all() and q.float()[-1] == 3.0
    # with a scale: x / scale is what saturates; the read gives back max * scale at most
    y = dequantize_fp8(quantize_fp8(x, 4.0, dtype), 4.0)
    assert torch.isfinite(y).all() and y[:6].abs().eq(fmax * 4.0).all() and y[-1] == 3.0
    # a plain cast (no clamp) would not be safe for e5m2: that is what the clamp is for
    if dtype == torch.float8_e5m2:
        assert torch.isinf(torch.tensor([1e6]).to(dtype).float()).all()


@pytest.mark.parametrize("dtype,fmax", FP8)
def test_pools_quantize_on_write_dequantize_on_read(dtype, fmax):
    g = torch.Generator().manual_seed(0)
    mha = MHATokenToKVPool(16, dtype, 2, 8, 4, 2, k_scales=[0.5, 2.0], v_scales=[3.0, 0.25])
    assert mha.is_fp8 and mha.get_key_buffer(1).dtype == dtype and mha.cell_bytes() == 2 * 12 * 2
    loc = torch.tensor([3, 7, 1])
    k = torch.randn(3, 2, 8, generator=g) * 4
    v = torch.randn(3, 2, 4, generator=g) * 4
    k[0, 0, 0] = 1e9  # saturates instead of inf / NaN
    mha.set_kv_buffer(1, loc, k, v)
    raw_k = mha.get_key_buffer(1)[loc]
    assert torch.equal(raw_k.view(torch.uint8), quantize_fp8(k, 2.0, dtype).view(torch.uint8))
    kd, vd = mha.gather_kv(1, loc)
    assert kd.dtype == torch.float32 and torch.isfinite(kd).all() and kd[0, 0, 0] == fmax * 2.0
    rel = 2.0 ** -3 if dtype == torch.float8_e4m3fn else 2.0 ** -2  # half an ulp of the mantissa
    ok = k.abs() < 100
    assert ((kd - k).abs()[ok] <= rel * k.abs()[ok] + 2e-3).all()
    assert ((vd - v).abs() <= rel * v.abs() + 1e-3).all()
    assert mha.get_kv_scales(1) == (2.0, 0.25)
    assert mha.get_key_buffer(0).float().abs().sum() == 0  # other layers untouched

    mla = MLATokenToKVPool(16, dtype, 8, 4, 1, kv_scales=[10.0])
    row = torch.randn(2, 1, 12, generator=g) * 50
    mla.set_kv_buffer(0, torch.tensor([2, 5]), row, None)
    kd, vd = mla.gather_kv(0, torch.tensor([[2, 5]]))  # 2-D slot tables work too
    assert kd.shape == (1, 2, 1, 12) and vd.shape == (1, 2, 1, 8)
    assert torch.equal(vd, kd[..., :8]) and mla.get_kv_scales(0) == (10.0, 10.0)
    assert ((kd[0] - row).abs() <= rel * row.abs() + 1e-2).all()


def test_non_fp8_pool_has_no_scales():
    pool = MHATokenToKVPool(4, torch.float32, 1, 4, 4, 2)
    assert not pool.is_fp8 and pool.get_kv_scales(1) == (1.0, 1.0)
    x = torch.randn(1, 1, 4)
    pool.set_kv_buffer(0, torch.tensor([1]), x, x)
    assert torch.equal(pool.gather_kv(0, torch.tensor([1]))[0], x)  # exact, not rescaled
    with pytest.raises(ValueError, match="only to an FP8 pool"):
        MHATokenToKVPool(4, torch.bfloat16, 1, 4, 4, 2, k_scales=[2.0, 2.0])
    with pytest.raises(ValueError, match="only to an FP8 pool"):
        MLATokenToKVPool(4, torch.float32, 4, 2, 1, kv_scales=[2.0])
    with pytest.raises(ValueError, match="finite positive"):
        MLATokenToKVPool(4, torch.float8_e4m3fn, 4, 2, 2, kv_scales=[1.0, 0.0])
    with pytest.raises(ValueError, match="finite positive"):
        MLATokenToKVPool(4, torch.float8_e4m3fn, 4, 2, 2, kv_scales=[1.0])


def test_checkpoint_scale_names():
    assert match_kv_scale_name("model.layers.3.self_attn.k_scale") == (3, "k")
    assert match_kv_scale_name("model.layers.12.self_attn.v_scale") == (12, "v")
    assert match_kv_scale_name("model.layers.0.self_attn.kv_scale") == (0, "kv")
    assert match_kv_scale_name("model.layers.0.self_attn.attn.k_scale") == (0, "k")
    assert match_kv_scale_name("model.layers.1.self_attn.k_proj.k_scale") == (1, "k")
    assert match_kv_scale_name("model.layers.1.self_attn.v_proj.v_scale") == (1, "v")
    for other in ("model.layers.1.self_attn.k_proj.weight_scale",
                  "model.layers.1.self_attn.k_proj.v_scale", "model.layers.1.mlp.k_scale",
                  "model.layers.1.self_attn.k_proj.weight"):
        assert match_kv_scale_name(other) is None
    scales: dict[int, dict[str, float]] = {}
    assert load_kv_scale(scales, "model.layers.0.self_attn.kv_scale", torch.tensor(2.0))
    assert load_kv_scale(scales, "model.layers.1.self_attn.v_scale", torch.tensor([0.5]))
    assert not load_kv_scale(scales, "model.layers.1.self_attn.o_proj.weight", torch.zeros(2))
    assert scales == {0: {"k": 2.0, "v": 2.0}, 1: {"v": 0.5}}
    with pytest.raises(ValueError, match="per-tensor"):
        load_kv_scale(scales, "model.layers.0.self_attn.k_scale", torch.ones(4))
    with pytest.raises(ValueError, match="finite and > 0"):
        load_kv_scale(scales, "model.layers.0.self_attn.k_scale", torch.tensor(float("nan")))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_v2_lite_capacity_doubles_against_bf16(name):
    """Pool capacity at equal memory = budget // cell bytes (the runner's GPU plan): the FP8
    latent cell of V2-Lite is 576 x 27 x 1 B = 15,552 B (REFERENCE §1.7) against 31,104 B."""
    c = DEEPSEEK_V2_LITE
    layout = {"kind": "mla", "num_layers": c["num_hidden_layers"],
              "kv_lora_rank": c["kv_lora_rank"], "qk_rope_head_dim": c["qk_rope_head_dim"]}
    fp8 = kv_cell_bytes(layout, resolve_kv_cache_dtype(name, torch.bfloat16))
    bf16 = kv_cell_bytes(layout, resolve_kv_cache_dtype("auto", torch.bfloat16))
    assert (fp8, bf16) == (15_552, 31_104)
    budget = 100 * 2**30  # bytes given to the pool (e.g. an H200 after weights)
    assert budget % bf16 != 0  # not a convenient number
    cap_fp8, cap_bf16 = budget // fp8, budget // bf16
    assert cap_fp8 in (2 * cap_bf16, 2 * cap_bf16 + 1)  # floor of twice the same quotient
    budget = 3_000_000 * bf16  # a whole number of bf16 cells: exactly 2x
    assert budget // fp8 == 2 * (budget // bf16) == 6_000_000
    mha = {"kind": "mha", "num_layers": 27, "num_kv_heads": 16, "head_dim": 192, "v_head_dim": 128}
    assert kv_cell_bytes(mha, torch.float8_e4m3fn) * 2 == kv_cell_bytes(mha, torch.bfloat16) \
        == 276_480  # REFERENCE §1.7


def test_fp8_reciprocal_is_float32_division_in_both_writes():
    """The pool's torch write and the CUDA quantizing store (`mla_kernels.store_kv`) multiply by
    the same factor: 1 / scale as float32 division gives it (so they write the same bytes)."""
    import random

    from mla_backend.mem_cache.memory_pool import fp8_reciprocal
    from mla_kernels.store_kv import fp8_reciprocal as kernel_reciprocal

    rng = random.Random(0)
    for _ in range(5000):
        s = 10 ** rng.uniform(-12, 12)
        want = (torch.tensor(1.0) / torch.tensor(s, dtype=torch.float32)).item()
        assert fp8_reciprocal(s) == kernel_reciprocal(s) == want, s
