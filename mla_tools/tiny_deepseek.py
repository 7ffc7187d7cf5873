"""Tiny random DeepSeek-V2 / V3 checkpoints: deterministic HF folders for tests and the demo model.

Not part of the engine. `make_tiny_deepseek_v2` writes a folder that both transformers'
`DeepseekV2ForCausalLM` and `mla_backend.models.deepseek_v2` load: `config.json` in the published
DeepSeek-V2-Lite layout, fp32 `model.safetensors` with the original per-expert weight names
(`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`, ...), `generation_config.json`, and the
tokenizer files from `tokenizer_dir` when given. `TINY_DEEPSEEK_V2_DEFAULTS` define
`deepseek-v2-tiny` (V2-Lite scaled down: 4 layers, 8 heads, kv_lora_rank 128, MoE 8 top-2 + 2).
Init keeps activations O(1) and avoids router / LM-head near-ties: matrices N(0, 0.02), router
N(0, 0.1), LM head N(0, 3 / sqrt(hidden)), embeddings N(0, 1), RMSNorm weights 1 + N(0, 0.1).

`make_tiny_deepseek_v3` writes the V3 equivalent (`TINY_DEEPSEEK_V3_DEFAULTS`): projections at
N(0, 1 / sqrt(fan_in)) so routing changes the logits by O(1); per MoE layer
`mlp.gate.e_score_correction_bias` [E] fp32 ~ N(0, 0.1); plus one MTP layer
`model.layers.{num_hidden_layers}.*`, as the published checkpoint has (models must skip it).
`make_tiny_deepseek_v3_fp8` writes the same V3 weights in block-wise FP8 (float8_e4m3fn +
`weight_scale_inv`, `quantization_config`), and `write_dequantized_copy` its fp32 dequantized
twin, the exact reference for HF transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import torch
from safetensors.torch import save_file

# Defaults of `deepseek-v2-tiny` (any key can be overridden by keyword).
TINY_DEEPSEEK_V2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": None,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "added_tokens.json",
)


def copy_tokenizer_files(src_dir: str, dst_dir: str) -> int:
    """Copy the tokenizer files of HF folder `src_dir` that exist into `dst_dir`.

    Returns:
        How many of tokenizer.json / tokenizer_config.json were copied (0 = no usable tokenizer).
    """
    copied = 0
    for name in _TOKENIZER_FILES:
        src = os.path.join(src_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(dst_dir, name))
            copied += name in ("tokenizer.json", "tokenizer_config.json")
    return copied


def tiny_deepseek_v2_config(**overrides: Any) -> dict[str, Any]:
    """The config.json dict: defaults updated by `overrides`.

    `rope_scaling=None` turns YaRN off (plain RoPE, softmax scale qk_head_dim^-0.5).
    Raises:
        ValueError: inconsistent sizes (heads not dividing hidden, experts not divisible into
            n_group groups, top-k larger than the experts it can choose from).
    """
    cfg = json.loads(json.dumps(TINY_DEEPSEEK_V2_DEFAULTS))
    cfg.update(overrides)
    if "num_attention_heads" in overrides and "num_key_value_heads" not in overrides:
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    if cfg["hidden_size"] % cfg["num_attention_heads"]:
        raise ValueError("hidden_size must be a multiple of num_attention_heads")
    n_exp, n_group = cfg["n_routed_experts"], cfg["n_group"] or 1
    if n_exp % n_group:
        raise ValueError(f"n_routed_experts {n_exp} is not divisible by n_group {n_group}")
    if cfg["topk_method"] == "group_limited_greedy":
        if (cfg["topk_group"] or 1) * (n_exp // n_group) < cfg["num_experts_per_tok"]:
            raise ValueError("num_experts_per_tok exceeds the experts in topk_group groups")
    if cfg["num_experts_per_tok"] > n_exp:
        raise ValueError("num_experts_per_tok exceeds n_routed_experts")
    cfg["model_type"] = "deepseek_v2"
    cfg["architectures"] = ["DeepseekV2ForCausalLM"]
    cfg["torch_dtype"] = "float32"
    return cfg


def tiny_deepseek_v2_state_dict(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random fp32 weights for `cfg`, keyed by the original HF checkpoint names."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    def norm_w(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=gen)).contiguous()

    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kv_lora, q_lora = cfg["kv_lora_rank"], cfg["q_lora_rank"]
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(cfg["vocab_size"], hidden,
                                                                        std=1.0)}

    def mlp(prefix: str, inter: int) -> None:
        sd[f"{prefix}.gate_proj.weight"] = normal(inter, hidden)
        sd[f"{prefix}.up_proj.weight"] = normal(inter, hidden)
        sd[f"{prefix}.down_proj.weight"] = normal(hidden, inter)

    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        if q_lora is None:
            sd[f"{a}.q_proj.weight"] = normal(heads * (nope + rope), hidden)
        else:
            sd[f"{a}.q_a_proj.weight"] = normal(q_lora, hidden)
            sd[f"{a}.q_a_layernorm.weight"] = norm_w(q_lora)
            sd[f"{a}.q_b_proj.weight"] = normal(heads * (nope + rope), q_lora)
        sd[f"{a}.kv_a_proj_with_mqa.weight"] = normal(kv_lora + rope, hidden)
        sd[f"{a}.kv_a_layernorm.weight"] = norm_w(kv_lora)
        sd[f"{a}.kv_b_proj.weight"] = normal(heads * (nope + v_dim), kv_lora)
        sd[f"{a}.o_proj.weight"] = normal(hidden, heads * v_dim)
        sd[f"{p}.input_layernorm.weight"] = norm_w(hidden)
        sd[f"{p}.post_attention_layernorm.weight"] = norm_w(hidden)
        is_moe = (cfg["n_routed_experts"] and i >= cfg["first_k_dense_replace"]
                  and i % cfg.get("moe_layer_freq", 1) == 0)
        if is_moe:
            sd[f"{p}.mlp.gate.weight"] = normal(cfg["n_routed_experts"], hidden, std=0.1)
            for e in range(cfg["n_routed_experts"]):
                mlp(f"{p}.mlp.experts.{e}", cfg["moe_intermediate_size"])
            if cfg["n_shared_experts"]:
                mlp(f"{p}.mlp.shared_experts",
                    cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
        else:
            mlp(f"{p}.mlp", cfg["intermediate_size"])
    sd["model.norm.weight"] = norm_w(hidden)
    if not cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = normal(cfg["vocab_size"], hidden, std=3.0 / hidden ** 0.5)
    return sd


def make_tiny_deepseek_v2(
    out_dir: str, seed: int = 0, tokenizer_dir: str | None = None, **config_overrides: Any
) -> str:
    """Write a deterministic random DeepSeek-V2 HF folder at `out_dir` (replaced atomically).

    Args:
        out_dir: target folder (created; an existing one is replaced).
        seed: weight seed; the same (seed, overrides) always gives the same bytes.
        tokenizer_dir: HF folder whose tokenizer files are copied (SmolLM2's in the project);
            None writes no tokenizer.
        config_overrides: config.json keys, e.g. `q_lora_rank=32`, `topk_method=
            "group_limited_greedy", n_group=4, topk_group=2`, `routed_scaling_factor=2.0`,
            `rope_scaling=None`, `hidden_size=64`.
    Returns:
        `out_dir`, absolute.
    Raises:
        ValueError: inconsistent config (see `tiny_deepseek_v2_config`).
        FileNotFoundError: `tokenizer_dir` given but holds neither tokenizer.json nor
            tokenizer_config.json.
    """
    cfg = tiny_deepseek_v2_config(**config_overrides)
    sd = tiny_deepseek_v2_state_dict(cfg, seed)
    return _write_folder(out_dir, cfg, sd, tokenizer_dir)


def _write_folder(out_dir: str, cfg: dict[str, Any], sd: dict[str, torch.Tensor],
                  tokenizer_dir: str | None) -> str:
    """Write config.json, generation_config.json, model.safetensors (+ tokenizer files) to a temp
    folder beside `out_dir`, then swap it in. Returns `out_dir`, absolute."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp_" + os.path.basename(out_dir), dir=parent)
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
        gen_cfg = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
                   "do_sample": False}
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump(gen_cfg, f, indent=2)
        save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if tokenizer_dir is not None:
            if not copy_tokenizer_files(tokenizer_dir, tmp):
                raise FileNotFoundError(f"no tokenizer files in {tokenizer_dir!r}")
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# ---------------------------------------------------------------------------------- DeepSeek-V3
# Defaults of a tiny DeepSeek-V3: the V2 tiny sizes with V3's architecture choices (published
# DeepSeek-V3 config.json: q_lora_rank set, 1 shared expert, sigmoid / noaux_tc routing with
# groups, norm_topk_prob true, routed_scaling_factor 2.5, YaRN mscale 1.0 / 1.0, one MTP layer).
TINY_DEEPSEEK_V3_DEFAULTS: dict[str, Any] = {
    **TINY_DEEPSEEK_V2_DEFAULTS,
    "q_lora_rank": 96,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "topk_method": "noaux_tc",
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "num_nextn_predict_layers": 1,
    # V2-Lite's YaRN with V3's mscale (1.0 / 1.0)
    "rope_scaling": {**TINY_DEEPSEEK_V2_DEFAULTS["rope_scaling"], "mscale": 1.0,
                     "mscale_all_dim": 1.0},
}

E_SCORE_CORRECTION_BIAS_STD = 0.1


def tiny_deepseek_v3_config(**overrides: Any) -> dict[str, Any]:
    """The config.json dict of a tiny DeepSeek-V3: `TINY_DEEPSEEK_V3_DEFAULTS` updated by
    `overrides`.

    Raises:
        ValueError: inconsistent sizes (see `tiny_deepseek_v2_config`), groups of fewer than 2
            experts (a noaux_tc group scores its top-2), or top-k above the experts of
            topk_group groups.
    """
    merged = json.loads(json.dumps({**TINY_DEEPSEEK_V3_DEFAULTS, **overrides}))
    if "num_attention_heads" in overrides and "num_key_value_heads" not in overrides:
        merged["num_key_value_heads"] = merged["num_attention_heads"]
    cfg = tiny_deepseek_v2_config(**merged)  # the size checks
    n_exp, n_group = cfg["n_routed_experts"], cfg["n_group"] or 1
    if n_exp // n_group < 2:
        raise ValueError(f"{n_exp} experts in {n_group} groups: a group needs at least 2")
    if (cfg["topk_group"] or n_group) * (n_exp // n_group) < cfg["num_experts_per_tok"]:
        raise ValueError("num_experts_per_tok exceeds the experts in topk_group groups")
    cfg["model_type"] = "deepseek_v3"
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    return cfg


def _rescale_projections(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """N(0, 0.02) projection matrices -> N(0, 1 / sqrt(fan_in)) (same draws, scaled), so each
    attention / MLP / expert output is O(1) against the O(1) residual stream. With 0.02 a tiny
    layer adds ~1% to the residual and routing mistakes move the logits by ~0.03 without
    changing a token; at this scale they change tokens. Embeddings, LM head, norms and the
    router keep their scales."""
    out = {}
    for name, w in sd.items():
        keep = (w.dim() != 2 or name.endswith(("embed_tokens.weight", "mlp.gate.weight"))
                or name == "lm_head.weight")
        out[name] = w if keep else (w * (w.shape[1] ** -0.5 / 0.02)).contiguous()
    return out


def tiny_deepseek_v3_state_dict(cfg: dict[str, Any], seed: int = 0,
                                mtp: bool = True) -> dict[str, torch.Tensor]:
    """Deterministic random fp32 weights for a V3 `cfg`, keyed by the original checkpoint names.

    The V2 tensors (`tiny_deepseek_v2_state_dict`), plus `mlp.gate.e_score_correction_bias`
    [E] fp32 per MoE layer, plus (when `mtp`) `num_nextn_predict_layers` MTP layers
    `model.layers.{num_hidden_layers + j}.*`: a full decoder layer and `enorm`, `hnorm`,
    `eh_proj` [hidden, 2 hidden], `shared_head.norm` (the published checkpoint also stores copies
    of the embedding and LM head there; they are left out to keep the file small).
    """
    sd = _rescale_projections(tiny_deepseek_v2_state_dict(cfg, seed))
    gen = torch.Generator().manual_seed(seed + 7919)  # V3-only tensors: their own stream
    n_layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    for name in [k for k in sd if k.endswith(".mlp.gate.weight")]:
        sd[name[: -len("weight")] + "e_score_correction_bias"] = (
            torch.randn(cfg["n_routed_experts"], generator=gen) * E_SCORE_CORRECTION_BIAS_STD)
    n_mtp = int(cfg.get("num_nextn_predict_layers") or 0) if mtp else 0
    if n_mtp:
        deeper = _rescale_projections(tiny_deepseek_v2_state_dict(
            {**cfg, "num_hidden_layers": n_layers + n_mtp}, seed + 1))
        for j in range(n_layers, n_layers + n_mtp):
            p = f"model.layers.{j}."
            sd.update({k: v for k, v in deeper.items() if k.startswith(p)})
            sd[p + "mlp.gate.e_score_correction_bias"] = (
                torch.randn(cfg["n_routed_experts"], generator=gen) * E_SCORE_CORRECTION_BIAS_STD)
            for norm in ("enorm", "hnorm", "shared_head.norm"):
                sd[f"{p}{norm}.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
            sd[p + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.02
    return sd


def make_tiny_deepseek_v3(
    out_dir: str, seed: int = 0, tokenizer_dir: str | None = None, mtp: bool = True,
    **config_overrides: Any
) -> str:
    """Write a deterministic random DeepSeek-V3 HF folder at `out_dir` (replaced atomically).

    Loadable by transformers' `DeepseekV3ForCausalLM` (which warns about the MTP layer's unused
    weights) and by `mla_backend.models.deepseek_v2.DeepseekV3ForCausalLM`.

    Args:
        out_dir, seed, tokenizer_dir: as `make_tiny_deepseek_v2`.
        mtp: write the MTP layer(s) (`num_nextn_predict_layers`) as the published checkpoint has.
        config_overrides: config.json keys, e.g. `n_group=2, topk_group=1`, `q_lora_rank=None`,
            `first_k_dense_replace=2`, `norm_topk_prob=False`.
    Returns:
        `out_dir`, absolute.
    Raises:
        ValueError: inconsistent config (see `tiny_deepseek_v3_config`).
        FileNotFoundError: `tokenizer_dir` given but holds no tokenizer files.
    """
    cfg = tiny_deepseek_v3_config(**config_overrides)
    return _write_folder(out_dir, cfg, tiny_deepseek_v3_state_dict(cfg, seed, mtp), tokenizer_dir)


# ------------------------------------------------------------------------ DeepSeek-V3 block FP8
def block_fp8_quantization_config(weight_block_size: tuple[int, int] = (128, 128)
                                  ) -> dict[str, Any]:
    """The `quantization_config` of DeepSeek-V3's config.json (block size overridable)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [int(weight_block_size[0]), int(weight_block_size[1])]}


def _is_fp8_linear(name: str, w: torch.Tensor) -> bool:
    """Which tensors DeepSeek-V3's FP8 checkpoint stores as e4m3 + `weight_scale_inv`: the 2-D
    projection weights of attention, dense MLPs, shared and routed experts. Not: the embedding,
    the LM head, the router `mlp.gate.weight`, norms, `e_score_correction_bias`, and (in this
    tiny maker; the engine skips the MTP layer anyway) the MTP layer's `eh_proj`."""
    return (w.dim() == 2 and name.endswith(".weight")
            and not name.endswith(("embed_tokens.weight", "mlp.gate.weight", "eh_proj.weight"))
            and name != "lm_head.weight")


def quantize_state_dict_block_fp8(sd: dict[str, torch.Tensor],
                                  weight_block_size: tuple[int, int] = (128, 128)
                                  ) -> dict[str, torch.Tensor]:
    """Block-FP8 copy of a V3 state dict: each projection weight [N, K] becomes float8_e4m3fn
    [N, K] plus `<name>_scale_inv` float32 [ceil(N/bn), ceil(K/bk)] (amax / 448 per block);
    everything else is kept as it is."""
    from mla_kernels.block_fp8_gemm import quant_weight_block_fp8

    out: dict[str, torch.Tensor] = {}
    for name, w in sd.items():
        if _is_fp8_linear(name, w):
            out[name], out[name + "_scale_inv"] = quant_weight_block_fp8(w, weight_block_size)
        else:
            out[name] = w
    return out


def dequantize_state_dict_block_fp8(sd: dict[str, torch.Tensor],
                                    weight_block_size: tuple[int, int] = (128, 128)
                                    ) -> dict[str, torch.Tensor]:
    """Inverse format change (as DeepSeek's `fp8_cast_bf16.py`): every float8_e4m3fn weight with
    a `_scale_inv` becomes float32 weight * scale_inv per block; the scales are dropped.

    Raises:
        KeyError: an FP8 weight without its `_scale_inv`.
    """
    from mla_kernels.block_fp8_gemm import dequant_weight_block_fp8

    out: dict[str, torch.Tensor] = {}
    for name, w in sd.items():
        if name.endswith("_scale_inv"):
            continue
        if w.dtype == torch.float8_e4m3fn:
            out[name] = dequant_weight_block_fp8(w, sd[name + "_scale_inv"], weight_block_size)
        else:
            out[name] = w
    return out


# The fp32 tiny V3's projections, N(0, 1/sqrt(fan_in)), put its layers at the edge of chaos: a
# 2-3% perturbation per activation (FP8's rounding) grows to ~24% (relative RMS) of the logits
# over 4 layers (measured: top-1 agreement 59%). At half that scale the same perturbation gives
# 1.8% and 99% top-1 agreement, while every layer still moves the logits.
FP8_PROJECTION_SCALE = 0.5


def make_tiny_deepseek_v3_fp8(
    out_dir: str, seed: int = 0, tokenizer_dir: str | None = None, mtp: bool = True,
    weight_block_size: tuple[int, int] = (128, 128),
    projection_scale: float = FP8_PROJECTION_SCALE, **config_overrides: Any
) -> str:
    """Write a tiny DeepSeek-V3 in the published block-FP8 format at `out_dir`.

    The fp32 weights of `make_tiny_deepseek_v3` (same seed and overrides) with the projection
    matrices (the tensors that become FP8) times `projection_scale`, quantized by
    `quantize_state_dict_block_fp8`, and `quantization_config` (`block_fp8_quantization_config`)
    in config.json. Transformers may need a GPU to load it as FP8 (FineGrainedFP8); its
    dequantized twin is `write_dequantized_copy`.

    Args:
        out_dir, seed, tokenizer_dir, mtp, config_overrides: as `make_tiny_deepseek_v3`.
        weight_block_size: (bn, bk); DeepSeek-V3 uses (128, 128).
        projection_scale: factor on the projection weights (see `FP8_PROJECTION_SCALE`).
    Returns:
        `out_dir`, absolute.
    Raises:
        ValueError: inconsistent config. FileNotFoundError: tokenizer_dir without tokenizer.
    """
    cfg = tiny_deepseek_v3_config(**config_overrides)
    cfg["quantization_config"] = block_fp8_quantization_config(weight_block_size)
    sd = {name: (w * projection_scale if _is_fp8_linear(name, w) else w)
          for name, w in tiny_deepseek_v3_state_dict(cfg, seed, mtp).items()}
    sd = quantize_state_dict_block_fp8(sd, weight_block_size)
    return _write_folder(out_dir, cfg, sd, tokenizer_dir)


def write_dequantized_copy(fp8_dir: str, out_dir: str) -> str:
    """Write the fp32 dequantized twin of a block-FP8 folder (config without
    `quantization_config`, tokenizer copied): what an exact reference (HF transformers in fp32)
    loads. Returns `out_dir`, absolute.

    Raises:
        KeyError: the folder's config has no block-FP8 `quantization_config`.
    """
    from safetensors.torch import load_file

    with open(os.path.join(fp8_dir, "config.json")) as f:
        cfg = json.load(f)
    block = tuple(cfg.pop("quantization_config")["weight_block_size"])
    sd = dequantize_state_dict_block_fp8(load_file(os.path.join(fp8_dir, "model.safetensors")),
                                         block)
    has_tok = any(os.path.isfile(os.path.join(fp8_dir, n)) for n in _TOKENIZER_FILES)
    return _write_folder(out_dir, cfg, sd, fp8_dir if has_tok else None)


__all__ = ["FP8_PROJECTION_SCALE", "TINY_DEEPSEEK_V2_DEFAULTS", "TINY_DEEPSEEK_V3_DEFAULTS",
           "block_fp8_quantization_config", "dequantize_state_dict_block_fp8",
           "make_tiny_deepseek_v2", "make_tiny_deepseek_v3", "make_tiny_deepseek_v3_fp8",
           "quantize_state_dict_block_fp8", "tiny_deepseek_v2_config",
           "tiny_deepseek_v2_state_dict", "tiny_deepseek_v3_config", "tiny_deepseek_v3_state_dict",
           "write_dequantized_copy"]
