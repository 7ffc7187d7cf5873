"""Rotary position embeddings (RoPE) over a precomputed cos/sin cache.

`RotaryEmbedding` is the base class: it owns `inv_freq` → `cos_sin_cache` and the rotation.
Variants override `_compute_inv_freq` (Llama-3 scaling, linear scaling) or
`_compute_cos_sin_cache` (DeepSeek YaRN, in its own module, which sets its fields before calling
`RotaryEmbedding.__init__`). Models build one through `get_rope` from their HF config.

Layouts: neox style rotates the two halves of the rotary dims (`rotate_half`, Llama/HF);
GPT-J style (`is_neox_style=False`) rotates interleaved pairs (DeepSeek's checkpoint layout).
Only the first `rotary_dim` dims of each head rotate; the rest pass through.

Dispatch: `RotaryEmbedding.forward` runs the triton kernel `mla_kernels.rotary.rotary_embedding`
over `cos_sin_cache` for CUDA tensors (fp32 math, out of place: inputs are never modified) and
`forward_native` (pure torch, the form torch.compile traces) on CPU or while compiling.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Args:
        head_size: per-head dim of q/k.
        rotary_dim: leading dims of each head that rotate (even, <= head_size).
        max_position_embeddings: positions in the cache (positions must be < this).
        base: rope theta.
        is_neox_style: halves (True) or interleaved pairs (False).
    Buffers:
        cos_sin_cache: [max_position_embeddings, rotary_dim] fp32: cos (rotary_dim/2) ‖ sin.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool = True,
    ) -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_size:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_size {head_size}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        cache = self._compute_cos_sin_cache()
        self.register_buffer("cos_sin_cache", cache.float(), persistent=False)

    # ----------------------------------------------------------------- cache (overridable)
    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        """[rotary_dim / 2] fp32: base^(-2i/rotary_dim) (same arithmetic as HF)."""
        exps = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        return 1.0 / (base**exps)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        """[max_position_embeddings, rotary_dim] fp32: cos ‖ sin of position * inv_freq."""
        inv_freq = self._compute_inv_freq(self.base)
        t = torch.arange(self.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    # ----------------------------------------------------------------- rotation
    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H, head_size]; cos/sin: [T, 1, rotary_dim/2] fp32
        dtype = x.dtype
        rot = x[..., : self.rotary_dim].float()
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if self.is_neox_style:
            out = torch.cat([o1, o2], dim=-1)
        else:
            out = torch.stack([o1, o2], dim=-1).flatten(-2)
        if self.rotary_dim == self.head_size:
            return out.to(dtype)
        return torch.cat([out.to(dtype), x[..., self.rotary_dim :]], dim=-1)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Triton kernel on CUDA, else `forward_native` (same args and results)."""
        if query.is_cuda and not torch.compiler.is_compiling():
            return self.forward_cuda(positions, query, key)
        return self.forward_native(positions, query, key)

    def forward_cuda(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_native` through the triton kernel: new contiguous tensors, inputs unchanged.

        Positions are not range-checked (no host sync); each must be < max_position_embeddings.
        """
        from mla_kernels.rotary import rotary_embedding

        t, hs = positions.shape[0], self.head_size
        q3, k3 = _heads(query, t, hs), _heads(key, t, hs)
        q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
        rotary_embedding(positions, q3, k3, self.cos_sin_cache, self.is_neox_style,
                         self.rotary_dim, q_out=q_out.view(t, -1, hs),
                         k_out=k_out.view(t, -1, hs))
        return q_out, k_out

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k by their token's position (pure torch).

        Args:
            positions: [T] int64, each < max_position_embeddings.
            query: [T, Hq * head_size] or [T, Hq, head_size].
            key: [T, Hk * head_size] or [T, Hk, head_size].
        Returns:
            (query, key) rotated, new tensors of the input shapes and dtypes.
        """
        cos_sin = self.cos_sin_cache.index_select(0, positions.long())
        cos, sin = cos_sin.float().chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        t = positions.shape[0]
        q = self._rotate(query.reshape(t, -1, self.head_size), cos, sin).reshape(query.shape)
        k = self._rotate(key.reshape(t, -1, self.head_size), cos, sin).reshape(key.shape)
        return q, k

    def extra_repr(self) -> str:
        return (f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
                f"max_pos={self.max_position_embeddings}, base={self.base}, "
                f"neox={self.is_neox_style}")


def _heads(x: torch.Tensor, t: int, head_size: int) -> torch.Tensor:
    """x [T, H * head_size] or [T, H, head_size] as [T, H, head_size] with a contiguous last dim
    (a view when possible, e.g. for a column slice of a fused qkv projection)."""
    x3 = x.reshape(t, -1, head_size)
    return x3 if x3.numel() == 0 or x3.stride(-1) == 1 else x3.contiguous()


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    """`rope_type: linear`: positions divided by `factor` (equivalently inv_freq / factor)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, factor: float) -> None:
        self.scaling_factor = float(factor)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        return super()._compute_inv_freq(base) / self.scaling_factor


class Llama3RotaryEmbedding(RotaryEmbedding):
    """`rope_type: llama3`: long wavelengths / factor, short kept, a smooth blend between."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, factor: float, low_freq_factor: float,
                 high_freq_factor: float, original_max_position: int) -> None:
        self.scaling_factor = float(factor)
        self.low_freq_factor = float(low_freq_factor)
        self.high_freq_factor = float(high_freq_factor)
        self.original_max_position = int(original_max_position)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        inv_freq = super()._compute_inv_freq(base)
        low_wavelen = self.original_max_position / self.low_freq_factor
        high_wavelen = self.original_max_position / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.scaling_factor, inv_freq)
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        blended = (1 - smooth) * scaled / self.scaling_factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)


def rope_params_from_config(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from an HF config (transformers 4 or 5 field names).

    The scaling dict has "rope_type" (or legacy "type") and the variant's fields; None for the
    default (unscaled) rope.
    """
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    merged = {**scaling, **params} if isinstance(params, dict) else dict(scaling)
    theta = merged.get("rope_theta", getattr(hf_config, "rope_theta", None))
    theta = 10000.0 if theta is None else float(theta)
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    return theta, {k: v for k, v in merged.items() if k != "rope_theta"} | {"rope_type": rope_type}


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    is_neox_style: bool = True,
    rope_scaling: dict[str, Any] | None = None,
) -> RotaryEmbedding:
    """Build the rotary embedding for a config.

    Args:
        rope_scaling: None (plain), {"rope_type": "linear", "factor"}, or {"rope_type": "llama3",
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}.
    Raises:
        ValueError: an unsupported rope_type (DeepSeek YaRN is built by its model module).
    """
    if rope_scaling is None:
        return RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style)
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type == "linear":
        return LinearScalingRotaryEmbedding(head_size, rotary_dim, max_position, base,
                                            is_neox_style, rope_scaling["factor"])
    if rope_type == "llama3":
        return Llama3RotaryEmbedding(
            head_size, rotary_dim, max_position, base, is_neox_style,
            rope_scaling["factor"], rope_scaling["low_freq_factor"],
            rope_scaling["high_freq_factor"], rope_scaling["original_max_position_embeddings"])
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
