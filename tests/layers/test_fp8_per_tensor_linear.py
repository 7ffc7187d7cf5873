"""`Fp8LinearMethod` on single layers: merged shards with different checkpoint scales
(requantized to the max, vLLM's rule), static input scale (max of shards), dynamic activations,
saturation without NaN, config parsing. Tolerance: relative error <= 0.06 against the fp32
matmul of the original weights (measured 0.039 static / ~0.03 dynamic on N(0,1) inputs)."""

from __future__ import annotations

import pytest
import torch

from mla_backend.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from mla_backend.layers.quantization import (
    BlockFP8Config,
    Fp8Config,
    quant_config_from_hf,
    quantize_fp8_per_tensor,
)


def _merged(scheme: str) -> tuple[MergedColumnParallelLinear, torch.Tensor]:
    torch.manual_seed(0)
    layer = MergedColumnParallelLinear(64, [32, 48], quant_config=Fp8Config(True, scheme))
    w0, w1 = torch.randn(32, 64) * 0.01, torch.randn(48, 64) * 3
    for i, w in enumerate((w0, w1)):
        q, s = quantize_fp8_per_tensor(w)
        layer.weight_loader(layer.weight, q, i)
        layer.weight_loader(layer.weight_scale, s, i)
        if scheme == "static":
            layer.weight_loader(layer.input_scale, torch.tensor(0.01 * (i + 1)), i)
    layer.quant_method.process_weights_after_loading(layer)
    return layer, torch.cat([w0, w1])


@pytest.mark.parametrize("scheme", ["static", "dynamic"])
def test_merged_shards_requantized_to_max_scale(scheme):
    layer, w = _merged(scheme)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dim() == 0
    assert float(layer.weight_scale) == pytest.approx(float(w[32:].abs().max() / 448))
    if scheme == "static":
        assert float(layer.input_scale) == pytest.approx(0.02)
    x = torch.randn(5, 64)
    ref = x @ w.t()
    y = layer(x)
    assert y.dtype == torch.float32
    assert float((y - ref).norm() / ref.norm()) <= 0.06


@pytest.mark.parametrize("scheme", ["static", "dynamic"])
def test_ignoring_weight_scale_is_caught(scheme):
    layer, w = _merged(scheme)
    x = torch.randn(5, 64)
    ref = x @ w.t()
    # the rowwise GEMM's column scales are the scalar repeated (the dynamic path reads them)
    assert torch.equal(layer.weight_scale_row, layer.weight_scale.expand(1, 80))
    layer.weight_scale.data.fill_(1.0)
    layer.weight_scale_row.data.fill_(1.0)
    assert float((layer(x) - ref).norm() / ref.norm()) > 1.0


def test_dynamic_activations_scaled_per_token():
    """Rows 1e-4 and 1e4 times the others: one scale per tensor would flush the small rows to
    zero (their values far below 2^-9 of the tensor's scale); per token each row keeps ~2^-4."""
    layer, w = _merged("dynamic")
    x = torch.randn(6, 64) * torch.tensor([1.0, 1e-4, 1.0, 1e4, 1e-4, 1.0])[:, None]
    ref = x @ w.t()
    rel = (layer(x) - ref).norm(dim=1) / ref.norm(dim=1)
    assert float(rel.max()) <= 0.06, rel


def test_saturates_without_nan():
    q, s = quantize_fp8_per_tensor(torch.tensor([1e30, -1e30, 1.0]), torch.tensor(1.0))
    assert q.float().tolist() == [448.0, -448.0, 1.0]
    layer = RowParallelLinear(16, 8, quant_config=Fp8Config())
    layer.weight_loader(layer.weight, torch.randn(8, 16))
    layer.quant_method.process_weights_after_loading(layer)
    y = layer(torch.full((2, 16), 1e6))
    assert torch.isfinite(y).all()
    assert torch.isfinite(layer(torch.zeros(2, 16))).all()


def test_quant_config_from_hf():
    assert quant_config_from_hf(None, "") is None
    assert quant_config_from_hf(None, "fp8") == Fp8Config()
    c = quant_config_from_hf({"quant_method": "fp8", "activation_scheme": "static"})
    assert c == Fp8Config(True, "static")
    assert isinstance(quant_config_from_hf({"quant_method": "fp8",
                                            "weight_block_size": [128, 128]}, "fp8"),
                      BlockFP8Config)
    with pytest.raises(ValueError):
        quant_config_from_hf(None, "int4")
    with pytest.raises(NotImplementedError):
        quant_config_from_hf({"quant_method": "awq"})
