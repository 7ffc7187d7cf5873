"""DeepSeek building blocks: YaRN rotary + softmax scale (vs REFERENCE §1.4/§1.5 numbers and vs
transformers), MoE routing and experts (vs brute-force float64), weight loading errors, and the
tiny checkpoint maker."""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_ds

from mla_backend.layers.moe import experts_forward, select_experts
from mla_backend.layers.rotary_deepseek import (
    DeepseekRotaryEmbedding,
    deepseek_rope_config,
    softmax_scale,
    yarn_inv_freq,
)
from mla_backend.models.deepseek_v2 import DeepseekV2ForCausalLM
from mla_tools.tiny_deepseek import make_tiny_deepseek_v2, tiny_deepseek_v2_config

V2_LITE_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


def test_softmax_scale_reference_numbers():
    assert softmax_scale(192, None) == pytest.approx(192 ** -0.5)
    assert softmax_scale(192, V2_LITE_YARN) == pytest.approx(0.11472, abs=1e-5)
    v3 = dict(V2_LITE_YARN, mscale=1.0, mscale_all_dim=1.0)
    assert softmax_scale(192, v3) == pytest.approx(0.13523, abs=1e-5)
    # never the absorbed head dim's own 576^-0.5
    assert abs(softmax_scale(192, V2_LITE_YARN) - 576 ** -0.5) > 0.05


def test_yarn_inv_freq_ramp_v2_lite():
    inv = yarn_inv_freq(64, 10000.0, 40.0, 4096, 32, 1)
    base = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    torch.testing.assert_close(inv[:10], base[:10])  # below low = 10: original
    torch.testing.assert_close(inv[23:], base[23:] / 40)  # from high = 23 on: divided by 40
    r = (16 - 10) / 13  # linear blend in between
    torch.testing.assert_close(inv[16], (1 - r) * base[16] + r * base[16] / 40)


def _hf_rope(rope_dim: int, scaling: dict | None, max_pos: int = 163840):
    cfg = hf_ds.DeepseekV2Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=rope_dim,
                                 max_position_embeddings=max_pos, rope_theta=10000.0,
                                 rope_scaling=dict(scaling) if scaling else None)
    return cfg, hf_ds.DeepseekV2RotaryEmbedding(cfg)


@pytest.mark.parametrize("scaling", [None, V2_LITE_YARN,
                                     dict(V2_LITE_YARN, mscale=1.0, mscale_all_dim=0.5)])
def test_rotary_matches_hf_and_original_deinterleaved_form(scaling):
    cfg, hf_rope = _hf_rope(64, scaling)
    theta, yarn = deepseek_rope_config(cfg)
    ours = DeepseekRotaryEmbedding(64, theta, yarn)
    pos = torch.tensor([0, 1, 7, 4095, 4096, 100_000, 163_839])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(pos), 3, 64, generator=g)
    k = torch.randn(len(pos), 1, 64, generator=g)
    q_out, k_out = ours(pos, q, k)
    freqs_cis = hf_rope(q, pos[None])  # [1, T, 32] complex
    hq, hk = hf_ds.apply_rotary_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], freqs_cis)
    torch.testing.assert_close(q_out, hq[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, hk[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    assert ours.mscale == pytest.approx(hf_rope.attention_scaling)

    # DeepSeek's original code: de-interleave, then rotate halves. Scores q.k are the same.
    cos, sin = ours.cos_sin(pos)
    cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]

    def original(x):
        x = x.view(*x.shape[:-1], 32, 2).transpose(-1, -2).reshape(x.shape)
        rot = torch.cat([-x[..., 32:], x[..., :32]], dim=-1)
        return x * cos + rot * sin

    torch.testing.assert_close(torch.einsum("thd,tkd->th", q_out, k_out),
                               torch.einsum("thd,tkd->th", original(q), original(k)),
                               atol=1e-4, rtol=1e-4)


def test_routing_greedy_and_group_limited():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 16, generator=g)
    w, ids = select_experts(logits, 3, "greedy", routed_scaling_factor=2.0)
    probs = logits.softmax(-1)
    ref_w, ref_ids = probs.topk(3, -1)
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    torch.testing.assert_close(w.sort(-1).values, (2.0 * ref_w).sort(-1).values)

    w, _ = select_experts(logits, 3, "greedy", norm_topk_prob=True, routed_scaling_factor=1.5)
    torch.testing.assert_close(w.sum(-1), torch.full((50,), 1.5))

    # Group-limited: 4 groups of 2. Expert 0 and 1 (group 0) are the best two, but group 1 and
    # group 3 hold the best single experts after them... here a hand-made case:
    # scores: group0 = {0.30, 0.29}, group1 = {0.31, 0.0}, group2 = {0.05, 0.05}
    probs = torch.tensor([[0.30, 0.29, 0.31, 0.0, 0.05, 0.05, 0.0, 0.0]])
    logit = probs.clamp_min(1e-9).log()
    w, ids = select_experts(logit, 2, "group_limited_greedy", n_group=4, topk_group=1)
    assert sorted(ids[0].tolist()) == [2, 3]  # only group 1 survives (best member 0.31)
    w, ids = select_experts(logit, 2, "group_limited_greedy", n_group=4, topk_group=2)
    assert sorted(ids[0].tolist()) == [0, 2]
    torch.testing.assert_close(w[0].sort().values, torch.tensor([0.30, 0.31]), atol=1e-6,
                               rtol=1e-5)
    with pytest.raises(ValueError):
        select_experts(logit, 2, "noaux_tc")
    with pytest.raises(ValueError):
        select_experts(logit, 2, "group_limited_greedy", n_group=3, topk_group=1)


def test_experts_forward_matches_dense_float64():
    g = torch.Generator().manual_seed(1)
    t, h, inter, e, k = 9, 16, 8, 6, 2
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) * 0.3
    w2 = torch.randn(e, h, inter, generator=g) * 0.3
    w, ids = select_experts(torch.randn(t, e, generator=g), k)
    out = experts_forward(x, w13, w2, w, ids)
    ref = torch.zeros(t, h, dtype=torch.float64)
    for ti in range(t):
        for wk, ei in zip(w[ti].tolist(), ids[ti].tolist()):
            a = w13[ei].double() @ x[ti].double()
            ref[ti] += wk * (w2[ei].double() @ (torch.nn.functional.silu(a[:inter]) * a[inter:]))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_tiny_checkpoint_deterministic_and_config(tmp_path):
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=16,
                 qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, vocab_size=300,
                 q_lora_rank=12)
    a = make_tiny_deepseek_v2(str(tmp_path / "a"), seed=3, **small)
    b = make_tiny_deepseek_v2(str(tmp_path / "b"), seed=3, **small)
    c = make_tiny_deepseek_v2(str(tmp_path / "c"), seed=4, **small)
    read = lambda d: open(os.path.join(d, "model.safetensors"), "rb").read()  # noqa: E731
    assert read(a) == read(b) != read(c)
    cfg = json.load(open(os.path.join(a, "config.json")))
    assert cfg["model_type"] == "deepseek_v2"
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"]
    assert cfg["q_lora_rank"] == 12 and cfg["rope_scaling"]["factor"] == 40
    d = tiny_deepseek_v2_config()
    assert (d["vocab_size"], d["hidden_size"], d["num_hidden_layers"], d["kv_lora_rank"],
            d["q_lora_rank"], d["n_routed_experts"], d["num_experts_per_tok"]) == (
        49152, 256, 4, 128, None, 8, 2)
    with pytest.raises(ValueError):
        tiny_deepseek_v2_config(n_group=3)
    with pytest.raises(FileNotFoundError):
        make_tiny_deepseek_v2(str(tmp_path / "d"), tokenizer_dir=str(tmp_path), **small)


def test_load_weights_rejects_unknown_and_missing(tmp_path):
    from transformers import AutoConfig

    from mla_backend.model_executor.model_loader import iterate_weights

    path = make_tiny_deepseek_v2(str(tmp_path / "m"), hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                                 qk_rope_head_dim=4, v_head_dim=8, vocab_size=300)
    hf_config = AutoConfig.from_pretrained(path)
    weights = list(iterate_weights(path))
    with pytest.raises(KeyError):
        DeepseekV2ForCausalLM(hf_config).load_weights(weights + [("model.bogus", torch.zeros(1))])
    with pytest.raises(ValueError, match="missing"):
        DeepseekV2ForCausalLM(hf_config).load_weights(
            [(n, w) for n, w in weights if "experts.3.up_proj" not in n])
    model = DeepseekV2ForCausalLM(hf_config)
    model.load_weights(weights)
    model.post_load_weights()
    attn = model.model.layers[1].self_attn
    kv_b = dict(weights)["model.layers.1.self_attn.kv_b_proj.weight"].view(2, 16, 16)
    assert attn.w_kc.shape == (2, 8, 16) and attn.w_vc.shape == (2, 16, 8)
    assert torch.equal(attn.w_kc, kv_b[:, :8]) and torch.equal(attn.w_vc, kv_b[:, 8:].mT)
    assert attn.attn_mqa.scaling == attn.attn_mha.scaling == pytest.approx(
        12 ** -0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2)
    assert (attn.attn_mqa.head_dim, attn.attn_mqa.v_head_dim, attn.attn_mqa.num_kv_heads) == (
        20, 16, 1)
    hf_like = SimpleNamespace(rope_parameters=None, rope_scaling=None, rope_theta=500.0)
    assert deepseek_rope_config(hf_like) == (500.0, None)


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_input_projections_fused_into_one_matrix(tmp_path, q_lora_rank):
    """After post_load_weights the first query projection and kv_a_proj_with_mqa are row views
    of one matrix (no extra memory), their product equals the two separate products, and an
    in-place weight load reaches the fused matrix."""
    from transformers import AutoConfig

    from mla_backend.model_executor.model_loader import iterate_weights

    path = make_tiny_deepseek_v2(str(tmp_path / "m"), hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                                 qk_rope_head_dim=4, v_head_dim=8, vocab_size=300,
                                 q_lora_rank=q_lora_rank)
    hf_config = AutoConfig.from_pretrained(path)
    weights = dict(iterate_weights(path))
    model = DeepseekV2ForCausalLM(hf_config)
    model.load_weights(weights.items())
    model.post_load_weights()
    attn = model.model.layers[0].self_attn
    first_name = "q_proj" if q_lora_rank is None else "q_a_proj"
    first = getattr(attn, first_name)
    w = attn.w_input_proj
    n = first.weight.shape[0]
    assert w is not None and w.shape == (n + 20, 32)
    assert first.weight.data_ptr() == w.data_ptr()
    assert attn.kv_a_proj_with_mqa.weight.data_ptr() == w[n:].data_ptr()
    ckpt = weights[f"model.layers.0.self_attn.{first_name}.weight"]
    assert torch.equal(w[:n], ckpt)
    x = torch.randn(3, 32)
    q, kv_a = attn._input_projections(x)
    q_sep = x @ ckpt.T
    if q_lora_rank is not None:
        q_sep = attn.q_b_proj(attn.q_a_layernorm(q_sep))
    torch.testing.assert_close(q, q_sep)
    torch.testing.assert_close(
        kv_a, x @ weights["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].T)
    # a later in-place load of one projection (its weight loader) updates the fused matrix
    first.weight_loader(first.weight, ckpt * 2)
    assert torch.equal(w[:n], ckpt * 2)


def test_input_projections_fused_for_dynamic_fp8(tmp_path):
    """Online FP8 (dynamic activations): the two FP8 weights become row views of one FP8
    matrix and their column scales views of one [1, N] row (each part keeps its own per-tensor
    scale); the fused product equals each linear's own FP8 product bit for bit (the same
    per-token quantization of the same input, the same fp8 products and scales)."""
    from mla_backend.config import ModelConfig
    from transformers import AutoConfig

    from mla_backend.model_executor.model_loader import iterate_weights

    path = make_tiny_deepseek_v2(str(tmp_path / "m"), hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                                 qk_rope_head_dim=4, v_head_dim=8, vocab_size=300)
    model = DeepseekV2ForCausalLM(AutoConfig.from_pretrained(path),
                                  ModelConfig(model_path=path, quantization="fp8"))
    model.load_weights(iterate_weights(path))
    model.post_load_weights()
    attn = model.model.layers[0].self_attn
    w, scale = attn.w_input_proj, attn.w_input_proj_scale
    q_proj, kv = attn.q_proj, attn.kv_a_proj_with_mqa
    n = q_proj.weight.shape[0]
    assert w.dtype == torch.float8_e4m3fn and w.shape == (n + 20, 32)
    assert scale.shape == (1, n + 20) and scale.dtype == torch.float32
    assert q_proj.weight.data_ptr() == w.data_ptr()
    assert kv.weight.data_ptr() == w[n:].data_ptr()
    assert kv.weight_scale_row.data_ptr() == scale[:, n:].data_ptr()
    assert torch.equal(scale[0, :n], q_proj.weight_scale.expand(n))
    assert torch.equal(scale[0, n:], kv.weight_scale.expand(20))
    assert float(q_proj.weight_scale) != float(kv.weight_scale)  # two scales in one GEMM
    x = torch.randn(3, 32)
    q, kv_a = attn._input_projections(x)
    assert torch.equal(q, q_proj(x)) and torch.equal(kv_a, kv(x))


def test_input_projections_not_fused_for_static_fp8(tmp_path):
    """A per-tensor FP8 checkpoint with static input scales keeps the two linears apart (each
    quantizes its input with its own static scale)."""
    from fp8_per_tensor_ckpt import write_fp8_per_tensor_copy
    from mla_backend.config import ModelConfig
    from transformers import AutoConfig

    from mla_backend.model_executor.model_loader import iterate_weights

    path = make_tiny_deepseek_v2(str(tmp_path / "m"), hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                                 qk_rope_head_dim=4, v_head_dim=8, vocab_size=300)
    ckpt = write_fp8_per_tensor_copy(path, str(tmp_path / "fp8"), activation_scheme="static")
    model = DeepseekV2ForCausalLM(AutoConfig.from_pretrained(ckpt), ModelConfig(model_path=ckpt))
    model.load_weights(iterate_weights(ckpt))
    model.post_load_weights()
    attn = model.model.layers[0].self_attn
    assert hasattr(attn.q_proj, "input_scale")
    assert attn.w_input_proj is None and attn.w_input_proj_scale is None
