"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral) over the paged KV pool.

Built by `model_executor.ModelRunner` from an HF config (through `models.registry`); weights
come from `load_weights` with HF tensor names (q/k/v and gate/up are merged here into
`qkv_proj` / `gate_up_proj`). Attention goes through `RadixAttention` → the batch's backend,
which writes K/V into an MHA pool shaped by `kv_pool_layout()`.

Tensor parallelism (`mla_backend.distributed`; TP 1 when not initialized): q/k/v and gate/up are
column-parallel (heads and the intermediate dim split across ranks), o_proj and down_proj
row-parallel (one all-reduce each), the embedding and LM head vocab-parallel. Each rank's pool
holds its own KV heads. The math is the same at every TP degree.

Config fields read: vocab_size, hidden_size, intermediate_size, num_hidden_layers,
num_attention_heads, num_key_value_heads (default = heads), head_dim (default hidden/heads),
rms_norm_eps, rope_theta / rope_parameters / rope_scaling (default, linear, llama3),
max_position_embeddings, tie_word_embeddings, attention_bias (Llama) / model_type qwen2 (qkv
bias), mlp_bias, hidden_act (silu only).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mla_backend.layers.activation import SiluAndMul, gated_mlp
from mla_backend.layers.layernorm import RMSNorm
from mla_backend.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from mla_backend.layers.logits import ParallelLMHead, VocabParallelEmbedding
from mla_backend.layers.quantization import (
    PerTokenFp8, QuantConfig, quant_config_from_hf, takes_per_token_fp8)
from mla_backend.layers.radix_attention import RadixAttention, load_kv_scale
from mla_backend.layers.rotary_embedding import get_rope, rope_params_from_config

if TYPE_CHECKING:
    from mla_backend.config import ModelConfig
    from mla_backend.forward_batch import ForwardBatch


def _head_dim(cfg: Any) -> int:
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else cfg.hidden_size // cfg.num_attention_heads


def _num_kv_heads(cfg: Any) -> int:
    kv = getattr(cfg, "num_key_value_heads", None)
    return int(kv) if kv else cfg.num_attention_heads


def _qc(quant_config: QuantConfig | None, prefix: str) -> QuantConfig | None:
    return None if quant_config is None else quant_config.for_module(prefix)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 hidden_act: str = "silu", quant_config: QuantConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r} (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, shard_names=("gate", "up"),
            quant_config=_qc(quant_config, f"{prefix}.gate_up_proj"))
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias,
                                           quant_config=_qc(quant_config, f"{prefix}.down_proj"))
        self.act_fn = SiluAndMul()

    @property
    def takes_fp8_input(self) -> bool:
        """Whether forward uses an x_fp8 (its gate/up linear quantizes x per token)."""
        return takes_per_token_fp8(self.gate_up_proj)

    def forward(self, x: torch.Tensor, x_fp8: PerTokenFp8 | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; x_fp8: x quantized per token, or None."""
        return gated_mlp(x, x_fp8, self.gate_up_proj, self.act_fn, self.down_proj)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, layer_id: int, qkv_bias: bool,
                 quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.head_dim = _head_dim(cfg)
        prefix = f"model.layers.{layer_id}.self_attn"
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          _num_kv_heads(cfg), bias=qkv_bias,
                                          quant_config=_qc(quant_config, f"{prefix}.qkv_proj"))
        # Heads of this tensor-parallel rank (all of them at TP 1).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size,
                                        bias=bool(getattr(cfg, "attention_bias", False)),
                                        quant_config=_qc(quant_config, f"{prefix}.o_proj"))
        theta, scaling = rope_params_from_config(cfg)
        partial = float(getattr(cfg, "partial_rotary_factor", 1.0) or 1.0)
        self.rotary_emb = get_rope(self.head_dim, int(self.head_dim * partial),
                                   cfg.max_position_embeddings, theta, True, scaling)
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim**-0.5,
                                   self.num_kv_heads, layer_id)

    @property
    def takes_fp8_input(self) -> bool:
        """Whether forward uses a hidden_fp8 (qkv_proj quantizes its input per token)."""
        return takes_per_token_fp8(self.qkv_proj)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                forward_batch: ForwardBatch, hidden_fp8: PerTokenFp8 | None = None
                ) -> torch.Tensor:
        """positions [T], hidden [T, hidden] -> [T, hidden]; hidden_fp8: hidden quantized
        per token, or None."""
        qkv = self.qkv_proj(hidden, hidden_fp8)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, forward_batch)  # [T, H * head_dim]
        return self.o_proj(o)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_id: int, qkv_bias: bool,
                 quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, qkv_bias, quant_config)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size,
                            bool(getattr(cfg, "mlp_bias", False)),
                            getattr(cfg, "hidden_act", "silu"), quant_config,
                            f"model.layers.{layer_id}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None,
                forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (layer output before its residual add, residual stream). With dynamic FP8
        linears the norms also hand them their input quantized (`RMSNorm.prenorm`)."""
        hidden, residual, hidden_fp8 = self.input_layernorm.prenorm(
            hidden, residual, self.self_attn.takes_fp8_input)
        hidden = self.self_attn(positions, hidden, forward_batch, hidden_fp8)
        hidden, residual, hidden_fp8 = self.post_attention_layernorm.prenorm(
            hidden, residual, self.mlp.takes_fp8_input)
        return self.mlp(hidden, hidden_fp8), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any, qkv_bias: bool, quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, i, qkv_bias, quant_config)
                                     for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


# HF name fragment -> (our merged module fragment, shard id)
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", "gate"),
    (".up_proj.", ".gate_up_proj.", "up"),
)


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 / Mistral causal LM.

    Args:
        hf_config: the transformers config of the checkpoint.
        model_config: engine `ModelConfig`; only `quantization` is read ("fp8": online
            per-tensor FP8 of every linear but the embedding and LM head).
    A per-tensor FP8 checkpoint (`quantization_config` quant_method "fp8" without
    weight_block_size) loads into `Fp8LinearMethod` linears (`self.quant_config`).

    Raises:
        NotImplementedError / ValueError: an unsupported `quantization_config` or setting
            (`quant_config_from_hf`).
    """

    def __init__(self, hf_config: Any, model_config: ModelConfig | None = None) -> None:
        super().__init__()
        self.config = hf_config
        qkv_bias = hf_config.model_type == "qwen2" or bool(
            getattr(hf_config, "attention_bias", False))
        self.quant_config = quant_config_from_hf(
            getattr(hf_config, "quantization_config", None),
            getattr(model_config, "quantization", "") or "")
        self.model = LlamaModel(hf_config, qkv_bias, self.quant_config)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size,
                                      self.model.embed_tokens if self.tie_word_embeddings
                                      else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden [T, hidden] after the final norm."""
        return self.model(input_ids, positions, forward_batch)

    def compute_logits(self, hidden: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] fp32, or written into out [n, vocab] (the
        CUDA graphs' static buffer, of the model dtype: `ParallelLMHead.forward`)."""
        return self.lm_head(hidden, out)

    def kv_pool_layout(self) -> dict:
        attn = self.model.layers[0].self_attn
        return {"kind": "mha", "num_layers": len(self.model.layers),
                "num_kv_heads": attn.num_kv_heads, "head_dim": attn.head_dim,
                "v_head_dim": attn.head_dim}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters (cast to each parameter's dtype/device).

        FP8 KV-cache scales (`self_attn.k_scale` / `v_scale` / `kv_scale`, see `load_kv_scale`)
        go to `self.kv_cache_scales` {layer: {"k": s, "v": s}}.
        Returns:
            names of the parameters that were filled (ours, e.g. "...qkv_proj.weight").
        Raises:
            KeyError: a tensor name this model does not know.
            ValueError: a shape mismatch, or a malformed KV-cache scale.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        self.kv_cache_scales: dict[int, dict[str, float]] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if load_kv_scale(self.kv_cache_scales, name, tensor):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # some tied checkpoints store a copy
            shard = None
            for hf_frag, our_frag, shard_id in _STACKED:
                if hf_frag in name:
                    name, shard = name.replace(hf_frag, our_frag), shard_id
                    break
            if name not in params:
                raise KeyError(f"unexpected checkpoint tensor {name!r}")
            param = params[name]
            owner = self.get_submodule(name.rsplit(".", 1)[0])
            loader = getattr(owner, "weight_loader", None)
            if loader is not None:
                loader(param, tensor.to(param.dtype), shard)
            else:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: shape {tuple(param.shape)} vs {tuple(tensor.shape)}")
                param.data.copy_(tensor)
            loaded.add(name)
        return loaded

    def post_load_weights(self) -> None:
        """Finish quantized linears (quantize / requantize weights, settle scales)."""
        for mod in self.modules():
            method = getattr(mod, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(mod)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with q/k/v bias (detected from model_type)."""


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama layout (sliding window handled by capping the context in the runner)."""
