"""`RadixAttention`: the attention layer models call; it forwards to the batch's backend.

Holds only the layer's geometry (heads, dims, scale, layer_id). Which KV pool buffer it uses is
decided by `layer_id`; the backend reads/writes that pool through `req_to_token`.
The backend call is opaque to torch.compile (`torch.compiler.disable`): the backends hold
per-step Python state and launch their own kernels, so inductor compiles the code around them.

Also owns the checkpoint names of FP8 KV-cache scales (`load_kv_scale`), which the models'
`load_weights` route into `model.kv_cache_scales`; the model runner hands them to an FP8 KV pool.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from mla_backend.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    """Args:
        num_heads: query heads (per TP rank).
        head_dim: q/k head dim (MLA absorbed: kv_lora_rank + qk_rope_head_dim = 576).
        scaling: softmax scale (DeepSeek: qk_head_dim^-0.5 * mscale^2, never 576^-0.5).
        num_kv_heads: KV heads (MLA absorbed: 1).
        layer_id: index of this layer's buffers in the KV pool.
        v_head_dim: value head dim (MLA absorbed: kv_lora_rank = 512); default head_dim.
        pool_free: True for an attention that never touches the pool (MLA decompressed prefill:
            attends only over the new tokens' k/v given to it).
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
        v_head_dim: int = -1,
        pool_free: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.num_kv_heads = num_kv_heads
        self.layer_id = layer_id
        self.v_head_dim = head_dim if v_head_dim == -1 else v_head_dim
        self.pool_free = pool_free

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        forward_batch: "ForwardBatch",
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """q [T, H*head_dim] or [T, H, head_dim]; k/v likewise per KV head.
        Returns [T, H * v_head_dim]."""
        q = q.reshape(-1, self.num_heads, self.head_dim)
        if k is not None:
            k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if v is not None:
            v = v.reshape(-1, self.num_kv_heads, self.v_head_dim)
        return _run_backend(self, q, k, v, forward_batch, save_kv_cache)


@torch.compiler.disable
def _run_backend(layer: RadixAttention, q: torch.Tensor, k: torch.Tensor | None,
                 v: torch.Tensor | None, forward_batch: "ForwardBatch",
                 save_kv_cache: bool) -> torch.Tensor:
    backend = forward_batch.attn_backend
    if forward_batch.forward_mode.is_decode():
        return backend.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
    return backend.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)


# FP8 KV-cache scales in checkpoints (vLLM / SGLang / llm-compressor / ModelOpt names):
#   model.layers.{i}.self_attn.k_scale | v_scale        (current; per-tensor fp32 scalars)
#   model.layers.{i}.self_attn.kv_scale                 (deprecated AutoFP8: one for K and V)
#   model.layers.{i}.self_attn.attn.k_scale | v_scale   (vLLM's module path)
#   model.layers.{i}.self_attn.k_proj.k_scale, ....v_proj.v_scale   (ModelOpt)
# Meaning: stored fp8 = x / scale, value = fp8 * scale.
_KV_SCALE_RE = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.|k_proj\.(?=k_scale$)|v_proj\.(?=v_scale$))?"
    r"(k_scale|v_scale|kv_scale)$")


def match_kv_scale_name(name: str) -> tuple[int, str] | None:
    """(layer_id, "k" | "v" | "kv") for a checkpoint KV-cache scale name, else None."""
    m = _KV_SCALE_RE.match(name)
    if m is None:
        return None
    return int(m.group(1)), m.group(2)[: -len("_scale")]


def load_kv_scale(scales: dict[int, dict[str, float]], name: str, tensor: torch.Tensor) -> bool:
    """If `name` is a KV-cache scale, record it in `scales[layer_id]["k" / "v"]` ("kv" sets
    both) and return True; else return False (the caller loads `name` as a weight).

    Raises:
        ValueError: a scale that is not one finite positive number (per-head scales are not
            supported).
    """
    hit = match_kv_scale_name(name)
    if hit is None:
        return False
    layer_id, which = hit
    if tensor.numel() != 1:
        raise ValueError(f"{name}: only per-tensor KV-cache scales are supported, got shape "
                         f"{tuple(tensor.shape)}")
    value = float(tensor.float().reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: a KV-cache scale must be finite and > 0, got {value}")
    entry = scales.setdefault(layer_id, {})
    for key in ("k", "v") if which == "kv" else (which,):
        entry[key] = value
    return True
