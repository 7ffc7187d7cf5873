"""FP8 routed experts at model level, through the fused triton kernels: the tiny block-FP8
DeepSeek-V3 (`make_tiny_deepseek_v3_fp8`; routed experts kept FP8 with block scales) and the tiny
DeepSeek-V2 with online `quantization="fp8"` (experts FP8 per expert per tensor), with every MoE
layer forced onto `fused_experts` (`DeepseekV2MoE.fused_moe = True`; triton's interpreter on
CPU) against the same model on the torch loop `experts_forward` (the path CPU runs take, checked
against HF / fp32 in test_deepseek_v3_fp8.py and test_fp8_per_tensor.py).

The two forms do the same FP8 math on the same quantized operands; only fp32 summation order
differs, which can move an activation across an e4m3 rounding boundary now and then. Tolerance:
relative RMS logit difference <= 1e-3 and equal argmax at >= 99% of positions (measured
1.7e-7 (V3 block FP8) and 8.3e-8 (V2 online FP8), argmax equal everywhere).
"""

from __future__ import annotations

from unittest import mock

import deepseek_harness
import pytest
import torch
from deepseek_harness import DeepseekHarness

from mla_backend.forward_batch import ForwardMode
from mla_backend.layers.moe import BlockFP8MoEMethod, DeepseekV2MoE, Fp8MoEMethod
from mla_backend.models.deepseek_v2 import DeepseekV3ForCausalLM

REL, TOP1 = 1e-3, 0.99


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_intra_op_thread):
    """Tiny matmuls: see tests/models/conftest.py."""


def _prompts(vocab: int, lens: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(9)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _run(h: DeepseekHarness, fused: bool, lens: tuple[int, ...]) -> torch.Tensor:
    """Prefill the prompts, then one decode step; logits of both, concatenated."""
    for m in h.model.modules():
        if isinstance(m, DeepseekV2MoE):
            m.fused_moe = fused
    seqs = [h.new_seq(p) for p in _prompts(h.hf_config.vocab_size, lens)]
    prefill = h.step(seqs, ForwardMode.EXTEND)
    ends = torch.tensor([len(s.tokens) for s in seqs]).cumsum(0) - 1
    for s, nxt in zip(seqs, prefill[ends].argmax(-1).tolist()):
        s.tokens.append(nxt)
    return torch.cat([prefill, h.step(seqs, ForwardMode.DECODE)])


def _compare(make, lens: tuple[int, ...]) -> None:
    """lens: prompt lengths with sum * top_k > GEMV_MAX_ROWS (the prefill takes the sorted
    path; the decode step, 2 tokens, the GEMV path)."""
    loop = _run(make(), False, lens)
    fused = _run(make(), True, lens)
    rel = float((fused - loop).norm() / loop.norm())
    top1 = float((fused.argmax(-1) == loop.argmax(-1)).float().mean())
    assert rel <= REL and top1 >= TOP1, (rel, top1)


def test_block_fp8_v3_fused_equals_loop(tiny_deepseek_v3_fp8_factory):
    fp8, _ = tiny_deepseek_v3_fp8_factory(seed=0)

    def make() -> DeepseekHarness:
        with mock.patch.object(deepseek_harness, "DeepseekV2ForCausalLM", DeepseekV3ForCausalLM):
            h = DeepseekHarness(fp8, decompress_min_tokens=10**9)
        experts = h.model.model.layers[1].mlp.experts
        assert isinstance(experts.quant_method, BlockFP8MoEMethod)
        assert experts.w13_weight.dtype == torch.float8_e4m3fn
        return h

    _compare(make, (16, 13))  # top-4: 116 rows


def test_online_fp8_v2_fused_equals_loop(tiny_deepseek_factory):
    path = tiny_deepseek_factory(seed=0)
    from mla_backend.config import ModelConfig

    def make() -> DeepseekHarness:
        def mc(**kw):
            return ModelConfig(quantization="fp8", **kw)

        with mock.patch.object(deepseek_harness, "ModelConfig", mc):
            h = DeepseekHarness(path, decompress_min_tokens=10**9)
        moe = [m for m in h.model.modules() if isinstance(m, DeepseekV2MoE)]
        assert moe and all(isinstance(m.experts.quant_method, Fp8MoEMethod)
                           and m.experts.w2_weight.dtype == torch.float8_e4m3fn for m in moe)
        return h

    _compare(make, (24, 31))  # top-2: 110 rows


def test_norms_hand_fp8_inputs_to_the_linears(tiny_deepseek_factory, monkeypatch):
    """Online FP8 V2, fused MoE: the norms write their output quantized per token
    (`RMSNorm.prenorm` with fp8) for the attention's fused input projection and for the MoE,
    whose shared and routed experts share it. The logits equal (bit for bit) those of the same
    model where every FP8 consumer quantizes its input itself, with one quantization fewer
    per MoE layer and forward (the shared and the routed experts quantized the same rows)."""
    import mla_kernels.fp8_quant as fq

    from mla_backend.config import ModelConfig
    from mla_backend.layers.layernorm import RMSNorm

    path = tiny_deepseek_factory(seed=0)

    def make() -> DeepseekHarness:
        with mock.patch.object(deepseek_harness, "ModelConfig",
                               lambda **kw: ModelConfig(quantization="fp8", **kw)):
            return DeepseekHarness(path, decompress_min_tokens=10**9)

    calls = []
    real_quant = fq.quantize_per_token
    monkeypatch.setattr(fq, "quantize_per_token", lambda x: calls.append(1) or real_quant(x))
    h = make()
    layers = h.model.model.layers
    assert all(layer.self_attn.takes_fp8_input and layer.mlp.takes_fp8_input
               for layer in layers)
    n_moe = sum(isinstance(layer.mlp, DeepseekV2MoE) and layer.mlp.shared_experts is not None
                for layer in layers)
    assert n_moe >= 1
    calls.clear()
    handed = _run(h, True, (24, 31))
    n_handed = len(calls)
    real_prenorm = RMSNorm.prenorm
    monkeypatch.setattr(RMSNorm, "prenorm",
                        lambda self, x, r, fp8=False: real_prenorm(self, x, r, False))
    h = make()
    calls.clear()
    own = _run(h, True, (24, 31))
    assert torch.equal(handed, own)
    assert n_handed == len(calls) - 2 * n_moe  # two forwards (prefill, decode)
