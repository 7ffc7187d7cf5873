"""Quantization methods of the linear layers (`layers.linear`): unquantized, DeepSeek-V3
block-wise FP8, and per-tensor FP8 (`Fp8Config` / `Fp8LinearMethod`: FP8 checkpoints in the
vLLM / ModelOpt per-tensor format, or online quantization of a bf16/fp32 checkpoint).

Owns how a linear holds and applies its weight: `UnquantizedLinearMethod` (weight in the model
dtype, `F.linear`) and `BlockFP8LinearMethod` (`weight` float8_e4m3fn + `weight_scale_inv`
float32 per 128x128 block, per-token-group FP8 activations, the triton block-scaled GEMM
`mla_kernels.block_fp8_gemm`), chosen per linear from the checkpoint's `quantization_config`
(`BlockFP8Config.from_hf`, then `for_module(prefix)`). The linear classes call `_make_weight` to
create their parameters and `_rows` to expand a checkpoint's block scales to one row per weight
row while loading (so every TP / merged-shard slicing rule of the weight applies to them).
Also the absorbed-MLA FP8 batched matmul: `quantize_fp8_bmm_weight` (per-tensor FP8 weight,
column-major per batch entry) and `fp8_per_tensor_bmm` (dynamic per-tensor activations; on
CUDA the triton `mla_kernels.bmm_fp8` quantizing x on load, one GEMM launch for all heads; on CPU
a loop of `torch._scaled_mm`), with its float32 twin `mla_kernels.reference.bmm_fp8_ref`.
Activation quantization runs on CUDA as the triton kernels of `mla_kernels.fp8_quant`, on CPU in
torch: per token (`mla_kernels.fp8_quant.quantize_per_token`, one launch) for every dynamic FP8
linear, whose GEMM is then rowwise-scaled (`fp8_per_token_mm`); per tensor
(`quantize_fp8_per_tensor`, two launches, one with a static scale) for static activation scales
and for weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------- quantization
FP8_E4M3 = torch.float8_e4m3fn


def _fp8_getter(quantization_config: Any) -> Callable[..., Any] | None:
    """A `get(key, default)` over a checkpoint's quantization_config (dict or HF object), or
    None when there is none (or no quant_method).

    Raises:
        NotImplementedError: a quant_method other than "fp8".
    """
    q = quantization_config
    if not q:
        return None
    get = q.get if isinstance(q, dict) else (lambda k, d=None: getattr(q, k, d))
    method = get("quant_method")
    if method is None:
        return None
    if method != "fp8":
        raise NotImplementedError(f"quantization {method!r} is not supported (fp8 only)")
    return get


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
        get = _fp8_getter(quantization_config)
        if get is None:
            return None
        fmt = get("fmt", "e4m3") or "e4m3"
        if fmt != "e4m3":
            raise ValueError(f"FP8 fmt {fmt!r} not supported (e4m3 only)")
        block = get("weight_block_size")
        if block is None:
            raise NotImplementedError("per-tensor FP8 checkpoints (no weight_block_size) are "
                                      "read by `Fp8Config.from_hf` / `quant_config_from_hf`")
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


# Token rows up to which a 16-bit CUDA linear runs as `mla_kernels.gemv` instead of cuBLAS
# (decode at batch size 1; benchmarks/bench_gemv.py measures it).
GEMV_MAX_ROWS = 1


def unquantized_linear(x: torch.Tensor, w: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) for a weight w [N, K] in the model dtype, or fp32 (then y is fp32), that
    no kernel writes during a forward (a model weight). A bf16/fp16 CUDA x [T, K] of at most
    `GEMV_MAX_ROWS` rows (not while torch.compile traces) goes through the triton `gemv` (which
    takes a 16-bit x with an fp32 weight as it is), anything else through `F.linear` (x cast to
    an fp32 weight's dtype)."""
    if (x.is_cuda and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16)
            and w.dtype in (x.dtype, torch.float32)
            and x.stride(1) == 1 and w.stride(1) == 1
            and not torch.compiler.is_compiling()):
        from mla_kernels.gemv import gemv

        # a model weight: nothing writes it during a forward (PDL prefetch, mla_kernels/pdl.py)
        return gemv(x, w, bias, static_weight=True)
    if w.dtype == torch.float32 and x.dtype != torch.float32:
        x = x.float()
    return F.linear(x, w, bias)


class UnquantizedLinearMethod:
    """weight in the model dtype, or fp32 (the MoE router, `layers.moe.RouterGate`: then the
    result is fp32); y = x W^T (+ b) by `unquantized_linear`."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              x_fp8: PerTokenFp8 | None = None) -> torch.Tensor:
        return unquantized_linear(x, layer.weight, bias)  # x_fp8: not this method's input

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

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              x_fp8: PerTokenFp8 | None = None) -> torch.Tensor:
        """x_fp8 is ignored: these activations are quantized per group of bk columns."""
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


# ---------------------------------------------------------------------------- per-tensor FP8
# Activations [T, K] quantized per token, as `mla_kernels.fp8_quant.quantize_per_token` gives
# them: (q float8_e4m3fn [T, K], scale float32 [T, 1]). Layers may be handed one next to x
# (`apply(..., x_fp8=)`): a method that quantizes x per token uses it instead, others ignore it.
PerTokenFp8 = tuple[torch.Tensor, torch.Tensor]
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_MIN_SCALE = 1e-12  # floor of a dynamic scale (an all-zero tensor must not divide by 0)
QUANTIZATION_METHODS = ("", "fp8")  # the engine setting `quantization`
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the FP8 kernels read


@dataclass(frozen=True)
class Fp8Config:
    """Per-tensor FP8 (e4m3): one float32 scale per weight tensor; activations per token
    (dynamic) or per tensor (static).

    Sources: the vLLM / ModelOpt per-tensor checkpoint format (`quantization_config`
    {"quant_method": "fp8", "activation_scheme": "static" | "dynamic"}, no weight_block_size;
    tensors `X.weight` float8_e4m3fn [N, K], `X.weight_scale` float32 scalar, and for "static"
    `X.input_scale` float32 scalar), read as vLLM's `Fp8Config` / `Fp8LinearMethod`
    (vllm/model_executor/layers/quantization/fp8.py) reads it; or online quantization of a
    bf16/fp32 checkpoint (engine setting `quantization="fp8"`, vLLM's
    `--quantization fp8`): weight scale = amax(|W|) / 448 at load, dynamic activations.

    Fields:
        is_checkpoint_fp8: the checkpoint holds FP8 weights + scales (else: quantize at load).
        activation_scheme: "dynamic" (x scales = amax(|x[m]|) / 448 per call, one per token:
            vLLM's per-token dynamic FP8 with rowwise-scaled GEMMs) or "static" (the
            checkpoint's `input_scale`, one for the tensor; merged layers take the max of their
            shards', as vLLM does).
        modules_to_not_convert: module-name substrings left unquantized (optional HF field).
            The models never pass a quant config to the embedding, LM head or MoE router.
    """

    is_checkpoint_fp8: bool = False
    activation_scheme: str = "dynamic"
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, quantization_config: Any) -> "Fp8Config | None":
        """Parse a per-tensor FP8 `quantization_config` (dict or object); None/empty -> None.

        Raises:
            NotImplementedError: a quant_method other than "fp8", or block-wise FP8 (that is
                `BlockFP8Config`). ValueError: fmt other than e4m3, or an activation_scheme
                other than static/dynamic.
        """
        get = _fp8_getter(quantization_config)
        if get is None:
            return None
        if get("weight_block_size") is not None:
            raise NotImplementedError("block-wise FP8: use BlockFP8Config")
        fmt = get("fmt", "e4m3") or "e4m3"
        if fmt != "e4m3":
            raise ValueError(f"FP8 fmt {fmt!r} not supported (e4m3 only)")
        scheme = get("activation_scheme", "dynamic") or "dynamic"
        if scheme not in ("static", "dynamic"):
            raise ValueError(f"activation_scheme {scheme!r} must be static or dynamic")
        skip = tuple(get("modules_to_not_convert", None) or get("ignored_layers", None) or ())
        return cls(True, scheme, skip)

    def for_module(self, prefix: str) -> "Fp8Config | None":
        """This config for the linear named `prefix`, or None when it is not converted."""
        return None if any(m in prefix for m in self.modules_to_not_convert) else self


QuantConfig = BlockFP8Config | Fp8Config


def quant_config_from_hf(quantization_config: Any, quantization: str = "") -> QuantConfig | None:
    """The linear layers' quant config of a model.

    Args:
        quantization_config: the HF config's `quantization_config` (dict/object/None).
        quantization: the engine setting ("" = as the checkpoint, "fp8" = per-tensor FP8).
    Returns:
        `BlockFP8Config` (block-wise checkpoint), `Fp8Config` (per-tensor checkpoint, or online
        "fp8" of an unquantized checkpoint), or None.
    Raises:
        ValueError: unknown `quantization`; see `BlockFP8Config.from_hf` / `Fp8Config.from_hf`.
    """
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {quantization!r} must be one of {QUANTIZATION_METHODS}")
    q = quantization_config
    get = (q.get if isinstance(q, dict) else (lambda k, d=None: getattr(q, k, d))) if q else None
    if get is not None and get("quant_method") is not None:
        if get("quant_method") == "fp8" and get("weight_block_size") is None:
            return Fp8Config.from_hf(q)
        return BlockFP8Config.from_hf(q)  # an FP8 checkpoint is FP8 whatever the setting
    return Fp8Config() if quantization == "fp8" else None


def quantize_fp8_per_tensor(x: torch.Tensor, scale: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Saturating per-tensor e4m3 quantization: on CUDA (float32/bf16/fp16 x, outside
    torch.compile) the two-launch triton kernel `mla_kernels.fp8_quant.quantize_fp8` (no host
    sync; its scale within one bit of torch's, q exact for that scale), else torch.

    Args:
        x: any float tensor. scale: float32 scalar, or None = amax(|x|) / 448 (floored at 1e-12).
    Returns:
        (q float8_e4m3fn, x's shape, q * scale ~ x; values beyond +-448 * scale saturate to
        +-448, never NaN for finite x; NaN in x stays NaN — on CUDA a NaN element does not
        reach the dynamic scale, in torch it makes the scale NaN), scale float32 0-dim.
    """
    if (x.is_cuda and x.dtype in _KERNEL_DTYPES and not torch.compiler.is_compiling()
            and (scale is None or scale.device == x.device)):
        from mla_kernels.fp8_quant import quantize_fp8

        return quantize_fp8(x, scale)
    xf = x.float()
    if scale is None:
        scale = (xf.abs().amax() / FP8_MAX).clamp(min=_MIN_SCALE)
    scale = scale.float().reshape(())
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_E4M3), scale


def fp8_per_token_mm(x: torch.Tensor, w_t: torch.Tensor, w_scale_row: torch.Tensor,
                     out_dtype: torch.dtype | None = None,
                     x_fp8: PerTokenFp8 | None = None) -> torch.Tensor:
    """y = (x quantized per token, `mla_kernels.fp8_quant.quantize_per_token`: x_scale[m] =
    max(amax(|x[m]|) / 448, 1e-12)) @ w_t * x_scale[m] * w_scale_row[n]: the dynamic FP8 linear.

    Args:
        x: [M, K] float. w_t: [K, N] float8_e4m3fn, column-major (`weight.t()` of a row-major
            [N, K] weight). w_scale_row: float32 [1, N] contiguous, one weight scale per output
            column (a per-tensor scale repeated; a fused matrix's parts may differ).
            out_dtype: default x's dtype.
        x_fp8: x already quantized so (`PerTokenFp8`, e.g. by the RMSNorm that wrote x:
            `RMSNorm.forward_fp8`); then x is not read again.
    Returns:
        [M, N] in out_dtype, fp32 accumulation (`_fp8_rowwise_scaled_mm`: a rowwise-scaled
        `torch._scaled_mm` for bf16 output; other output dtypes run the FP8 GEMM into float32
        and scale after). On CUDA at up to FP8_GEMV_MAX_ROWS rows of a float x, outside
        torch.compile, x is not quantized: the weight-only FP8 `gemv` (y = x @ w_t *
        w_scale_row), one launch that reads the same weight bytes (x_fp8 is then unused).
    Raises:
        ValueError: x_fp8 not of x's shape (`fp8_quant.check_per_token_pair`).
    """
    from mla_kernels.fp8_quant import check_per_token_pair, quantize_per_token

    out_dtype = out_dtype or x.dtype
    if (x.is_cuda and x.shape[0] <= FP8_GEMV_MAX_ROWS and x.dtype in _KERNEL_DTYPES
            and out_dtype in _KERNEL_DTYPES and w_t.stride(0) == 1 and x.stride(-1) == 1
            and not torch.compiler.is_compiling()):
        from mla_kernels.gemv import gemv

        # a model weight: nothing writes it during a forward (PDL prefetch, mla_kernels/pdl.py)
        return gemv(x, w_t.t(), w_scale=w_scale_row, out_dtype=out_dtype, static_weight=True)
    if x_fp8 is None:
        x_fp8 = quantize_per_token(x)
    else:
        check_per_token_pair(*x_fp8, *x.shape, "x_fp8")
    q, xs = x_fp8
    return _fp8_rowwise_scaled_mm(q, xs, w_t, w_scale_row, out_dtype)


# Token rows up to which a CUDA dynamic FP8 linear (`fp8_per_token_mm`) runs as the triton
# weight-only `gemv` over the fp8 weight (a stream of the weight, like the 16-bit linears' GEMV
# at GEMV_MAX_ROWS; x not quantized) instead of quantizing x and `torch._scaled_mm`. Wider
# batches not measured.
FP8_GEMV_MAX_ROWS = 1

# `torch._scaled_mm(use_fast_accum=)` for the dense FP8 linears: Hopper's FP8 MMA then keeps
# its own accumulator over the whole K loop instead of adding it into fp32 registers every few
# steps; DeepSeek-V3's report (arXiv 2412.19437, section 3.3.2) puts that accumulator at about
# 14 bits. (The triton FP8 GEMMs here, fused MoE, bmm_fp8 and block-FP8, accumulate that way on
# sm_90: triton's default `max_num_imprecise_acc` there is 2**30.) Off: it makes the dense FP8
# linears somewhat faster (`benchmarks/bench_dense_fp8.py --sections accum`) but raises the
# GEMM's own error, and the rowwise GEMM test (a row's largest x 1e-3 plus bf16 rounding)
# fails with it on.
FP8_FAST_ACCUM = False


def _fp8_rowwise_scaled_mm(q: torch.Tensor, q_scale: torch.Tensor, w_t: torch.Tensor,
                           w_scale_row: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """q [M, K] float8_e4m3fn @ w_t [K, N] float8_e4m3fn (column-major) * q_scale [M, 1] *
    w_scale_row [1, N] -> [M, N] out_dtype (fp32 accumulation), `torch._scaled_mm` on CUDA."""
    k, n = w_t.shape
    if q.is_cuda and not (k % 16 or n % 16):  # cuBLASLt / CUTLASS FP8 need K, N % 16 == 0
        if out_dtype == torch.bfloat16:  # rowwise scaling: bf16 output on every torch build
            return torch._scaled_mm(q, w_t, scale_a=q_scale, scale_b=w_scale_row,
                                    out_dtype=out_dtype, use_fast_accum=FP8_FAST_ACCUM)
        one = q_scale.new_ones(())
        y = torch._scaled_mm(q, w_t, scale_a=one, scale_b=one, out_dtype=torch.float32,
                             use_fast_accum=FP8_FAST_ACCUM)
    else:
        y = q.float() @ w_t.float()
    return (y * q_scale * w_scale_row).to(out_dtype)


def fp8_per_tensor_mm(x: torch.Tensor, w_t: torch.Tensor, w_scale: torch.Tensor,
                      x_scale: torch.Tensor | None = None,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = (x quantized per tensor) @ w_t * x_scale * w_scale with `torch._scaled_mm`.

    Args:
        x: [M, K] float. w_t: [K, N] float8_e4m3fn, column-major (`weight.t()` of a row-major
            [N, K] weight). w_scale: float32 0-dim. x_scale: static scale (0-dim) or None =
            dynamic (amax/448). out_dtype: default x's dtype.
    Returns:
        [M, N] in out_dtype, fp32 accumulation.
    """
    q, xs = quantize_fp8_per_tensor(x, x_scale)
    return _fp8_scaled_mm(q, xs, w_t, w_scale, out_dtype or x.dtype)


def _fp8_scaled_mm(q: torch.Tensor, q_scale: torch.Tensor, w_t: torch.Tensor,
                   w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """q [M, K] float8_e4m3fn @ w_t [K, N] float8_e4m3fn (column-major) * q_scale * w_scale ->
    [M, N] out_dtype (fp32 accumulation)."""
    k, n = w_t.shape
    if q.is_cuda and (k % 16 or n % 16):  # cuBLASLt FP8 needs K, N multiples of 16
        return ((q.float() @ w_t.float()) * (q_scale * w_scale)).to(out_dtype)
    return torch._scaled_mm(q, w_t, scale_a=q_scale, scale_b=w_scale.float().reshape(()),
                            out_dtype=out_dtype, use_fast_accum=FP8_FAST_ACCUM)


def quantize_fp8_bmm_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batched weight [B, K, N] (any float) -> (float8_e4m3fn [B, K, N], each w[b] column-major,
    i.e. stored as [B, N, K] row-major: the B operand `torch._scaled_mm` wants; float32 0-dim
    scale = amax(|w|) / 448 over the whole tensor)."""
    q, s = quantize_fp8_per_tensor(w.transpose(1, 2).contiguous())  # [B, N, K] row-major
    return q.transpose(1, 2), s


def fp8_per_tensor_bmm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                       x_scale: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """y[b] = (x quantized per tensor)[b] @ w[b] * x_scale * w_scale: the absorbed-MLA products
    (q_nope . w_kc, o . w_vc). On CUDA (float32/bf16/fp16 x, outside torch.compile): the triton
    `mla_kernels.bmm_fp8.bmm_fp8` (one amax launch when dynamic + one GEMM launch for all
    heads, x quantized on load); else x is quantized once and each batch entry (head) is one
    `torch._scaled_mm`.

    Args:
        x: [B, M, K] float (any strides). w: [B, K, N] float8_e4m3fn, each w[b] column-major
            (`quantize_fp8_bmm_weight`). w_scale: float32 0-dim. x_scale: static 0-dim scale or
            None = dynamic, amax(|x|) / 448 over the whole x (one scale for every head; values
            beyond +-448 * x_scale saturate, never NaN). out_dtype: default x's dtype (out's
            dtype when out is given).
        out: optional [B, M, N] result of any strides (e.g. a view of the absorbed query's
            columns, transposed to head-major): the triton kernel writes it directly, the
            fallback copies into it.
    Returns:
        [B, M, N] in out_dtype, fp32 accumulation (`out` when given). Reference:
        `mla_kernels.reference.bmm_fp8_ref`. On CUDA without `out` the result is a transposed
        view of a contiguous [M, B, N] tensor (token-major rows).
    Raises:
        ValueError: out of the wrong shape.
    """
    if out is not None:
        if tuple(out.shape) != (x.shape[0], x.shape[1], w.shape[2]):
            raise ValueError(f"fp8_per_tensor_bmm: out {tuple(out.shape)}, expected "
                             f"{(x.shape[0], x.shape[1], w.shape[2])}")
        out_dtype = out.dtype
    out_dtype = out_dtype or x.dtype
    if (x.is_cuda and x.dtype in _KERNEL_DTYPES and not torch.compiler.is_compiling()
            and out_dtype in _KERNEL_DTYPES):
        from mla_kernels.bmm_fp8 import bmm_fp8

        b, m, _ = x.shape
        if out is None:
            out = torch.empty(m, b, w.shape[2], dtype=out_dtype, device=x.device).transpose(0, 1)
        return bmm_fp8(x.detach(), w, w_scale, x_scale, out=out)
    # x is quantized once for all heads (one scale); each head is then one FP8 GEMM.
    q, xs = quantize_fp8_per_tensor(x.detach(), x_scale)
    q = q.contiguous()  # row-major per head: the A operand `torch._scaled_mm` wants
    y = torch.stack([_fp8_scaled_mm(q[b], xs, w[b], w_scale, out_dtype)
                     for b in range(x.shape[0])])
    return y if out is None else out.copy_(y)


class Fp8LinearMethod:
    """Per-tensor FP8 linear (see `Fp8Config`).

    Parameters it adds to a layer with local weight rows n and input columns k:
    - checkpoint FP8: `weight` float8_e4m3fn [n, k]; `weight_scale` float32 [n] while loading
      (the checkpoint's scalar of each shard repeated over the shard's rows, so merged / TP
      slicing applies unchanged), 0-dim after `process_weights_after_loading`, which
      requantizes every row to the max scale when shards differ (vLLM's
      `requantize_with_max_scale`); "static": `input_scale` float32 [n] likewise, then its max.
    - online: `weight` in the model dtype [n, k] while loading, quantized by
      `process_weights_after_loading` (scale = amax / 448).
    After processing also `weight_scale_row` float32 [1, n] (the scale repeated: the rowwise
    GEMM's column scales, which the dynamic path reads). It is derived once from
    `weight_scale` by `process_weights_after_loading`: whoever changes a processed layer's
    scale in place must write both.
    apply: x [..., k] -> [..., n] in x's dtype: dynamic activations quantized per token and a
    rowwise-scaled GEMM (`fp8_per_token_mm`); a static `input_scale` quantizes per tensor
    (`fp8_per_tensor_mm`). Both `torch._scaled_mm`.
    """

    def __init__(self, config: Fp8Config) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module, rows: int, cols: int) -> None:
        if not self.config.is_checkpoint_fp8:
            layer.weight = nn.Parameter(torch.empty(rows, cols), requires_grad=False)
            return
        layer.weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8_E4M3), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(rows, dtype=torch.float32),
                                          requires_grad=False)
        layer.weight_scale.per_tensor_scale = True
        if self.config.activation_scheme == "static":
            layer.input_scale = nn.Parameter(torch.empty(rows, dtype=torch.float32),
                                             requires_grad=False)
            layer.input_scale.per_tensor_scale = True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Online: quantize the weight. Checkpoint: one weight scale (requantized to the max of
        the shards' scales) and one input scale (max)."""
        if layer.weight.dtype != FP8_E4M3:
            q, s = quantize_fp8_per_tensor(layer.weight.data)
        elif layer.weight_scale.dim() == 0:
            return  # already processed (weight_scale_row too)
        else:
            rows = layer.weight_scale.data  # [n]
            s = rows.max()
            q = layer.weight.data
            if not torch.equal(rows, s.expand_as(rows)):
                q, _ = quantize_fp8_per_tensor(q.float() * rows[:, None], s)
            if hasattr(layer, "input_scale"):
                layer.input_scale = nn.Parameter(layer.input_scale.data.max(),
                                                 requires_grad=False)
        layer.weight = nn.Parameter(q.contiguous(), requires_grad=False)  # [n, k] row-major
        layer.weight_scale = nn.Parameter(s.reshape(()), requires_grad=False)
        layer.weight_scale_row = nn.Parameter(
            s.float().reshape(1, 1).expand(1, q.shape[0]).contiguous(), requires_grad=False)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """weight * weight_scale -> [n, k] float32 (after processing)."""
        return layer.weight.float() * layer.weight_scale

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              x_fp8: PerTokenFp8 | None = None) -> torch.Tensor:
        """x_fp8: x [T, k] quantized per token (dynamic activations only; a static
        `input_scale` ignores it)."""
        k = x.shape[-1]
        x_scale = getattr(layer, "input_scale", None)
        if x_scale is None:
            y = fp8_per_token_mm(x.reshape(-1, k), layer.weight.t(), layer.weight_scale_row,
                                 x_fp8=x_fp8)
        else:
            y = fp8_per_tensor_mm(x.reshape(-1, k), layer.weight.t(), layer.weight_scale,
                                  x_scale.data)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], y.shape[-1])


def takes_per_token_fp8(layer: nn.Module) -> bool:
    """Whether `layer` (a linear) quantizes its input per token itself: `Fp8LinearMethod`
    with dynamic activations. Its producer may then hand it x_fp8 (`PerTokenFp8`)."""
    return (isinstance(getattr(layer, "quant_method", None), Fp8LinearMethod)
            and getattr(layer, "input_scale", None) is None)


def _make_weight(layer: nn.Module, rows: int, cols: int,
                 quant_config: QuantConfig | None) -> None:
    """Create `layer.weight` [rows, cols] (+ scales) and `layer.quant_method`."""
    if quant_config is None:
        layer.quant_method = UnquantizedLinearMethod()
        layer.weight = nn.Parameter(torch.empty(rows, cols), requires_grad=False)
    elif isinstance(quant_config, Fp8Config):
        layer.quant_method = Fp8LinearMethod(quant_config)
        layer.quant_method.create_weights(layer, rows, cols)
    else:
        layer.quant_method = BlockFP8LinearMethod(quant_config)
        layer.quant_method.create_weights(layer, rows, cols)


def _rows(param: nn.Parameter, loaded: torch.Tensor, n_rows: int) -> torch.Tensor:
    """For a block-scale parameter: the checkpoint's [ceil(n_rows/bn), kb] scale expanded to one
    row per weight row [n_rows, kb]; for a per-tensor scale (`Fp8LinearMethod`): the scalar
    repeated to [n_rows]; any other parameter: `loaded` unchanged.

    Raises:
        ValueError: the scale does not have ceil(n_rows/bn) rows, or a per-tensor scale is not
            a single value.
    """
    if getattr(param, "per_tensor_scale", False):
        if loaded.numel() != 1:
            raise ValueError(f"per-tensor FP8 scale of shape {tuple(loaded.shape)} (one value)")
        return loaded.float().reshape(1).expand(n_rows).clone()
    bn = getattr(param, "block_scale_rows", None)
    if bn is None:
        return loaded
    if loaded.dim() != 2 or loaded.shape[0] != -(-n_rows // bn):
        raise ValueError(f"weight_scale_inv of shape {tuple(loaded.shape)} for {n_rows} weight "
                         f"rows in blocks of {bn}")
    return loaded.float().repeat_interleave(bn, 0)[:n_rows]
