"""DeepSeek-V3 (`DeepseekV3ForCausalLM`: MLA + noaux_tc MoE + YaRN) against Hugging Face
transformers' `DeepseekV3ForCausalLM`, fp32 on CPU, tiny random checkpoints from
`mla_tools/tiny_deepseek.make_tiny_deepseek_v3` (which carry an MTP layer, as the real checkpoint).

Harness, tolerances and the near-tie guard are test_deepseek_v2's: logits atol 2e-4, rtol 1e-4
(logit std ~3; observed max differences to HF ~2e-6), greedy token ids equal, every step's top-2
gap > 1e-4. The routing is also checked alone against a float64 reference written here and
against HF's `DeepseekV3TopkRouter`, and each V3 routing feature (the correction bias,
norm_topk_prob, routed_scaling_factor, the group limit) is shown to matter: ignoring it moves the
logits far outside the tolerance, so the HF comparison would fail.
"""

from __future__ import annotations

import json
import math
from unittest import mock

import deepseek_harness
import pytest
import torch
from deepseek_harness import DeepseekHarness
from safetensors import safe_open
from safetensors.torch import load_file

# The V2 suite's oracle helpers and tolerances (one definition of the comparison).
from test_deepseek_v2 import (ATOL, RTOL, _check_gap, _hf, _hf_greedy, _prompts,
                              assert_absorbed_matches_hf, assert_greedy_matches_hf)

from mla_backend.forward_batch import ForwardMode
from mla_backend.layers.moe import DeepseekV2MoE, select_experts_noaux_tc
from mla_backend.models.deepseek_v2 import DeepseekV3ForCausalLM
from mla_backend.models.registry import get_model_class

# 1 dense + 2 MoE layers; 16 experts in 4 groups, 2 groups kept, top-4; q_lora_rank (as V3).
SMALL = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             num_hidden_layers=3, num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=48)

VARIANTS = {
    "noaux_tc": {},
    # 2 dense layers (first_k_dense_replace), 8 groups of 2 with 3 kept, top-3.
    "dense2_groups8": dict(first_k_dense_replace=2, num_hidden_layers=4, n_group=8,
                           topk_group=3, num_experts_per_tok=3),
    # the config's norm_topk_prob / routed_scaling_factor are read, not assumed
    "no_norm_scale1": dict(norm_topk_prob=False, routed_scaling_factor=1.0),
    "q_proj_no_rope_scaling": dict(q_lora_rank=None, rope_scaling=None, n_shared_experts=2),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_intra_op_thread):
    """Tiny matmuls: see tests/models/conftest.py."""


def _v3_harness(path: str, **kwargs) -> DeepseekHarness:
    """`DeepseekHarness` (pools + torch_native backend) around our `DeepseekV3ForCausalLM`."""
    assert get_model_class(["DeepseekV3ForCausalLM"]) is DeepseekV3ForCausalLM
    with mock.patch.object(deepseek_harness, "DeepseekV2ForCausalLM", DeepseekV3ForCausalLM):
        h = DeepseekHarness(path, **kwargs)
    assert type(h.model) is DeepseekV3ForCausalLM
    return h


def _moe_layers(h: DeepseekHarness) -> list[DeepseekV2MoE]:
    return [m for m in h.model.modules() if isinstance(m, DeepseekV2MoE)]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_hf_prefill_and_greedy(tiny_deepseek_v3_factory, variant):
    path = tiny_deepseek_v3_factory(seed=1, **{**SMALL, **VARIANTS[variant]})
    hf = _hf(path)
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    lens = (5, 17, 1, 11)
    prompts = _prompts(hf.config.vocab_size, lens, seed=2)
    h = _v3_harness(path, decompress_min_tokens=10**9)  # absorbed everywhere
    cfg = hf.config
    moe = _moe_layers(h)
    assert len(moe) == cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert {(m.topk_method, m.scoring_func, m.norm_topk_prob, m.routed_scaling_factor)
            for m in moe} == {("noaux_tc", "sigmoid", cfg.norm_topk_prob,
                               cfg.routed_scaling_factor)}
    assert_absorbed_matches_hf(h, hf, prompts, lens)


def test_default_tiny_v3_decompressed_prefill_matches_hf(tiny_deepseek_v3_factory):
    """`TINY_DEEPSEEK_V3_DEFAULTS` as they are (hidden 256, 4 layers, 16 experts top-4, q_lora
    96, YaRN mscale 1.0): decompressed prefill, absorbed decode."""
    path = tiny_deepseek_v3_factory(seed=0)
    hf = _hf(path)
    prompts = _prompts(hf.config.vocab_size, (9, 3), seed=5)
    h = _v3_harness(path, decompress_min_tokens=8)
    paths = []
    step = h.step
    with mock.patch.object(h, "step", lambda *a: (step(*a), paths.append(h.last_path))[0]):
        new_tokens, prefill, step_logits = h.greedy(prompts, max_new_tokens=32)
    assert paths == ["decompressed"] + ["absorbed"] * 31
    with torch.inference_mode():
        ref = hf(torch.tensor([prompts[0]])).logits[0]
    torch.testing.assert_close(prefill[:9], ref, atol=ATOL, rtol=RTOL)
    assert_greedy_matches_hf(hf, prompts, new_tokens, step_logits)


def test_absorbed_decompressed_mha_agree(tiny_deepseek_v3_factory):
    path = tiny_deepseek_v3_factory(seed=3, **SMALL)
    prompts = _prompts(49152, (12, 30, 7), seed=4)
    results = {}
    for name, kwargs in (("absorbed", dict(decompress_min_tokens=10**9)),
                         ("decompressed", dict(decompress_min_tokens=1)),
                         ("mha", dict(disable_mla=True))):
        h = _v3_harness(path, **kwargs)
        results[name] = h.step([h.new_seq(p) for p in prompts], ForwardMode.EXTEND)
        assert h.last_path == name
    for name in ("decompressed", "mha"):
        torch.testing.assert_close(results[name], results["absorbed"], atol=ATOL, rtol=RTOL)


def _reference_noaux_tc(logits, bias, top_k, n_group, topk_group, norm, scale):
    """Float64, token by token, from the definition (DeepSeek-V3 report §2.1.2 + HF router):
    returns {expert id: weight} per token."""
    out = []
    for row in logits.double().tolist():
        s = [1.0 / (1.0 + math.exp(-x)) for x in row]
        c = [si + bi for si, bi in zip(s, bias.double().tolist())]
        per = len(c) // n_group
        group_score = [sum(sorted(c[g * per:(g + 1) * per], reverse=True)[:2])
                       for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        candidates = [e for g in kept for e in range(g * per, (g + 1) * per)]
        chosen = sorted(candidates, key=lambda e: -c[e])[:top_k]
        w = {e: s[e] for e in chosen}
        total = sum(w.values())
        out.append({e: (v / total if norm else v) * scale for e, v in w.items()})
    return out


@pytest.mark.parametrize("top_k,n_group,topk_group,norm,scale,bias_shift", [
    (4, 4, 2, True, 2.5, 0.0),
    (8, 8, 4, True, 2.5, -1.0),  # V3's shape (8 of 8 groups x 4 kept); all biased scores < 0
    (3, 8, 3, False, 1.0, 0.0),
    (2, 1, 1, True, 1.5, 0.5),  # one group: no group limit
])
def test_noaux_tc_routing_matches_float64_reference_and_hf(top_k, n_group, topk_group, norm,
                                                          scale, bias_shift):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    g = torch.Generator().manual_seed(top_k * 100 + n_group)
    t, e, hidden = 64, 32, 16
    x = torch.randn(t, hidden, generator=g)
    gate = torch.randn(e, hidden, generator=g) * 0.3
    bias = torch.randn(e, generator=g) * 0.1 + bias_shift
    logits = x @ gate.T
    w, ids = select_experts_noaux_tc(logits, bias, top_k, n_group, topk_group, norm, scale)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert w.shape == ids.shape == (t, top_k)
    ref = _reference_noaux_tc(logits, bias, top_k, n_group, topk_group, norm, scale)
    for row in range(t):
        got = dict(zip(ids[row].tolist(), w[row].tolist()))
        assert sorted(got) == sorted(ref[row]), f"token {row}: experts differ"
        for ex, wt in ref[row].items():
            assert got[ex] == pytest.approx(wt, rel=1e-5, abs=1e-6)

    # transformers' router, same weights: same experts and weights.
    cfg = DeepseekV3Config(hidden_size=hidden, n_routed_experts=e, num_experts_per_tok=top_k,
                           n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                           routed_scaling_factor=scale)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(gate)
        router.e_score_correction_bias.copy_(bias)
        _, hf_w, hf_ids = router(x)
    order, hf_order = ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(w.gather(1, order), hf_w.gather(1, hf_order), atol=1e-6,
                               rtol=1e-5)


def test_noaux_tc_hand_made_case():
    """Groups scored by the sum of their top-2 biased scores (not their best one); the bias
    chooses, the un-biased sigmoid weighs."""
    # 3 groups of 2. Sigmoid scores: g0 {0.9, 0.1}, g1 {0.62, 0.58}, g2 {0.2, 0.2}.
    s = torch.tensor([[0.9, 0.1, 0.62, 0.58, 0.2, 0.2]])
    logits = torch.log(s / (1 - s))
    zero = torch.zeros(6)
    _, ids = select_experts_noaux_tc(logits, zero, 1, 3, 1, norm_topk_prob=False)
    assert ids.tolist() == [[2]]  # g1 (sum 1.2) beats g0 (sum 1.0), whose best is 0.9
    # Bias +0.5 on experts 4 and 5: g2 sums 1.4 and wins; the weights stay the sigmoid.
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.5])
    w, ids = select_experts_noaux_tc(logits, bias, 2, 3, 1, norm_topk_prob=False)
    assert sorted(ids[0].tolist()) == [4, 5]
    torch.testing.assert_close(w[0], torch.tensor([0.2, 0.2]))  # the sigmoid, not 0.7
    w, _ = select_experts_noaux_tc(logits, bias, 2, 3, 1, norm_topk_prob=True,
                                   routed_scaling_factor=2.5)
    torch.testing.assert_close(w[0], torch.tensor([1.25, 1.25]))
    with pytest.raises(ValueError):
        select_experts_noaux_tc(logits, zero, 2, 4, 1)  # 6 experts in 4 groups
    with pytest.raises(ValueError):
        select_experts_noaux_tc(logits, zero, 3, 3, 1)  # top-3 from one group of 2


# Each ablation drops one V3 routing feature from every MoE layer of our model.
ABLATIONS = {
    "e_score_correction_bias": lambda m: m.gate.e_score_correction_bias.data.zero_(),
    "norm_topk_prob": lambda m: setattr(m, "norm_topk_prob", False),
    "routed_scaling_factor": lambda m: setattr(m, "routed_scaling_factor", 1.0),
    "group_limit": lambda m: setattr(m, "topk_group", m.n_group),
}


@pytest.mark.parametrize("feature", sorted(ABLATIONS))
def test_ignoring_a_routing_feature_breaks_hf_agreement(tiny_deepseek_v3_factory, feature):
    path = tiny_deepseek_v3_factory(seed=1, **SMALL)
    hf = _hf(path)
    prompts = _prompts(hf.config.vocab_size, (17, 11), seed=2)
    with torch.inference_mode():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    h = _v3_harness(path, decompress_min_tokens=10**9)
    good = h.step([h.new_seq(p) for p in prompts], ForwardMode.EXTEND)
    torch.testing.assert_close(good, ref, atol=ATOL, rtol=RTOL)

    bad_h = _v3_harness(path, decompress_min_tokens=10**9)
    for m in _moe_layers(bad_h):
        ABLATIONS[feature](m)
    bad = bad_h.step([bad_h.new_seq(p) for p in prompts], ForwardMode.EXTEND)
    err = (bad - ref).abs().max().item()
    assert err > 100 * ATOL, f"ignoring {feature} changes the logits by only {err:.2e}"
    assert (bad.argmax(-1) != ref.argmax(-1)).any()  # greedy tokens change too


def test_weights_real_names_mtp_skipped_fp32_router(tiny_deepseek_v3_factory):
    path = tiny_deepseek_v3_factory(seed=1, **SMALL)
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        names = set(f.keys())
    # Real V3 names: per-expert matrices, router weight and correction bias, MTP layer 3.
    assert "model.layers.1.mlp.experts.15.gate_proj.weight" in names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.0.mlp.gate.weight" not in names  # first_k_dense_replace = 1
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.mlp.gate.weight"} <= names
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    assert (cfg["model_type"], cfg["architectures"], cfg["num_nextn_predict_layers"]) == (
        "deepseek_v3", ["DeepseekV3ForCausalLM"], 1)

    # A bf16 model keeps the router weight and bias in fp32.
    from transformers import AutoConfig

    hf_cfg = AutoConfig.from_pretrained(path)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = DeepseekV3ForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(old)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].mlp.experts.w13_weight.dtype == torch.bfloat16
    sd = load_file(f"{path}/model.safetensors")
    model.load_weights(sd.items())  # MTP layer 3 ignored, everything filled
    torch.testing.assert_close(gate.e_score_correction_bias,
                               sd["model.layers.1.mlp.gate.e_score_correction_bias"])

    # Without the bias the checkpoint is incomplete.
    del sd["model.layers.2.mlp.gate.e_score_correction_bias"]
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        DeepseekV3ForCausalLM(hf_cfg).load_weights(sd.items())

    # Configs V3 cannot mean are refused with a clear error.
    with pytest.raises(ValueError, match="noaux_tc"):
        DeepseekV3ForCausalLM(AutoConfig.from_pretrained(path, topk_method="greedy"))
    # Block-FP8 (V3's published format, tests/models/test_deepseek_v3_fp8.py) and per-tensor FP8
    # (tests/models/test_fp8_per_tensor.py) are supported; other quantizations are refused.
    other = AutoConfig.from_pretrained(path)
    other.quantization_config = {"quant_method": "awq"}
    with pytest.raises(NotImplementedError, match="awq"):
        DeepseekV3ForCausalLM(other)


# bf16: logits std ~3; bf16 rounding moves a position's logits by <= ~0.3 (HF's own bf16 run
# vs its fp32 run: 0.12-0.32 here). A routing choice that bf16 flips moves them by O(1) (the tiny
# V3's experts matter: `mla_tools.tiny_deepseek._rescale_projections`), for either implementation.
BF16_POS_ATOL, BF16_MIN_FRACTION = 0.5, 0.9


def test_bf16_model_runner_close_to_hf_fp32(tiny_deepseek_v3_factory):
    """bf16 weights and activations, router (weight + bias) in fp32: per position max
    |logit - HF fp32| <= BF16_POS_ATOL on >= 90% of positions (the rest: bf16 routing flips)."""
    from mla_backend.config import EngineConfig
    from mla_backend.model_executor.model_runner import ModelRunner

    path = tiny_deepseek_v3_factory(seed=1, **SMALL)
    runner = ModelRunner(EngineConfig.create(model_path=path, device="cpu", dtype="bfloat16",
                                             max_total_tokens=256))
    model = runner.model
    assert type(model) is DeepseekV3ForCausalLM
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].self_attn.w_kc.dtype == torch.bfloat16
    prompt = _prompts(49152, (40,), seed=9)[0]
    (row,) = runner.req_to_token_pool.alloc(1)
    slots = runner.token_to_kv_pool_allocator.alloc(40)
    runner.req_to_token_pool.req_to_token[row, :40] = slots.to(torch.int32)
    fb = runner.make_forward_batch(ForwardMode.EXTEND, prompt, list(range(40)), [row], [40],
                                   [0], [40], slots, return_all_logits=True)
    logits = runner.forward(fb).float()
    with torch.inference_mode():
        ref = _hf(path)(torch.tensor([prompt])).logits[0]
    per_pos = (logits - ref).abs().max(-1).values
    assert (per_pos <= BF16_POS_ATOL).float().mean() >= BF16_MIN_FRACTION, per_pos.tolist()
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("settings", [{}, {"mla_decompress_min_tokens": 0}])
def test_engine_greedy_equals_hf(tiny_deepseek_v3_factory, settings):
    """Through the whole engine (registry, ModelRunner, scheduler, radix cache, sampler)."""
    from transformers import AutoTokenizer

    from mla_backend.config import EngineConfig
    from mla_backend.engine import Engine
    from mla_backend.request import SamplingParams

    path = tiny_deepseek_v3_factory(seed=1, **{**SMALL, "hidden_size": 128})
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
    n = 24
    tok = AutoTokenizer.from_pretrained(path)
    hf = _hf(path)
    expected = []
    for p in prompts:
        ids = tok(p).input_ids
        tokens, scores = _hf_greedy(hf, ids, n)
        _check_gap(scores)
        expected.append(tokens)
    eng = Engine(EngineConfig.create(model_path=path, dtype="float32", device="cpu", **settings))
    assert type(eng.runner.model) is DeepseekV3ForCausalLM
    # HF ran without an EOS (eos_token_id=None); so does the engine (ignore_eos).
    greedy = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    got = [r.token_ids for r in eng.generate(prompts, greedy)]
    assert got == expected
    eng.check_invariant()
