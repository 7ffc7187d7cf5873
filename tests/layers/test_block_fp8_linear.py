"""Block-FP8 linear layers (`layers.quantization.BlockFP8LinearMethod`, DeepSeek-V3's format): config
parsing, loading fp8 weights + `weight_scale_inv` through every linear class (incl. TP sharding by
rank overrides and merged shards that are / are not multiples of the 128-row block), scale
compaction, and the forward vs the dequantized weight (activation quantization off: fp32-exact;
on: vs the same per-token-group quantization emulated in torch). Kernels under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch

from mla_backend.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from mla_backend.layers.quantization import (
    BlockFP8Config,
    BlockFP8LinearMethod,
    UnquantizedLinearMethod,
)
from mla_kernels.block_fp8_gemm import (
    dequant_weight_block_fp8,
    per_token_group_quant_fp8,
    quant_weight_block_fp8,
)

V3_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}  # DeepSeek-V3 config.json
CFG = BlockFP8Config.from_hf(V3_QUANT)
CFG_NO_ACT = BlockFP8Config((128, 128), (), activation_quant=False)


def _fp8(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5 * torch.logspace(-1, 1, n).unsqueeze(1)
    wq, s = quant_weight_block_fp8(w, (128, 128))
    return wq, s, dequant_weight_block_fp8(wq, s)


def _load(layer, wq, s, shard=None):
    layer.weight_loader(layer.weight, wq, shard)
    layer.weight_loader(layer.weight_scale_inv, s, shard)


def _act_quantized(x: torch.Tensor) -> torch.Tensor:
    """x as the layer's activation quantization leaves it (per-token groups of 128, fp32)."""
    q, s = per_token_group_quant_fp8(x, 128)
    return q.float() * s.repeat_interleave(128, -1)[..., : x.shape[-1]]


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _assert_fp32_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """`got` is x @ w.T computed in fp32: within the rounding bound of a k-term fp32 dot
    product (|error| <= k u sum_i |x_i w_i|, u = 2^-24; Higham, Accuracy and Stability of
    Numerical Algorithms, 3.1) of the exact float64 product. (Two fp32 products of the same
    operands may sum in different orders, so they are compared with the exact one.)"""
    xd, wd = x.double(), w.double()
    bound = x.shape[-1] * 2.0 ** -24 * (xd.abs() @ wd.abs().T)
    err = (got.double() - xd @ wd.T).abs()
    assert got.dtype == torch.float32 and bool((err <= bound).all()), float((err - bound).max())


def test_config_parsing():
    assert CFG == BlockFP8Config((128, 128), (), True)
    assert BlockFP8Config.from_hf(None) is None and BlockFP8Config.from_hf({}) is None

    class Obj:  # transformers may hand over a config object instead of a dict
        quant_method, weight_block_size, modules_to_not_convert = "fp8", [64, 32], ["lm_head"]

    cfg = BlockFP8Config.from_hf(Obj())
    assert cfg.weight_block_size == (64, 32)
    assert cfg.for_module("model.layers.0.mlp.down_proj") is cfg
    assert cfg.for_module("lm_head") is None
    with pytest.raises(NotImplementedError, match="per-tensor"):
        BlockFP8Config.from_hf({"quant_method": "fp8"})
    with pytest.raises(NotImplementedError, match="static"):
        BlockFP8Config.from_hf({**V3_QUANT, "activation_scheme": "static"})
    with pytest.raises(ValueError, match="e5m2"):
        BlockFP8Config.from_hf({**V3_QUANT, "fmt": "e5m2"})
    with pytest.raises(NotImplementedError, match="awq"):
        BlockFP8Config.from_hf({"quant_method": "awq"})
    with pytest.raises(ValueError, match="multiple of 16"):
        BlockFP8Config.from_hf({**V3_QUANT, "weight_block_size": [128, 100]})


@pytest.mark.parametrize("n,k", [(144, 256), (128, 96), (300, 130)])
def test_replicated_fp8_forward(n, k):
    wq, s, w = _fp8(n, k, seed=n)
    layer = ReplicatedLinear(k, n, quant_config=CFG_NO_ACT)
    assert layer.weight.dtype == torch.float8_e4m3fn
    _load(layer, wq, s)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.scale_block_n == 128 and torch.equal(layer.weight_scale_inv, s)
    assert layer.weight.dtype == torch.float8_e4m3fn  # kept in fp8
    x = _x(3, 5, k, seed=k)
    _assert_fp32_product(layer(x), x, w)  # no activation quantization: the dequantized weight
    layer.quant_method = BlockFP8LinearMethod(CFG)
    _assert_fp32_product(layer(x), _act_quantized(x), w)


def test_unquantized_default_is_plain_linear():
    layer = ReplicatedLinear(8, 4)
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    assert layer.weight.dtype == torch.get_default_dtype()
    assert not hasattr(layer, "weight_scale_inv")


@pytest.mark.parametrize("n,aligned", [(512, True), (192, False)])
def test_column_parallel_shards_scales_with_rows(n, aligned):
    """tp 2: rank r holds rows [r*n/2, (r+1)*n/2). With n = 192 rank 0's 96 rows lie in one
    128-row block (compacted), rank 1's rows 96..191 straddle two blocks, so its scales stay one
    per row."""
    k = 200
    wq, s, w = _fp8(n, k, seed=1)
    x = _x(4, k, seed=n)
    for rank in range(2):
        layer = ColumnParallelLinear(k, n, tp_rank=rank, tp_size=2, quant_config=CFG_NO_ACT)
        _load(layer, wq, s)
        layer.quant_method.process_weights_after_loading(layer)
        assert layer.scale_block_n == (128 if aligned or rank == 0 else 1)
        rows = slice(rank * n // 2, (rank + 1) * n // 2)
        torch.testing.assert_close(layer.quant_method.dequantized_weight(layer), w[rows])
        _assert_fp32_product(layer(x), x, w[rows])


@pytest.mark.parametrize("inter,aligned", [(256, True), (64, False)])
def test_merged_gate_up_shards(inter, aligned):
    k = 160
    (gq, gs, g), (uq, us, u) = _fp8(inter, k, seed=2), _fp8(inter, k, seed=3)
    layer = MergedColumnParallelLinear(k, [inter, inter], shard_names=("gate", "up"),
                                       quant_config=CFG_NO_ACT)
    _load(layer, gq, gs, "gate")
    _load(layer, uq, us, "up")
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.scale_block_n == (128 if aligned else 1)
    x = _x(6, k, seed=inter)
    _assert_fp32_product(layer(x), x, torch.cat([g, u]))


def test_row_parallel_shards_scale_columns():
    n, k = 96, 512
    wq, s, w = _fp8(n, k, seed=4)
    for rank in range(2):
        layer = RowParallelLinear(k, n, tp_rank=rank, tp_size=2, quant_config=CFG)
        _load(layer, wq, s)
        layer.quant_method.process_weights_after_loading(layer)
        assert layer.weight_scale_inv.shape == (1, 2)
        cols = slice(rank * 256, (rank + 1) * 256)
        torch.testing.assert_close(layer.quant_method.dequantized_weight(layer), w[:, cols])
    with pytest.raises(ValueError, match="multiple of the K block"):
        RowParallelLinear(200, n, tp_rank=0, tp_size=2, quant_config=CFG)
    single = RowParallelLinear(k, n, quant_config=CFG_NO_ACT)
    _load(single, wq, s)
    x = _x(2, k, seed=n)
    _assert_fp32_product(single(x), x, w)


def test_bad_scale_shape_is_refused():
    wq, s, _ = _fp8(256, 128)
    layer = ReplicatedLinear(128, 256, quant_config=CFG)
    with pytest.raises(ValueError, match="weight_scale_inv"):
        layer.weight_loader(layer.weight_scale_inv, s[:1])
