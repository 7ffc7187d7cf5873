"""DeepSeek rotary embedding: interleaved (GPT-J style) RoPE with DeepSeek YaRN scaling.

Owns the inverse frequencies, the YaRN cos/sin magnitude (`mscale`) and the softmax-scale
correction of DeepSeek MLA (REFERENCE §1.4, §1.5). Built by `models.deepseek_v2` from the HF
config; applied to the `qk_rope_head_dim` part of q and to the shared k_pe, before k_pe is
written to the KV pool.

Layout: pairs (x[2i], x[2i+1]) are rotated by angle pos * inv_freq[i] (`is_neox_style=False`).
transformers 5.x computes exactly this (complex multiply on adjacent pairs); DeepSeek's original
remote code de-interleaves and rotates halves, which permutes the rope dims of q and k alike and
so gives the same attention scores.

Dispatch: `forward` runs the triton kernel `mla_kernels.rotary.rotary_embedding` for CUDA
tensors and `forward_native` (pure torch, the form torch.compile traces) on CPU or while
compiling. cos/sin are computed from the positions (no position table), so the CUDA path builds the
kernel's per-token [T, rotary_dim] cos ‖ sin table (`table`, the same torch ops as `cos_sin`) and
passes `positions=None` (row t ↔ token t). Every layer of a model rotates the same positions
with the same frequencies, so `models.deepseek_v2` builds that table once per forward and hands
it to every layer (`forward(..., table=...)`): at batch size 1 the five to seven small torch
kernels that build it were ~190 of the ~970 launches of a V2-Lite decode step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN magnitude factor: 0.1 * mscale * ln(scale) + 1 (1.0 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_find_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_inv_freq(
    dim: int,
    base: float,
    factor: float,
    original_max_position: int,
    beta_fast: float = 32,
    beta_slow: float = 1,
) -> torch.Tensor:
    """DeepSeek YaRN inverse frequencies, [dim // 2] fp32.

    Dims below floor(d(beta_fast)) keep the original frequency, dims above ceil(d(beta_slow)) are
    divided by `factor`, a linear ramp blends in between (d = correction dim, REFERENCE §1.5).
    """
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    low = max(math.floor(_yarn_find_correction_dim(beta_fast, dim, base, original_max_position)), 0)
    high = min(math.ceil(_yarn_find_correction_dim(beta_slow, dim, base, original_max_position)),
               dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1.0 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


class DeepseekRotaryEmbedding(nn.Module):
    """Interleaved RoPE over `rotary_dim` dims with optional DeepSeek YaRN.

    Args:
        rotary_dim: rope dims per head (qk_rope_head_dim, e.g. 64); even.
        base: rope_theta.
        scaling: None for plain RoPE, else the YaRN dict (`factor`,
            `original_max_position_embeddings`, `beta_fast`, `beta_slow`, `mscale`,
            `mscale_all_dim`).
    Attributes:
        inv_freq: [rotary_dim // 2] fp32 buffer.
        mscale: cos/sin magnitude = mscale(factor, mscale) / mscale(factor, mscale_all_dim).
    cos/sin are computed per call from `positions` in fp32 (no table, so no maximum position).
    """

    def __init__(self, rotary_dim: int, base: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        if scaling is None:
            inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32)
                                       / rotary_dim))
            self.mscale = 1.0
        else:
            factor = float(scaling["factor"])
            inv_freq = yarn_inv_freq(
                rotary_dim, base, factor, int(scaling["original_max_position_embeddings"]),
                scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1)
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            if m and m_all:
                self.mscale = yarn_get_mscale(factor, m) / yarn_get_mscale(factor, m_all)
            else:
                self.mscale = yarn_get_mscale(factor)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, rotary_dim // 2] fp32, times mscale."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        return torch.cos(freqs) * self.mscale, torch.sin(freqs) * self.mscale

    def table(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] int64 -> [T, rotary_dim] fp32: cos ‖ sin of `cos_sin` (times mscale)."""
        cos, sin = self.cos_sin(positions)
        return torch.cat([cos, sin], dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        table: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Triton kernel on CUDA, else `forward_native` (same args and results). `table`: this
        module's `table(positions)` when the caller already has it (else it is computed)."""
        if q.is_cuda and not torch.compiler.is_compiling():
            return self.forward_cuda(positions, q, k, table)
        return self.forward_native(positions, q, k, table)

    def forward_cuda(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        table: torch.Tensor | None = None, q_out: torch.Tensor | None = None,
        k_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_native` through the triton kernel, inputs unchanged: into q_out / k_out
        when given (shapes of q / k, their dtype, last dim contiguous; e.g. the rope columns of
        the absorbed MLA query), else into new contiguous tensors. Returns (q_out, k_out).

        q/k may be strided views (e.g. the rope slice of q) as long as the last dim is
        contiguous; otherwise they are copied first.
        """
        from mla_kernels.rotary import rotary_embedding

        if table is None:
            table = self.table(positions)  # [T, rotary_dim] fp32, row t for token t
        q_in = q if q.numel() == 0 or q.stride(-1) == 1 else q.contiguous()
        k_in = k if k.numel() == 0 or k.stride(-1) == 1 else k.contiguous()
        if q_out is None:
            q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if k_out is None:
            k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        rotary_embedding(None, q_in, k_in, table, False, self.rotary_dim, q_out=q_out,
                         k_out=k_out)
        return q_out, k_out

    def forward_into(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     table: torch.Tensor | None, q_out: torch.Tensor, k_out: torch.Tensor
                     ) -> None:
        """`forward` with the rotated q / k written into q_out / k_out (see `forward_cuda`):
        the kernel straight into them on CUDA, else `forward_native` and copies."""
        if q.is_cuda and not torch.compiler.is_compiling():
            self.forward_cuda(positions, q, k, table, q_out, k_out)
            return
        q_rot, k_rot = self.forward_native(positions, q, k, table)
        q_out.copy_(q_rot)
        k_out.copy_(k_rot)

    def forward_native(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        table: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, rotary_dim] and k [T, Hk, rotary_dim] at `positions` [T] (pure torch;
        `table` as in `forward`).

        Returns new tensors of the input dtype (math in fp32).
        """
        if table is None:
            cos, sin = self.cos_sin(positions)
        else:
            cos, sin = table.chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return _rotate_interleaved(q, cos, sin), _rotate_interleaved(k, cos, sin)


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def softmax_scale(qk_head_dim: int, rope_config: dict[str, Any] | None) -> float:
    """MLA softmax scale: qk_head_dim^-0.5 x mscale(factor, mscale_all_dim)^2 under YaRN.

    Used unchanged in the absorbed (kv_lora + rope)-dim space (never (kv_lora + rope)^-0.5).
    """
    scale = qk_head_dim ** -0.5
    if rope_config is not None:
        m_all = rope_config.get("mscale_all_dim", 0)
        if m_all:
            m = yarn_get_mscale(float(rope_config["factor"]), m_all)
            scale = scale * m * m
    return scale


def deepseek_rope_config(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, YaRN dict or None) from an HF DeepSeek config.

    Reads transformers 5 `rope_parameters` or the legacy `rope_scaling` + `rope_theta`.
    Raises:
        ValueError: a rope type other than default/yarn/deepseek_yarn.
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling",
                                                                     None) or {}
    theta = float(params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        return theta, None
    if rope_type not in ("yarn", "deepseek_yarn"):
        raise ValueError(f"unsupported rope type for DeepSeek: {rope_type!r}")
    return theta, dict(params)


__all__ = ["DeepseekRotaryEmbedding", "deepseek_rope_config", "softmax_scale", "yarn_get_mscale",
           "yarn_inv_freq"]
