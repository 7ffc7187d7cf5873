"""Gated activations for MLPs whose gate and up projections are merged into one matmul.

`forward` runs the triton kernel `mla_kernels.activation.silu_and_mul` for CUDA tensors (fp32
math, one rounding) and `forward_native` (pure torch, the form torch.compile traces) on CPU or
while compiling. Inference-only on CUDA (no autograd). `forward_fp8` also hands out the result
quantized per token for a dynamic FP8 down projection (one pass on CUDA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mla_backend.layers.quantization import PerTokenFp8, takes_per_token_fp8


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for x of last dim 2d (gate first, then up).

    Args of forward: x [..., 2d]. Returns [..., d], dtype of x.
    Raises: ValueError if the last dim is odd.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and not torch.compiler.is_compiling():
            return self.forward_cuda(x)
        return self.forward_native(x)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """`forward_native` through the triton kernel; returns a new contiguous tensor."""
        from mla_kernels.activation import silu_and_mul

        if x.shape[-1] % 2:
            raise ValueError(f"SiluAndMul: last dim must be even, got {x.shape[-1]}")
        two_d = x.shape[-1]
        x2 = x.reshape(-1, two_d)
        if x2.shape[0] and x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = torch.empty(x.shape[:-1] + (two_d // 2,), dtype=x.dtype, device=x.device)
        silu_and_mul(x2, out=out.view(-1, two_d // 2))
        return out

    def forward_fp8(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor,
                                                                         torch.Tensor]]:
        """`forward`, plus its rows quantized to FP8 per token for a dynamic FP8 linear that
        reads them (`quantization.PerTokenFp8`, its `x_fp8`).

        Args: x [T, 2d] (2-D).
        Returns:
            (out [T, d] in x's dtype, (q float8_e4m3fn [T, d], scale float32 [T, 1])), q and
            scale exactly `fp8_quant.quantize_per_token(out)`: on CUDA written by the kernel in
            the same pass (`silu_and_mul(fp8_out=)`, rows of up to `FP8_MAX_N`), elsewhere
            that function after `forward`.
        Raises:
            ValueError: x not 2-D or of an odd last dim.
        """
        if x.dim() != 2 or x.shape[-1] % 2:
            raise ValueError(f"SiluAndMul.forward_fp8: x must be [T, 2d], got {tuple(x.shape)}")
        t, d = x.shape[0], x.shape[1] // 2
        from mla_kernels.activation import FP8_MAX_N, silu_and_mul

        if not (x.is_cuda and not torch.compiler.is_compiling() and d <= FP8_MAX_N):
            from mla_kernels.fp8_quant import quantize_per_token

            out = self.forward(x)
            return out, quantize_per_token(out)

        x2 = x if t == 0 or x.stride(-1) == 1 else x.contiguous()
        out = torch.empty((t, d), dtype=x.dtype, device=x.device)
        fp8 = (torch.empty((t, d), dtype=torch.float8_e4m3fn, device=x.device),
               torch.empty((t, 1), dtype=torch.float32, device=x.device))
        silu_and_mul(x2, out=out, fp8_out=fp8)
        return out, fp8

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """Pure torch."""
        if x.shape[-1] % 2:
            raise ValueError(f"SiluAndMul: last dim must be even, got {x.shape[-1]}")
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


def gated_mlp(x: torch.Tensor, x_fp8: PerTokenFp8 | None, gate_up_proj: nn.Module,
              act_fn: SiluAndMul, down_proj: nn.Module) -> torch.Tensor:
    """down_proj(act_fn(gate_up_proj(x))) for x [T, hidden] -> [T, hidden]: the body of the
    gated MLPs (`layers.moe.GatedMLP`, `models.llama.LlamaMLP`). x_fp8 (x quantized per token,
    or None) goes to gate_up_proj; a dynamic FP8 down_proj gets its input quantized by the
    activation kernel (`SiluAndMul.forward_fp8`)."""
    gate_up = gate_up_proj(x, x_fp8)
    if takes_per_token_fp8(down_proj):
        h, h_fp8 = act_fn.forward_fp8(gate_up)
        return down_proj(h, h_fp8)
    return down_proj(act_fn(gate_up))
