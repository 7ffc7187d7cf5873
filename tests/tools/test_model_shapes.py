"""Tests of mla_tools.model_shapes: the "deepseek-v2" shape, `parameter_counts` against the
published figures and against the tensors of tiny checkpoints and the engine's parameters, and
the per-rank layout (`rank_parameter_counts`, `bytes_per_rank`) against the engine's own model
built on the meta device at a set TP size (no weights, no process group)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from mla_backend.config import EngineConfig
from mla_backend.distributed import parallel_state
from mla_backend.engine import Engine
from mla_backend.layers.layernorm import RMSNorm
from mla_backend.layers.linear import ReplicatedLinear
from mla_backend.models.registry import get_model_class_for_config
from mla_tools.model_shapes import (
    DEEPSEEK_V2,
    SHAPES,
    bytes_per_rank,
    parameter_counts,
    rank_parameter_counts,
    shape_config,
    write_shape_model,
)

B = 1e9


@pytest.mark.parametrize("name, total_b, digits", [
    ("deepseek-v2-lite", 15.7, 1), ("deepseek-v2", 236, 0), ("llama-3.1-8b", 8.0, 1)])
def test_totals_are_the_published_ones(name, total_b, digits):
    assert round(parameter_counts(shape_config(name))["total"] / B, digits) == total_b


def test_active_parameters_per_token():
    v2 = parameter_counts(shape_config("deepseek-v2"))
    assert round(v2["active"] / B, 2) == 21.38  # published: 21B activated
    assert round((v2["active"] - v2["embedding"]) / B, 2) == 20.85
    lite = parameter_counts(shape_config("deepseek-v2-lite"))
    # Published "2.4B activated" is the count without the input embedding table (a lookup),
    # 2.45B cut to one decimal; with it (embedding and LM head counted) 2.66B.
    assert round(lite["active"] / B, 2) == 2.66
    assert int((lite["active"] - lite["embedding"]) / 1e8) == 24
    llama = parameter_counts(shape_config("llama-3.1-8b"))
    assert llama["active"] == llama["total"] == 8_030_261_248


def test_deepseek_v2_shape(tmp_path):
    cfg = shape_config("deepseek-v2", num_hidden_layers=2)
    assert cfg["num_hidden_layers"] == 2 and cfg["torch_dtype"] == "bfloat16"
    assert cfg["rope_scaling"]["factor"] == 40 and cfg["q_lora_rank"] == DEEPSEEK_V2["q_lora_rank"]
    cfg["rope_scaling"]["factor"] = 1  # a copy: the next config is as published
    assert shape_config("deepseek-v2")["rope_scaling"]["factor"] == 40
    hf = AutoConfig.from_pretrained(write_shape_model(str(tmp_path / "m"), "deepseek-v2"))
    assert hf.model_type == "deepseek_v2"
    assert (hf.hidden_size, hf.num_attention_heads, hf.q_lora_rank, hf.n_routed_experts,
            hf.moe_intermediate_size, hf.topk_method, hf.n_group, hf.topk_group,
            hf.routed_scaling_factor) == (5120, 128, 1536, 160, 1536, "group_limited_greedy",
                                          8, 3, 16.0)


def _meta_model(cfg: dict, tp: int, monkeypatch) -> torch.nn.Module:
    """The engine's model class for `cfg` as rank tp-1 of `tp` would build it, on meta."""
    monkeypatch.setattr(parallel_state, "_TP_SIZE", tp)
    monkeypatch.setattr(parallel_state, "_TP_RANK", tp - 1)
    hf = AutoConfig.for_model(cfg["model_type"],
                              **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        return get_model_class_for_config(hf)(hf, None)


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("name, overrides", [
    *((name, {}) for name in SHAPES),
    # 2 KV heads replicated on 4 ranks each at TP 8; tied head; a vocab padded at TP 2 and 8
    ("llama-3.1-8b", {"num_key_value_heads": 2, "tie_word_embeddings": True,
                      "vocab_size": 128257}),
    ("llama-3.1-8b", {"model_type": "qwen2"}),  # q/k/v biases
    ("deepseek-v2", {"q_lora_rank": None, "tie_word_embeddings": True, "vocab_size": 102401}),
])
def test_rank_counts_match_the_engine_model(name, overrides, tp, monkeypatch):
    cfg = shape_config(name, **overrides)
    model = _meta_model(cfg, tp, monkeypatch)
    want = rank_parameter_counts(cfg, tp)
    assert sum(p.numel() for p in model.parameters()) == want["total"]
    replicated = sum(p.numel() for m in model.modules() if isinstance(m, (ReplicatedLinear,
                                                                            RMSNorm))
                     for p in m.parameters(recurse=False))
    assert replicated == want["replicated"]


def test_bytes_per_rank_deepseek_v2():
    cfg = shape_config("deepseek-v2")
    total = parameter_counts(cfg)["total"]
    for weight_bytes in (2, 1):
        assert bytes_per_rank(cfg, 1, weight_bytes) == total * weight_bytes
    per = rank_parameter_counts(cfg, 8)
    # Per layer q_a_proj + its norm, kv_a_proj_with_mqa + its norm, two norms; a router per
    # MoE layer (59); the final norm.
    assert per["replicated"] == (60 * (1536 * 5121 + 576 * 5120 + 512 + 2 * 5120)
                                 + 59 * 160 * 5120 + 5120)
    # The vocabulary (102400) divides by 8: no padding, everything else is split 8 ways.
    assert per["total"] * 8 == total + 7 * per["replicated"]
    assert bytes_per_rank(cfg, 8, 2) == 2 * per["total"] < 2 * (total / 8 + per["replicated"])
    assert bytes_per_rank(cfg, 8, 1) == per["total"] == 30_078_325_760


def test_tp_that_does_not_divide_is_an_error():
    with pytest.raises(ValueError, match="tensor parallel size 3 does not divide "
                                         "num_attention_heads=128"):
        rank_parameter_counts(shape_config("deepseek-v2"), 3)
    with pytest.raises(ValueError, match="tensor parallel size 16 does not divide "
                                         "moe_intermediate_size=1400"):
        rank_parameter_counts(shape_config("deepseek-v2-lite", moe_intermediate_size=1400), 16)


def _checkpoint_numel(path: str) -> dict[str, int]:
    """{tensor name: numel} over model.safetensors of an HF folder."""
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: math.prod(f.get_slice(k).get_shape()) for k in f.keys()}


def _config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


DEEPSEEK_VARIANTS = [
    {"hidden_size": 64, "num_hidden_layers": 3, "q_lora_rank": 32,
     "topk_method": "group_limited_greedy", "n_routed_experts": 16, "n_group": 4, "topk_group": 2,
     "num_experts_per_tok": 3},
    {"hidden_size": 64, "num_hidden_layers": 2, "tie_word_embeddings": True},
]


@pytest.mark.parametrize("overrides", DEEPSEEK_VARIANTS)
def test_deepseek_counts_match_checkpoint_and_engine(tiny_deepseek_factory, overrides):
    path = tiny_deepseek_factory(seed=3, **overrides)
    cfg, numel = _config(path), _checkpoint_numel(path)
    counts = parameter_counts(cfg)
    assert counts["total"] == sum(numel.values())
    routed = sum(n for k, n in numel.items() if ".mlp.experts." in k)
    assert counts["active"] == (sum(numel.values()) - routed
                                + routed * cfg["num_experts_per_tok"] // cfg["n_routed_experts"])
    assert counts["embedding"] == numel["model.embed_tokens.weight"]
    model = Engine(EngineConfig.create(model_path=path, max_total_tokens=64)).runner.model
    assert sum(p.numel() for p in model.parameters()) == counts["total"]
    absorbed = sum(layer.self_attn.w_kc.numel() + layer.self_attn.w_vc.numel()
                   for layer in model.model.layers)
    assert absorbed == rank_parameter_counts(cfg, 1)["absorbed"] > 0


def test_deepseek_v3_counts_match_checkpoint(tiny_deepseek_v3_factory):
    # V3: the routers' e_score_correction_bias counted; the checkpoint's MTP layer is not.
    path = tiny_deepseek_v3_factory(seed=3, hidden_size=64, num_hidden_layers=2)
    cfg, numel = _config(path), _checkpoint_numel(path)
    mtp = f"model.layers.{cfg['num_hidden_layers']}."
    assert parameter_counts(cfg)["total"] == sum(n for k, n in numel.items()
                                                 if not k.startswith(mtp))


@pytest.mark.parametrize("overrides", [
    {},
    {"num_key_value_heads": 1, "tie_word_embeddings": True},
    {"model_type": "qwen2"},  # q/k/v biases
])
def test_llama_counts_match_checkpoint(tiny_llama_factory, overrides):
    path = tiny_llama_factory(seed=3, **overrides)
    counts = parameter_counts(_config(path))
    assert counts["total"] == counts["active"] == sum(_checkpoint_numel(path).values())
