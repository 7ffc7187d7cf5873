"""models.registry lookups and the tiny-Llama checkpoint maker (determinism, overrides, atomic
write)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from mla_backend.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from mla_backend.models.registry import (
    UnsupportedModelError,
    get_model_class,
    supported_architectures,
)
from mla_tools.checkpoints import make_tiny_llama


def test_registry():
    assert get_model_class(["LlamaForCausalLM"]) is LlamaForCausalLM
    assert get_model_class("Qwen2ForCausalLM") is Qwen2ForCausalLM
    assert get_model_class(["Foo", "LlamaForCausalLM"]) is LlamaForCausalLM
    assert "DeepseekV2ForCausalLM" in supported_architectures()
    with pytest.raises(UnsupportedModelError, match="supported"):
        get_model_class(["BertModel"])
    with pytest.raises(UnsupportedModelError):
        get_model_class(None)


def test_tiny_llama_is_deterministic_and_seeded(tmp_path):
    a = load_file(os.path.join(make_tiny_llama(str(tmp_path / "a"), seed=5), "model.safetensors"))
    b = load_file(os.path.join(make_tiny_llama(str(tmp_path / "b"), seed=5), "model.safetensors"))
    c = load_file(os.path.join(make_tiny_llama(str(tmp_path / "c"), seed=6), "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_tiny_llama_overrides_and_replace(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    path = make_tiny_llama(str(out), seed=0, tie_word_embeddings=True, num_key_value_heads=1,
                           head_dim=32, model_type="qwen2")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_key_value_heads"], cfg["head_dim"]) == ("qwen2", 1, 32)
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == 49152
    state = load_file(os.path.join(path, "model.safetensors"))
    assert "lm_head.weight" not in state
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)
    assert "model.layers.0.self_attn.q_proj.bias" in state
    assert not (out / "stale.txt").exists()  # replaced as a whole
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp_")]
    with pytest.raises(ValueError, match="model_type"):
        make_tiny_llama(str(tmp_path / "x"), model_type="gpt2")
    assert not (tmp_path / "x").exists()
