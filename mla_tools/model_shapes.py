"""Model folders with real published shapes and no weights, for benchmarks and memory tests.

Not part of the engine. `write_shape_model` writes `config.json` (plus tokenizer files copied
from a folder, when given) for one of `SHAPES`; the engine loads such a folder with
`load_format="dummy"` (random weights made on the device, nothing read from disk).

Shapes (from the published config.json files):
- "deepseek-v2-lite": DeepSeek-V2-Lite — 27 layers, hidden 2048, 16 heads, q_lora_rank null,
  kv_lora_rank 512, qk_nope/rope/v 128/64/128, 64 routed experts top-6 + 2 shared (moe
  intermediate 1408), first layer dense (10944), vocab 102400, YaRN factor 40, 15.7B parameters.
- "deepseek-v2": DeepSeek-V2 (236B) — 60 layers, hidden 5120, 128 heads, q_lora_rank 1536, 160
  routed experts top-6 (group_limited_greedy, 8 groups, top-3) + 2 shared (moe intermediate
  1536), first layer dense (12288), routed_scaling_factor 16; V2-Lite's MLA dims, vocab, YaRN.
- "llama-3.1-8b": Llama-3.1-8B — 32 layers, hidden 4096, 32 query / 8 KV heads of 128,
  intermediate 14336, vocab 128256, rope theta 500000 with llama3 scaling (factor 8).
`num_hidden_layers` and other keys can be overridden (e.g. 2 layers for a quick memory test).
`parameter_counts` (total / active per token) and `rank_parameter_counts` / `bytes_per_rank` (the
engine's tensor-parallel layout) size any of these configs without building a model.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mla_backend.distributed import divide
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

DEEPSEEK_V2: dict[str, Any] = {
    "vocab_size": 102400,
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 60,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 160,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "topk_method": "group_limited_greedy",
    "n_group": 8,
    "topk_group": 3,
    "norm_topk_prob": False,
    "routed_scaling_factor": 16.0,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
}  # scoring, YaRN, rope theta, norm eps, max positions: tiny_deepseek's defaults (V2-Lite's)

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

SHAPES = ("deepseek-v2-lite", "deepseek-v2", "llama-3.1-8b")
_DEEPSEEK_SHAPES = {"deepseek-v2-lite": DEEPSEEK_V2_LITE, "deepseek-v2": DEEPSEEK_V2}


def shape_config(name: str, **overrides: Any) -> dict[str, Any]:
    """config.json dict of a named shape with `overrides` applied.

    Raises:
        ValueError: unknown name.
    """
    if name in _DEEPSEEK_SHAPES:
        cfg = json.loads(json.dumps(tiny_deepseek_v2_config(  # a copy: no shared dicts
            **{**_DEEPSEEK_SHAPES[name], **overrides})))
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


# ------------------------------------------------------------------------------ parameter counts
# Weight groups of `_weights`: "embedding" / "lm_head" (vocab rows split, padded to a multiple of
# tp), "replicated" (whole on every rank), "split" (1/tp per rank), "routed" (routed experts, 1/tp
# of every expert's intermediate dim per rank).


def _weights(cfg: dict[str, Any], tp: int) -> tuple[list[tuple[str, int, int]], int]:
    """([(group, elements in the checkpoint, elements on one rank)], absorbed-copy elements per
    rank) for config dict `cfg` at TP size `tp`, as the engine's models build them."""
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    out: list[tuple[str, int, int]] = []

    def whole(n: int) -> None:
        out.append(("replicated", n, n))

    def part(group: str, full: int, dim: int, what: str) -> int:
        """A weight of `full` elements split along a dim of size `dim`; returns its rank part."""
        local = full // dim * divide(dim, tp, what)
        out.append((group, full, local))
        return local

    absorbed = 0
    if "kv_lora_rank" in cfg:  # DeepSeek-V2 / V3 (models/deepseek_v2.py)
        heads, nope, rope = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"],
                             cfg["qk_rope_head_dim"])
        v_dim, kv_lora, q_lora = cfg["v_head_dim"], cfg["kv_lora_rank"], cfg.get("q_lora_rank")
        bias = int(bool(cfg.get("attention_bias")))
        n_exp, inter = cfg.get("n_routed_experts") or 0, cfg.get("moe_intermediate_size")
        shared = (inter or 0) * (cfg.get("n_shared_experts") or 0)
        what = "num_attention_heads"
        for i in range(layers):
            if q_lora is not None:
                whole(q_lora * (h + bias) + q_lora)  # q_a_proj, q_a_layernorm
            part("split", heads * (nope + rope) * (q_lora or h), heads, what)  # q_(b_)proj
            whole((kv_lora + rope) * (h + bias) + kv_lora)  # kv_a_proj_with_mqa, its norm
            absorbed += part("split", heads * (nope + v_dim) * kv_lora, heads, what)  # kv_b
            part("split", h * heads * v_dim, heads, what)  # o_proj
            whole(bias * h + 2 * h)  # o_proj bias, input / post-attention norms
            if (n_exp and i >= cfg["first_k_dense_replace"]
                    and i % (cfg.get("moe_layer_freq") or 1) == 0):
                whole(n_exp * h + (n_exp if cfg.get("topk_method") == "noaux_tc" else 0))
                part("routed", n_exp * 3 * h * inter, inter, "moe_intermediate_size")
                if shared:
                    part("split", 3 * h * shared, shared, "shared experts' intermediate size")
            else:
                part("split", 3 * h * cfg["intermediate_size"], cfg["intermediate_size"],
                     "intermediate_size")
    else:  # Llama / Mistral / Qwen2 (models/llama.py)
        heads = cfg["num_attention_heads"]
        kv = cfg.get("num_key_value_heads") or heads
        hd = cfg.get("head_dim") or h // heads
        qkv_bias = int(cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias")))
        o_bias, mlp_bias = int(bool(cfg.get("attention_bias"))), int(bool(cfg.get("mlp_bias")))
        inter = cfg["intermediate_size"]
        if kv < tp and tp % kv:  # else each rank holds one KV head, on tp / kv ranks
            raise ValueError(f"num_key_value_heads={kv} does not divide tensor parallel size {tp}")
        for _ in range(layers):
            part("split", heads * hd * (h + qkv_bias), heads, "num_attention_heads")  # q
            full_kv = 2 * kv * hd * (h + qkv_bias)  # k, v
            if kv >= tp:
                part("split", full_kv, kv, "num_key_value_heads")
            else:
                out.append(("split", full_kv, full_kv // kv))
            part("split", h * heads * hd, heads, "num_attention_heads")  # o_proj
            part("split", inter * (3 * h + 2 * mlp_bias), inter, "intermediate_size")
            whole(h * (o_bias + mlp_bias + 2))  # row-parallel biases, two norms
    rows = -(-vocab // tp)  # VocabParallelEmbedding / ParallelLMHead: padded vocab rows
    out.append(("embedding", vocab * h, rows * h))
    if not cfg.get("tie_word_embeddings"):
        out.append(("lm_head", vocab * h, rows * h))
    whole(h)  # final norm
    return out, absorbed


def parameter_counts(cfg: dict[str, Any]) -> dict[str, int]:
    """Parameters of a config.json dict (DeepSeek-V2 / V3 family: has `kv_lora_rank`; else Llama
    / Mistral / Qwen2), as the checkpoint stores them (MTP layers not counted).

    Returns:
        {"total", "active" (per token: routed experts counted num_experts_per_tok of
        n_routed_experts; everything else, embedding and LM head included, in full),
        "embedding" (the input table, part of both)}.
    Raises:
        KeyError: a size the config lacks.
    """
    weights, _ = _weights(cfg, 1)
    total = sum(full for _, full, _ in weights)
    routed = sum(full for group, full, _ in weights if group == "routed")
    active = total - routed
    if routed:
        active += routed // cfg["n_routed_experts"] * cfg["num_experts_per_tok"]
    return {"total": total, "active": active,
            "embedding": sum(full for g, full, _ in weights if g == "embedding")}


def rank_parameter_counts(cfg: dict[str, Any], tp: int) -> dict[str, int]:
    """Parameter elements on one tensor-parallel rank (every rank holds the same amount).

    The engine's layout (layers/linear.py, layers/logits.py, layers/moe.py):
    - split 1/tp: query projection (q_proj or q_b_proj), kv_b_proj and o_proj by heads; dense
      MLPs, shared experts and every routed expert along the intermediate dim; Llama's q/k/v by
      heads (a KV head replicated on tp/kv ranks when kv < tp);
    - split by vocab rows: embedding and LM head, ceil(vocab/tp) rows each (zero padding);
    - replicated: q_a_proj and kv_a_proj_with_mqa (one latent KV head) with their norms, every
      RMSNorm, the MoE router (and V3's correction bias), row-parallel biases.

    Returns:
        {"vocab" (embedding + LM head rows), "split" (other split weights), "replicated",
        "total" (their sum), "absorbed" (elements of the w_kc / w_vc buffers that DeepSeek
        layers derive from kv_b_proj after load: extra memory, not parameters, not in total)}.
    Raises:
        ValueError: tp does not divide a split dim (the engine's `divide` message).
        KeyError: a size the config lacks.
    """
    weights, absorbed = _weights(cfg, tp)
    got = {"vocab": 0, "split": 0, "replicated": 0}
    for group, _, per_rank in weights:
        key = {"embedding": "vocab", "lm_head": "vocab", "routed": "split"}.get(group, group)
        got[key] += per_rank
    return {**got, "total": sum(got.values()), "absorbed": absorbed}


def bytes_per_rank(cfg: dict[str, Any], tp: int, weight_bytes: float = 2) -> float:
    """Weight bytes on one TP rank: `rank_parameter_counts(cfg, tp)["total"]` x `weight_bytes`
    (one width for every parameter: 2 = bf16, 1 = FP8). Not included: the engine keeps routers
    in fp32 (plus a 16-bit copy), FP8 checkpoints keep embedding, LM head, norms and routers in
    16/32 bits, and the absorbed w_kc / w_vc copies come on top.

    Raises:
        ValueError / KeyError: see `rank_parameter_counts`.
    """
    return rank_parameter_counts(cfg, tp)["total"] * weight_bytes


__all__ = ["DEEPSEEK_V2", "DEEPSEEK_V2_LITE", "LLAMA_3_1_8B", "SHAPES", "bytes_per_rank",
           "parameter_counts", "rank_parameter_counts", "shape_config", "write_shape_model"]
