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


# ---------------------------------------------------------------------------- GPU
def _twin(x: torch.Tensor, w_q: torch.Tensor, w_scale_row: torch.Tensor) -> torch.Tensor:
    """float32 twin of `fp8_per_token_mm`: the same per-token quantization (torch), exact fp8
    products summed in float32, both scales."""
    from mla_kernels.fp8_quant import quantize_per_token

    q, s = quantize_per_token(x.float().cpu())
    return (q.float() @ w_q.float().cpu().t()) * s * w_scale_row.float().cpu()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 7, 768])
def test_rowwise_fp8_gemm_on_cuda(m, out_dtype):
    """The dynamic FP8 linear on CUDA (the triton per-token quantization, then a rowwise-scaled
    `torch._scaled_mm` for bf16 output, else an unscaled FP8 GEMM into float32 scaled after)
    against its float32 twin, with a fused matrix's two column scales, and in a CUDA graph.
    Tolerance: 2^-7 relative (bf16 / fp16 output rounding) plus 1e-3 of max |ref| (Hopper's
    FP8 tensor cores accumulate at reduced precision within K chunks)."""
    from mla_backend.layers.quantization import fp8_per_token_mm, quantize_fp8_per_tensor

    g = torch.Generator().manual_seed(m)
    k, n1, n2 = 2048, 3072, 576  # V2-Lite's q_proj + kv_a_proj_with_mqa
    w1, s1 = quantize_fp8_per_tensor(torch.randn(n1, k, generator=g) * 0.02)
    w2, s2 = quantize_fp8_per_tensor(torch.randn(n2, k, generator=g) * 0.5)
    w = torch.cat([w1, w2]).cuda()  # [N, K] row-major: w.t() is the column-major B operand
    scale_row = torch.cat([s1.expand(1, n1), s2.expand(1, n2)], dim=1).contiguous().cuda()
    x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m)[:, None]).to(out_dtype).cuda()
    ref = _twin(x, w, scale_row)
    y = fp8_per_token_mm(x, w.t(), scale_row)
    assert y.dtype == out_dtype and y.shape == (m, n1 + n2)
    err = (y.float().cpu() - ref).abs()
    bound = 2.0**-7 * ref.abs() + 1e-3 * ref.abs().amax(dim=1, keepdim=True)
    assert (err <= bound).all(), float((err / bound).max())
    # the column slices a fused matrix's parts use (views of one [1, N] row)
    y2 = fp8_per_token_mm(x, w[n1:].t(), scale_row[:, n1:])
    assert ((y2.float().cpu() - ref[:, n1:]).abs() <= bound[:, n1:]).all()
    # capture and replay: no host sync, same result
    graph = torch.cuda.CUDAGraph()
    fp8_per_token_mm(x, w.t(), scale_row)  # warm-up (allocations, cuBLASLt heuristics)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        y_graph = fp8_per_token_mm(x, w.t(), scale_row)
    graph.replay()
    torch.cuda.synchronize()
    assert ((y_graph.float().cpu() - ref).abs() <= bound).all()
