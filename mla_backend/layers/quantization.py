"""Quantization methods of the linear layers (`layers.linear`): unquantized and DeepSeek-V3
block-wise FP8.

Owns how a linear holds and applies its weight: `UnquantizedLinearMethod` (weight in the model
dtype, `F.linear`) and `BlockFP8LinearMethod` (`weight` float8_e4m3fn + `weight_scale_inv`
float32 per 128x128 block, per-token-group FP8 activations, the triton block-scaled GEMM
`mla_kernels.block_fp8_gemm`), chosen per linear from the checkpoint's `quantization_config`
(`BlockFP8Config.from_hf`, then `for_module(prefix)`). The linear classes call `_make_weight` to
create their parameters and `_rows` to expand a checkpoint's block scales to one row per weight
row while loading (so every TP / merged-shard slicing rule of the weight applies to them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------- quantization
FP8_E4M3 = torch.float8_e4m3fn


@dataclass(frozen=True)
class BlockFP8Config:
    """DeepSeek-V3 block-wise FP8 (the checkpoint's `quantization_config`).

    Source: DeepSeek-V3 `config.json` {"quant_method": "fp8", "fmt": "e4m3",
    "activation_scheme": "dynamic", "weight_block_size": [128, 128]} and its `inference/
    kernel.py`; transformers' FineGrainedFP8Config and SGLang's `Fp8Config` (block-quant mode)
    read the same fields. A quantized linear stores `weight` float8_e4m3fn [N, K] and
    `weight_scale_inv` float32 [ceil(N/bn), ceil(K/bk)]; activations are quantized per token per
    bk columns at run time (scale = amax / 448).

    Fields:
        weight_block_size: (bn, bk).
        modules_to_not_convert: module-name substrings left unquantized (optional HF field).
            DeepSeek-V3 also keeps the embedding, the router (`mlp.gate`), the LM head and all
            norms in bf16: the models never pass a quant config to those.
        activation_quant: quantize activations (the format's "dynamic" scheme, default). False
            keeps activations in the model dtype (a diagnostic: isolates the weight format).
    """

    weight_block_size: tuple[int, int] = (128, 128)
    modules_to_not_convert: tuple[str, ...] = ()
    activation_quant: bool = True

    @classmethod
    def from_hf(cls, quantization_config: Any) -> "BlockFP8Config | None":
        """Parse an HF `quantization_config` (dict or object); None/empty -> None.

        Raises:
            NotImplementedError: a quant_method other than "fp8", FP8 without
                `weight_block_size` (per-tensor FP8), or a static activation scheme.
            ValueError: fmt other than e4m3, or a malformed weight_block_size.
        """
        q = quantization_config
        if not q:
            return None
        get = q.get if isinstance(q, dict) else (lambda k, d=None: getattr(q, k, d))
        method = get("quant_method")
        if method is None:
            return None
        if method != "fp8":
            raise NotImplementedError(f"quantization {method!r} is not supported (only "
                                      "DeepSeek-V3 block-wise 'fp8')")
        fmt = get("fmt", "e4m3") or "e4m3"
        if fmt != "e4m3":
            raise ValueError(f"FP8 fmt {fmt!r} not supported (e4m3 only)")
        block = get("weight_block_size")
        if block is None:
            raise NotImplementedError("per-tensor FP8 checkpoints (no weight_block_size) are "
                                      "not supported yet; block-wise FP8 only")
        if len(block) != 2 or min(block) < 1 or int(block[1]) % 16:
            raise ValueError(f"weight_block_size {block} must be [bn, bk] with bk a multiple "
                             "of 16")
        scheme = get("activation_scheme", "dynamic") or "dynamic"
        if scheme != "dynamic":
            raise NotImplementedError(f"activation_scheme {scheme!r} not supported (dynamic)")
        skip = tuple(get("modules_to_not_convert", None) or ())
        return cls((int(block[0]), int(block[1])), skip)

    def for_module(self, prefix: str) -> "BlockFP8Config | None":
        """This config for the linear named `prefix` (HF module name), or None when it is in
        `modules_to_not_convert`."""
        return None if any(m in prefix for m in self.modules_to_not_convert) else self


class UnquantizedLinearMethod:
    """weight in the model dtype; y = x W^T (+ b)."""

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.detach()


class BlockFP8LinearMethod:
    """DeepSeek-V3 block-wise FP8 linear (see `BlockFP8Config`).

    Parameters it adds to a layer with local weight rows n and local input columns k:
    `weight` float8_e4m3fn [n, k]; `weight_scale_inv` float32, [n, ceil(k/bk)] while loading
    (row-expanded), [ceil(n/bn), ceil(k/bk)] after `process_weights_after_loading` when every
    bn-row block of local rows has one scale (else it stays row-expanded, `layer.scale_block_n`
    = 1, e.g. merged shards that are not multiples of bn).

    apply: x [..., k] (any float dtype) -> [..., n] in x's dtype. Activations are quantized in
    torch (`per_token_group_quant_fp8`, groups of bk) unless `activation_quant` is off, then the
    triton kernel `block_fp8_matmul` runs (CUDA; on CPU through triton's interpreter, which
    must be on: TRITON_INTERPRET=1), accumulating in fp32.
    """

    def __init__(self, config: BlockFP8Config) -> None:
        self.config = config
        self.block_n, self.block_k = config.weight_block_size

    def create_weights(self, layer: nn.Module, rows: int, cols: int) -> None:
        layer.weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8_E4M3), requires_grad=False)
        kb = -(-cols // self.block_k)
        layer.weight_scale_inv = nn.Parameter(torch.empty(rows, kb, dtype=torch.float32),
                                              requires_grad=False)
        layer.weight_scale_inv.block_scale_rows = self.block_n  # checkpoint rows per scale row
        layer.scale_block_n = 1

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Compact the row-expanded scale to one row per bn-row block where that is exact."""
        s = layer.weight_scale_inv.data
        if layer.scale_block_n != 1 or self.block_n == 1:
            return
        rows = s.shape[0]
        firsts = s[:: self.block_n]  # [ceil(rows/bn), kb]
        if torch.equal(firsts.repeat_interleave(self.block_n, 0)[:rows], s):
            layer.weight_scale_inv = nn.Parameter(firsts.contiguous(), requires_grad=False)
            layer.scale_block_n = self.block_n

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """weight * scale_inv per block -> [n, k] float32."""
        from mla_kernels.block_fp8_gemm import dequant_weight_block_fp8

        return dequant_weight_block_fp8(layer.weight, layer.weight_scale_inv,
                                        (layer.scale_block_n, self.block_k))

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        from mla_kernels.block_fp8_gemm import block_fp8_matmul, per_token_group_quant_fp8

        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        if self.config.activation_quant:
            a, a_scale = per_token_group_quant_fp8(x2, self.block_k)
        else:
            a = x2.contiguous()
            a_scale = torch.ones(x2.shape[0], -(-k // self.block_k), device=x.device)
        y = block_fp8_matmul(a, layer.weight, a_scale, layer.weight_scale_inv,
                             (layer.scale_block_n, self.block_k), out_dtype=x.dtype)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], y.shape[-1])


def _make_weight(layer: nn.Module, rows: int, cols: int,
                 quant_config: BlockFP8Config | None) -> None:
    """Create `layer.weight` [rows, cols] (+ scales) and `layer.quant_method`."""
    if quant_config is None:
        layer.quant_method = UnquantizedLinearMethod()
        layer.weight = nn.Parameter(torch.empty(rows, cols), requires_grad=False)
    else:
        layer.quant_method = BlockFP8LinearMethod(quant_config)
        layer.quant_method.create_weights(layer, rows, cols)


def _rows(param: nn.Parameter, loaded: torch.Tensor, n_rows: int) -> torch.Tensor:
    """For a block-scale parameter: the checkpoint's [ceil(n_rows/bn), kb] scale expanded to one
    row per weight row [n_rows, kb]; any other parameter: `loaded` unchanged.

    Raises:
        ValueError: the scale does not have ceil(n_rows/bn) rows.
    """
    bn = getattr(param, "block_scale_rows", None)
    if bn is None:
        return loaded
    if loaded.dim() != 2 or loaded.shape[0] != -(-n_rows // bn):
        raise ValueError(f"weight_scale_inv of shape {tuple(loaded.shape)} for {n_rows} weight "
                         f"rows in blocks of {bn}")
    return loaded.float().repeat_interleave(bn, 0)[:n_rows]
