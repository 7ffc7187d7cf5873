"""FP8 routed experts in the MoE layer (`layers.moe.StackedExperts` with `BlockFP8MoEMethod` /
`Fp8MoEMethod`): loading (checkpoint block scales, TP slicing along whole blocks, the dequantize
fallback when a TP slice would cut blocks, quantizing an unquantized weight at load), online
per-expert per-tensor quantization, and the loop `experts_forward` vs the fused triton kernel
(interpreter on CPU) on the same FP8 weights.

Tolerances: the loop and the kernel do the same FP8 math (same quantized operands), so
FP32 = atol 2e-5 / rtol 1e-5 (only summation order differs). TP: the ranks' partial outputs sum
to the single-rank output within FP32 when activations are not quantized (with dynamic
activation quantization each rank's intermediate gets its own scale, so ranks differ from one
rank by FP8 rounding; not compared). Online FP8 vs the unquantized layer: relative RMS <= 0.1
(weight and activation rounding; measured 0.064).
"""

from __future__ import annotations

import pytest
import torch

import mla_backend.layers.moe as moe
from mla_backend.layers.moe import (
    BlockFP8MoEMethod,
    DeepseekV2MoE,
    Fp8MoEMethod,
    StackedExperts,
    UnquantizedMoEMethod,
    dequantize_expert,
    experts_forward,
    select_experts,
)
from mla_backend.layers.quantization import BlockFP8Config, Fp8Config
from mla_kernels.block_fp8_gemm import dequant_weight_block_fp8, quant_weight_block_fp8

FP32 = {"atol": 2e-5, "rtol": 1e-5}
E, H = 4, 160
BLOCK_CFG = BlockFP8Config((128, 128))


def _hf_experts(inter: int, seed: int = 0) -> dict:
    """Per-expert HF matrices, block-FP8 quantized: {(e, shard): (fp8 [N, K], scale_inv)}."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(E):
        for shard, shape in (("gate", (inter, H)), ("up", (inter, H)), ("down", (H, inter))):
            w = torch.randn(*shape, generator=g) / shape[1] ** 0.5
            out[e, shard] = quant_weight_block_fp8(w, (128, 128))
    return out


def _load(layer: StackedExperts, mats: dict, scales: bool = True) -> None:
    for (e, shard), (q, s) in mats.items():
        w = layer.w2_weight if shard == "down" else layer.w13_weight
        if scales:
            layer.weight_loader(w, q, e, shard)
            sp = layer.w2_weight_scale_inv if shard == "down" else layer.w13_weight_scale_inv
            layer.weight_loader(sp, s, e, shard)
        else:  # an unquantized checkpoint tensor (the dequantized matrix)
            layer.weight_loader(w, dequant_weight_block_fp8(q, s), e, shard)


def _routing(t: int, k: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    weights, ids = select_experts(torch.randn(t, E, generator=g), k)
    return x, weights, ids


def _set_tp(monkeypatch, rank: int, size: int) -> None:
    monkeypatch.setattr(moe, "get_tp_rank", lambda: rank)
    monkeypatch.setattr(moe, "get_tp_size", lambda: size)


def test_block_fp8_experts_keep_checkpoint_and_match_dequantized():
    inter = 136  # not a multiple of 128: gate and up each have a ragged second block row
    mats = _hf_experts(inter)
    layer = StackedExperts(E, H, inter, BLOCK_CFG)
    assert layer.is_block_fp8 and layer.fp8_fallback_reason is None
    _load(layer, mats)
    assert layer.w13_weight.dtype == torch.float8_e4m3fn
    assert layer.w13_weight_scale_inv.shape == (E, 4, 2)
    assert layer.w2_weight_scale_inv.shape == (E, 2, 2)
    for e in range(E):
        gate_up = dequantize_expert(layer.w13_weight, layer.w13_weight_scale_inv, e,
                                    (128, 128), gate_up=True)
        want = torch.cat([dequant_weight_block_fp8(*mats[e, "gate"]),
                          dequant_weight_block_fp8(*mats[e, "up"])])
        torch.testing.assert_close(gate_up, want, rtol=0, atol=0)
    # An unquantized weight for a block-FP8 layer is quantized at load (same blocks: same bytes).
    again = StackedExperts(E, H, inter, BLOCK_CFG)
    _load(again, mats, scales=False)
    torch.testing.assert_close(again.w13_weight_scale_inv, layer.w13_weight_scale_inv)
    torch.testing.assert_close(again.w2_weight.float(), layer.w2_weight.float())


def test_fused_equals_loop_block_fp8():
    inter = 136
    layer = StackedExperts(E, H, inter, BLOCK_CFG)
    _load(layer, _hf_experts(inter))
    x, weights, ids = _routing(5)
    with torch.no_grad():
        loop = layer(x, weights, ids, fused=False)
        fused = layer(x, weights, ids, fused=True)
    torch.testing.assert_close(fused, loop, **FP32)
    assert loop.abs().max() > 0.05


def test_tp_slices_whole_blocks(monkeypatch):
    """tp 2, I 256: each rank holds one 128-row block of gate and up and one 128-column block of
    down; the two partial outputs (activations unquantized) sum to the tp 1 output."""
    inter = 256
    mats = _hf_experts(inter, seed=2)
    x, weights, ids = _routing(6, seed=3)
    cfg = BlockFP8Config((128, 128), activation_quant=False)
    full = StackedExperts(E, H, inter, cfg)
    _load(full, mats)
    ref = full(x, weights, ids, fused=False)
    parts = []
    for rank in range(2):
        _set_tp(monkeypatch, rank, 2)
        layer = StackedExperts(E, H, inter, cfg)
        assert layer.is_block_fp8 and layer.intermediate_size == 128
        _load(layer, mats)
        assert layer.w13_weight_scale_inv.shape == (E, 2, 2)
        assert layer.w2_weight_scale_inv.shape == (E, 2, 1)
        rows = slice(rank * 128, (rank + 1) * 128)
        torch.testing.assert_close(
            dequantize_expert(layer.w2_weight, layer.w2_weight_scale_inv, 1, (128, 128), False),
            dequant_weight_block_fp8(*mats[1, "down"])[:, rows])
        parts.append(layer(x, weights, ids, fused=False))
    torch.testing.assert_close(parts[0] + parts[1], ref, **FP32)


def test_tp_slice_cutting_blocks_falls_back(monkeypatch):
    _set_tp(monkeypatch, 0, 2)
    layer = StackedExperts(E, H, 128, BLOCK_CFG)  # 64 rows per rank: half a block
    assert not layer.is_block_fp8 and isinstance(layer.quant_method, UnquantizedMoEMethod)
    assert "not a multiple of the FP8 block" in layer.fp8_fallback_reason
    assert layer.w13_weight.dtype == torch.get_default_dtype()


def test_online_fp8_experts():
    inter = 40
    g = torch.Generator().manual_seed(4)
    layer = StackedExperts(E, H, inter, Fp8Config())
    plain = StackedExperts(E, H, inter)
    assert isinstance(layer.quant_method, Fp8MoEMethod)
    for lay in (layer, plain):
        lay.w13_weight.data.copy_(torch.randn(E, 2 * inter, H, generator=g.manual_seed(4)) * 0.1)
        lay.w2_weight.data.copy_(torch.randn(E, H, inter, generator=g.manual_seed(5)) * 0.1)
    w13 = layer.w13_weight.data.clone()
    layer.quant_method.process_weights_after_loading(layer)
    layer.quant_method.process_weights_after_loading(layer)  # idempotent
    assert layer.w13_weight.dtype == layer.w2_weight.dtype == torch.float8_e4m3fn
    assert layer.w13_weight_scale.shape == layer.w2_weight_scale.shape == (E,)
    torch.testing.assert_close(layer.w13_weight_scale, w13.abs().amax(dim=(1, 2)) / 448)
    x, weights, ids = _routing(7)
    with torch.no_grad():
        ref = plain(x, weights, ids, fused=False)
        loop = layer(x, weights, ids, fused=False)
        fused = layer(x, weights, ids, fused=True)
    torch.testing.assert_close(fused, loop, **FP32)
    rel = float((loop - ref).norm() / ref.norm())
    assert 1e-4 < rel <= 0.1, rel


def test_moe_layer_passes_experts_quant_config():
    m = DeepseekV2MoE(H, 128, E, 2, n_shared_experts=1, fused_moe=False,
                      quant_config=BLOCK_CFG, experts_quant_config=BLOCK_CFG)
    assert isinstance(m.experts.quant_method, BlockFP8MoEMethod)
    assert m.experts.w2_weight.dtype == torch.float8_e4m3fn
    assert isinstance(DeepseekV2MoE(H, 128, E, 2).experts.quant_method, UnquantizedMoEMethod)


def test_experts_forward_fp8_equals_dequantized_without_activation_quant():
    inter = 136
    layer = StackedExperts(E, H, inter, BLOCK_CFG)
    _load(layer, _hf_experts(inter, seed=6))
    x, weights, ids = _routing(4, seed=7)
    w13 = torch.stack([dequantize_expert(layer.w13_weight, layer.w13_weight_scale_inv, e,
                                         (128, 128), True) for e in range(E)])
    w2 = torch.stack([dequantize_expert(layer.w2_weight, layer.w2_weight_scale_inv, e,
                                        (128, 128), False) for e in range(E)])
    got = experts_forward(x, layer.w13_weight, layer.w2_weight, weights, ids,
                          layer.w13_weight_scale_inv, layer.w2_weight_scale_inv, (128, 128),
                          activation_quant=False)
    torch.testing.assert_close(got, experts_forward(x, w13, w2, weights, ids), **FP32)


def test_moe_folds_fp8_shared_experts_at_one_row_weight_only(monkeypatch):
    """Online FP8 routed and shared experts: at one token row the fused layer runs the shared
    experts inside the routed GEMV launches, weight-only (activations unquantized), so it
    equals the unquantized loop layer over the dequantized weights within FP32; at two rows
    the shared MLP runs on its own with quantized activations (close, not equal)."""
    inter, n_shared = 40, 2
    fp8 = DeepseekV2MoE(H, inter, E, 2, n_shared_experts=n_shared, fused_moe=True,
                        quant_config=Fp8Config(), experts_quant_config=Fp8Config())
    plain = DeepseekV2MoE(H, inter, E, 2, n_shared_experts=n_shared, fused_moe=False)
    g = torch.Generator().manual_seed(9)
    se, pse = fp8.shared_experts, plain.shared_experts
    with torch.no_grad():
        fp8.gate.weight.copy_(torch.randn(E, H, generator=g))
        fp8.experts.w13_weight.copy_(torch.randn(E, 2 * inter, H, generator=g) * 0.1)
        fp8.experts.w2_weight.copy_(torch.randn(E, H, inter, generator=g) * 0.1)
        for lin in (se.gate_up_proj, se.down_proj):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.1)
            lin.quant_method.process_weights_after_loading(lin)
        fp8.experts.quant_method.process_weights_after_loading(fp8.experts)
        ex, pex = fp8.experts, plain.experts
        plain.gate.weight.copy_(fp8.gate.weight)
        pex.w13_weight.copy_(ex.w13_weight.float() * ex.w13_weight_scale[:, None, None])
        pex.w2_weight.copy_(ex.w2_weight.float() * ex.w2_weight_scale[:, None, None])
        for lin, plin in ((se.gate_up_proj, pse.gate_up_proj), (se.down_proj, pse.down_proj)):
            assert lin.weight.dtype == torch.float8_e4m3fn
            plin.weight.copy_(lin.quant_method.dequantized_weight(lin))
    calls = []
    real = moe._fused_experts_opaque
    monkeypatch.setattr(moe, "_fused_experts_opaque",
                        lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    x = torch.randn(2, H, generator=g)
    with torch.no_grad():
        one = fp8(x[:1])
        assert "shared_w13_scale" in calls[-1] and calls[-1]["activation_quant"] is False
        torch.testing.assert_close(one, plain(x[:1]), **FP32)
        two, ref = fp8(x), plain(x)
        assert "shared_w13" not in calls[-1]
    rel = float((two - ref).norm() / ref.norm())
    assert 1e-4 < rel <= 0.1, rel
