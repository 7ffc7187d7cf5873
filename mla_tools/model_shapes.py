"""Model folders with real published shapes and no weights, for benchmarks and memory tests.

Not part of the engine. `write_shape_model` writes `config.json` (plus tokenizer files copied
from a folder, when given) for one of `SHAPES`; the engine loads such a folder with
`load_format="dummy"` (random weights made on the device, nothing read from disk).

Shapes (from the published config.json files, see REFERENCE.md §1.6):
- "deepseek-v2-lite": DeepSeek-V2-Lite — 27 layers, hidden 2048, 16 heads, q_lora_rank null,
  kv_lora_rank 512, qk_nope/rope/v 128/64/128, 64 routed experts top-6 + 2 shared (moe
  intermediate 1408), first layer dense (10944), vocab 102400, YaRN factor 40, 15.7B parameters.
- "llama-3.1-8b": Llama-3.1-8B — 32 layers, hidden 4096, 32 query / 8 KV heads of 128,
  intermediate 14336, vocab 128256, rope theta 500000 with llama3 scaling (factor 8).
`num_hidden_layers` and other keys can be overridden (e.g. 2 layers for a quick memory test).
"""

from __future__ import annotations

import json
import os
from typing import Any

from mla_tools.tiny_deepseek import copy_tokenizer_files, tiny_deepseek_v2_config

DEEPSEEK_V2_LITE: dict[str, Any] = {
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
}

LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}

SHAPES = ("deepseek-v2-lite", "llama-3.1-8b")


def shape_config(name: str, **overrides: Any) -> dict[str, Any]:
    """config.json dict of a named shape with `overrides` applied.

    Raises:
        ValueError: unknown name.
    """
    if name == "deepseek-v2-lite":
        cfg = tiny_deepseek_v2_config(**{**DEEPSEEK_V2_LITE, **overrides})
        cfg["torch_dtype"] = "bfloat16"
        return cfg
    if name == "llama-3.1-8b":
        cfg = json.loads(json.dumps(LLAMA_3_1_8B))
        cfg.update(overrides)
        return cfg
    raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")


def write_shape_model(out_dir: str, name: str, tokenizer_dir: str | None = None,
                      **overrides: Any) -> str:
    """Write `config.json` of shape `name` (and the tokenizer files of `tokenizer_dir`) into
    `out_dir`; returns out_dir. Load it with `load_format="dummy"`.

    Raises:
        ValueError: unknown name. FileNotFoundError: tokenizer_dir has no tokenizer.json.
    """
    cfg = shape_config(name, **overrides)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if tokenizer_dir is not None:
        if not os.path.exists(os.path.join(tokenizer_dir, "tokenizer.json")):
            raise FileNotFoundError(f"no tokenizer.json in {tokenizer_dir!r}")
        copy_tokenizer_files(tokenizer_dir, out_dir)
    return out_dir


__all__ = ["DEEPSEEK_V2_LITE", "LLAMA_3_1_8B", "SHAPES", "shape_config", "write_shape_model"]
