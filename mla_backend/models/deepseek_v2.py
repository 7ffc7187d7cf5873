"""DeepSeek-V2 / V2-Lite (`DeepseekV2ForCausalLM`) and DeepSeek-V3 (`DeepseekV3ForCausalLM`)
with Multi-head Latent Attention.

Owns the model math. Built by `model_executor.model_runner` via `models.registry`, filled by
`load_weights` (HF safetensors names); `post_load_weights()` splits `kv_b_proj` into `w_kc`/`w_vc`.
Forward takes a `ForwardBatch`, returns final-norm hidden states; `compute_logits` gives fp32.
Attention paths (REFERENCE §1.2), chosen per batch by `DeepseekV2Model.attention_path`:
- absorbed (decode; extend over a cached prefix or below the threshold): pool latent c_KV ‖ k_pe,
  MQA over the pool (1 KV head of kv_lora + rope dims, V = its first kv_lora columns);
- decompressed (extend, no cached prefix, >= `mla_decompress_min_tokens` new tokens): writes the
  latent pool, attends over the new tokens only (pool_free);
- mha (`ModelConfig.disable_mla`, every batch): per-head K/V pool.
Softmax scale in every path: qk_head_dim^-0.5 x mscale(factor, mscale_all_dim)^2, never
(kv_lora+rope)^-0.5. RoPE: interleaved pairs with DeepSeek YaRN (`layers.rotary_deepseek`).
The first query projection and kv_a_proj_with_mqa run as one GEMM (`w_input_proj`).
V3 differs only in routing (`MoERouting`, REFERENCE §1.6). FP8 weights and `w_kc`/`w_vc`
storage: docs/architecture.md ("models/ and layers/"), `post_load_weights`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch import nn

from mla_backend.distributed import divide, get_tp_size
from mla_backend.layers.layernorm import RMSNorm
from mla_backend.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from mla_backend.layers.logits import ParallelLMHead, VocabParallelEmbedding
from mla_backend.layers.moe import DeepseekV2MoE, GatedMLP, RouterGate, StackedExperts
from mla_backend.layers.quantization import (
    BlockFP8Config,
    Fp8Config,
    Fp8LinearMethod,
    PerTokenFp8,
    UnquantizedLinearMethod,
    fp8_per_tensor_bmm,
    fp8_per_token_mm,
    quant_config_from_hf,
    quantize_fp8_bmm_weight,
    takes_per_token_fp8,
    unquantized_linear,
)
from mla_backend.layers.radix_attention import RadixAttention, load_kv_scale
from mla_backend.layers.rotary_deepseek import (
    DeepseekRotaryEmbedding,
    deepseek_rope_config,
    softmax_scale,
)

if TYPE_CHECKING:
    from mla_backend.config import ModelConfig
    from mla_backend.forward_batch import ForwardBatch

ABSORBED, DECOMPRESSED, MHA = "absorbed", "decompressed", "mha"
# Token rows up to which absorbed MLA's w_kc / w_vc products run as `mla_kernels.bmm_gemv`
# (written straight into the query / o_proj input) instead of torch.bmm plus a copy: decode at
# batch size 1.
BMM_GEMV_MAX_ROWS = 1
# Token rows up to which absorbed MLA's products with FP8 w_kc / w_vc run as the FP8 batched
# matmul (`fp8_per_tensor_bmm`: an amax pass over x, then the triton `bmm_fp8`). Above it, on
# CUDA, they run as torch.bmm over the dequantized weights in the model dtype (`w_kc_dq`,
# `w_vc_dq`: 2 x 2 MB per V2-Lite layer), written straight into the query / o_proj input: at
# large batches the FP8 pair (amax pass plus GEMM) is slower than cuBLAS's bf16 bmm. At up to
# BMM_GEMV_MAX_ROWS rows on CUDA they run as `bmm_gemv` over the dequantized weights (one
# launch instead of the pair, for 1 MB more read per product). None: FP8 at every other row
# count.
FP8_BMM_MAX_ROWS: int | None = 64


@dataclass(frozen=True)
class MoERouting:
    """Routing of the MoE layers (see `layers.moe.ROUTING_METHODS`); filled by
    `DeepseekV2ForCausalLM.moe_routing` from the HF config, read by every MoE layer."""

    scoring_func: str  # "softmax" (V2) | "sigmoid" (V3)
    topk_method: str  # "greedy" | "group_limited_greedy" (V2) | "noaux_tc" (V3)
    n_group: int | None
    topk_group: int | None
    norm_topk_prob: bool
    routed_scaling_factor: float


class DeepseekV2Attention(nn.Module):
    """MLA for one layer. Parameters carry the HF names (`q_proj` or `q_a_proj`/`q_a_layernorm`/
    `q_b_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`).

    Buffers after `post_load_weights`: `w_kc` [H, qk_nope, kv_lora], `w_vc` [H, kv_lora, v_head]
    (model dtype, contiguous; `w_kc_scale`/`w_vc_scale` None) or, when kv_b_proj is per-tensor
    FP8 (`Fp8LinearMethod`), float8_e4m3fn with each head's matrix column-major and one float32
    0-dim scale each (`w_kc_scale`, `w_vc_scale`). `quant_config`: None or
    a `BlockFP8Config` applied to every projection (per module name, `for_module`).
    """

    def __init__(self, hf_config: Any, layer_id: int, disable_mla: bool,
                 quant_config: BlockFP8Config | None = None) -> None:
        super().__init__()
        c = hf_config

        def qc(name: str) -> BlockFP8Config | None:
            prefix = f"model.layers.{layer_id}.self_attn.{name}"
            return None if quant_config is None else quant_config.for_module(prefix)

        self.layer_id = layer_id
        # Heads of this tensor-parallel rank; the latent projections are replicated (REFERENCE
        # §1.8: one latent KV head cannot be split, every rank holds the whole latent pool).
        self.num_heads = divide(c.num_attention_heads, get_tp_size(), "num_attention_heads")
        self.q_lora_rank = c.q_lora_rank
        self.kv_lora_rank = c.kv_lora_rank
        self.qk_nope_head_dim = c.qk_nope_head_dim
        self.qk_rope_head_dim = c.qk_rope_head_dim
        self.v_head_dim = c.v_head_dim
        self.qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
        hidden, heads, all_heads = c.hidden_size, self.num_heads, c.num_attention_heads
        bias = bool(getattr(c, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, all_heads * self.qk_head_dim,
                                               quant_config=qc("q_proj"))
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias,
                                             quant_config=qc("q_a_proj"))
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=c.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, all_heads * self.qk_head_dim,
                                                 quant_config=qc("q_b_proj"))
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias,
            quant_config=qc("kv_a_proj_with_mqa"))
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=c.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, all_heads * (self.qk_nope_head_dim + self.v_head_dim),
            quant_config=qc("kv_b_proj"))
        self.o_proj = RowParallelLinear(all_heads * self.v_head_dim, hidden, bias=bias,
                                        quant_config=qc("o_proj"))

        theta, yarn = deepseek_rope_config(c)
        self.rotary_emb = DeepseekRotaryEmbedding(self.qk_rope_head_dim, theta, yarn)
        self.scaling = softmax_scale(self.qk_head_dim, yarn)
        # Decompressed per-head attention: pool-free prefill, or the MHA pool under disable_mla.
        self.attn_mha = RadixAttention(
            heads, self.qk_head_dim, self.scaling, num_kv_heads=heads, layer_id=layer_id,
            v_head_dim=self.v_head_dim, pool_free=not disable_mla)
        # Absorbed MQA over the latent pool: 1 KV head of kv_lora + rope, V = its first kv_lora.
        self.attn_mqa = None if disable_mla else RadixAttention(
            heads, self.kv_lora_rank + self.qk_rope_head_dim, self.scaling, num_kv_heads=1,
            layer_id=layer_id, v_head_dim=self.kv_lora_rank)
        self.register_buffer("w_kc", None, persistent=False)
        self.register_buffer("w_vc", None, persistent=False)
        self.register_buffer("w_kc_scale", None, persistent=False)
        self.register_buffer("w_vc_scale", None, persistent=False)
        # FP8 w_kc / w_vc dequantized to the model dtype ([H, nope, kv_lora], [H, kv_lora, v],
        # contiguous) for batches above FP8_BMM_MAX_ROWS; None without FP8 absorbed matrices.
        self.register_buffer("w_kc_dq", None, persistent=False)
        self.register_buffer("w_vc_dq", None, persistent=False)
        # [nq + kv_lora + rope, hidden]: the first query projection's and kv_a_proj_with_mqa's
        # weights as one matrix (their parameters are row views of it), or None.
        self.register_buffer("w_input_proj", None, persistent=False)
        # [1, nq + kv_lora + rope] float32 column scales when w_input_proj is FP8, else None.
        self.register_buffer("w_input_proj_scale", None, persistent=False)

    def post_load_weights(self) -> None:
        """Split kv_b_proj.weight [H*(nope+v), kv_lora] into w_kc and w_vc (once, after load).
        A block-FP8 kv_b_proj is dequantized (weight * weight_scale_inv per 128x128 block, as
        DeepSeek-V3's `inference/model.py` does for absorption). A per-tensor FP8 kv_b_proj
        (`Fp8LinearMethod`) gives FP8 w_kc/w_vc requantized per tensor from its dequantized
        weight (`quantize_fp8_bmm_weight`); otherwise they are cast to the model dtype."""
        dtype = self.kv_a_layernorm.weight.dtype
        self._fuse_input_projections()
        kv_b = self.kv_b_proj
        w = kv_b.quant_method.dequantized_weight(kv_b).view(
            self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        if isinstance(kv_b.quant_method, Fp8LinearMethod):
            w = w.float()
            self.w_kc, self.w_kc_scale = quantize_fp8_bmm_weight(w[:, : self.qk_nope_head_dim])
            self.w_vc, self.w_vc_scale = quantize_fp8_bmm_weight(
                w[:, self.qk_nope_head_dim:].transpose(1, 2))
            self.w_kc_dq = (self.w_kc.float() * self.w_kc_scale).to(dtype).contiguous()
            self.w_vc_dq = (self.w_vc.float() * self.w_vc_scale).to(dtype).contiguous()
            return
        w = w.to(dtype)
        self.w_kc = w[:, : self.qk_nope_head_dim].contiguous()  # [H, nope, kv_lora]
        self.w_vc = w[:, self.qk_nope_head_dim:].transpose(1, 2).contiguous()  # [H, kv_lora, v]

    def _fuse_input_projections(self) -> None:
        """Store the first query projection (q_proj, or q_a_proj with a q LoRA) and
        kv_a_proj_with_mqa, which both read the layer input, as one matrix `w_input_proj`
        [nq + kv_lora + rope, hidden] whose row blocks become the two parameters (views: no
        extra memory; in-place weight loads still reach it), so one GEMM or GEMV serves both.
        For unquantized weights of one dtype and device without biases, and for per-tensor FP8
        (`Fp8LinearMethod`) with dynamic activations: the FP8 rows are concatenated likewise and
        each part's `weight_scale_row` becomes a column view of `w_input_proj_scale` [1, N]
        (one per-token quantization of the input and one rowwise-scaled GEMM instead of two
        each). Otherwise (block FP8, static input scales, biases, mixed methods) the two stay
        separate. Invariant: after this, the parameters' storage is only written in place
        (`copy_`, the weight loaders); assigning a new `.data` or moving the module (`.to()`)
        would leave the forward reading the old `w_input_proj`."""
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        kv = self.kv_a_proj_with_mqa
        method = type(first.quant_method)
        fp8 = (method is Fp8LinearMethod and not hasattr(first, "input_scale")
               and not hasattr(kv, "input_scale"))
        if (method is not type(kv.quant_method)
                or not (method is UnquantizedLinearMethod or fp8)
                or first.bias is not None or kv.bias is not None
                or getattr(first, "gather_output", False)
                or first.weight.dtype != kv.weight.dtype
                or first.weight.device != kv.weight.device):
            return
        n = first.weight.shape[0]
        fused = torch.cat([first.weight.data, kv.weight.data], dim=0)
        first.weight.data = fused[:n]
        kv.weight.data = fused[n:]
        self.w_input_proj = fused
        if fp8:
            scale = torch.cat([first.weight_scale_row.data, kv.weight_scale_row.data], dim=1)
            first.weight_scale_row.data = scale[:, :n]
            kv.weight_scale_row.data = scale[:, n:]
            self.w_input_proj_scale = scale

    @property
    def takes_fp8_input(self) -> bool:
        """Whether forward uses a hidden_fp8: the projections that read the layer input
        quantize it per token (dynamic FP8, fused into `w_input_proj` or not)."""
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        return takes_per_token_fp8(first) or takes_per_token_fp8(self.kv_a_proj_with_mqa)

    def _input_projections(self, hidden: torch.Tensor, hidden_fp8: PerTokenFp8 | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] -> (q [T, H * qk_head], kv_a [T, kv_lora + rope]); one product
        over `w_input_proj` when the weights are fused (the results are column views).
        hidden_fp8: hidden quantized per token, for dynamic FP8 projections."""
        w = self.w_input_proj
        if w is None:
            first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
            first = first(hidden, hidden_fp8)
            kv_a = self.kv_a_proj_with_mqa(hidden, hidden_fp8)
        else:
            n_kv = self.kv_lora_rank + self.qk_rope_head_dim
            if self.w_input_proj_scale is None:
                both = unquantized_linear(hidden, w)
            else:
                both = fp8_per_token_mm(hidden, w.t(), self.w_input_proj_scale,
                                        x_fp8=hidden_fp8)
            first, kv_a = both.split([w.shape[0] - n_kv, n_kv], -1)
        if self.q_lora_rank is not None:
            first = self.q_b_proj(self.q_a_layernorm(first))
        return first, kv_a

    def _fused_prologue(self, hidden: torch.Tensor, forward_batch: "ForwardBatch",
                        rope_table: torch.Tensor | None) -> torch.Tensor | None:
        """The layer's latent pool buffer when absorbed decode may run the one-kernel prologue
        (`mla_kernels.mla_rope_store`: norm, rope and pool store): a decode batch on CUDA, not
        traced by torch.compile, a backend that takes it (`AttentionBackend.fused_mla_prologue`:
        triton, not the torch_native reference), the model's rope table at hand, a pool (and
        norm weight) in the activations' dtype or an FP8 pool (the kernel quantizes the row
        with the layer's k scale). Else None."""
        if (not hidden.is_cuda or rope_table is None or torch.compiler.is_compiling()
                or not forward_batch.attn_backend.fused_mla_prologue
                or not forward_batch.forward_mode.is_decode()
                or self.kv_a_layernorm.weight.dtype != hidden.dtype):
            return None
        pool = forward_batch.token_to_kv_pool
        k_buf = pool.get_kv_buffer(self.layer_id)[0]
        return k_buf if k_buf.dtype == hidden.dtype or pool.is_fp8 else None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                forward_batch: "ForwardBatch", path: str,
                rope_table: torch.Tensor | None = None,
                hidden_fp8: PerTokenFp8 | None = None) -> torch.Tensor:
        """positions [T] int64, hidden [T, hidden] -> [T, hidden]. `rope_table`: [T, rope dim]
        fp32, `rotary_emb.table(positions)` when the model has built it for all layers.
        `hidden_fp8`: hidden quantized per token (`takes_fp8_input`; `RMSNorm.forward_fp8`)."""
        t, heads = hidden.shape[0], self.num_heads
        q, kv_a = self._input_projections(hidden, hidden_fp8)
        q_nope, q_pe = q.view(t, heads, self.qk_head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = kv_a.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        if path == ABSORBED:
            # The absorbed query [T, H, kv_lora + rope] and latent row [T, 1, kv_lora + rope]
            # are assembled in place: the norm, the rotary and the w_kc product each write
            # their columns (no concatenation). In decode one kernel normalizes and rotates the
            # latent row straight into its pool slot and rotates the query's rope part.
            lora = self.kv_lora_rank
            q_full = hidden.new_empty(t, heads, lora + self.qk_rope_head_dim)
            k_buf = self._fused_prologue(hidden, forward_batch, rope_table)
            if k_buf is not None:
                from mla_kernels.mla_rope_store import mla_norm_rope_store

                mla_norm_rope_store(kv_a, self.kv_a_layernorm.weight,
                                    self.kv_a_layernorm.variance_epsilon, q_pe, rope_table,
                                    k_buf, forward_batch.out_cache_loc, q_full[..., lora:],
                                    k_scale=forward_batch.token_to_kv_pool.get_kv_scales(
                                        self.layer_id)[0])
                return self._absorbed(q_nope, q_full, None, forward_batch)
            k_full = hidden.new_empty(t, 1, lora + self.qk_rope_head_dim)
            self.kv_a_layernorm.norm_into(c_kv, k_full[:, 0, :lora])
            self.rotary_emb.forward_into(positions, q_pe, k_pe.unsqueeze(1), rope_table,
                                         q_full[..., lora:], k_full[..., lora:])
            return self._absorbed(q_nope, q_full, k_full, forward_batch)
        c_kv = self.kv_a_layernorm(c_kv)  # [T, kv_lora] (the norm reads the strided view)
        # q_pe [T, H, r] rotated in place (a column view of q), k_pe into [T, 1, r]
        k_rot = k_pe.new_empty(t, 1, self.qk_rope_head_dim)
        self.rotary_emb.forward_into(positions, q_pe, k_pe.unsqueeze(1), rope_table, q_pe, k_rot)
        k_pe = k_rot

        kv = self.kv_b_proj(c_kv).view(t, heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(t, heads, self.qk_rope_head_dim)], dim=-1)
        # q [T, H, qk_head] is q_nope ‖ q_pe already (the rotary wrote q_pe in place): no copy,
        # nor of v (a column view of kv); the attention backends take strided q / v views.
        q = q.view(t, heads, self.qk_head_dim)
        if path == DECOMPRESSED:
            # NOTE: the latent is still cached, so later decodes / prefix hits can absorb.
            latent = torch.cat([c_kv.unsqueeze(1), k_pe], dim=-1)  # [T, 1, kv_lora + rope]
            forward_batch.token_to_kv_pool.set_kv_buffer(
                self.layer_id, forward_batch.out_cache_loc, latent, None)
            o = self.attn_mha(q, k, v, forward_batch, save_kv_cache=False)
        else:  # MHA: K/V per head in the MHA pool
            o = self.attn_mha(q, k, v, forward_batch)
        return self.o_proj(o)

    def _absorbed(self, q_nope: torch.Tensor, q_full: torch.Tensor, k_full: torch.Tensor | None,
                  forward_batch: "ForwardBatch") -> torch.Tensor:
        """q_nope [T, H, nope] (a view of q); q_full [T, H, kv_lora + rope] with its rope
        columns filled; k_full [T, 1, kv_lora + rope] the new latent rows to store, or None when
        they are already in the pool."""
        t, heads, lora = q_nope.shape[0], self.num_heads, self.kv_lora_rank
        # [T, H, nope] x [H, nope, kv_lora] -> q_full[..., :kv_lora]
        self._absorb_into(q_nope, self.w_kc, self.w_kc_scale, q_full[..., :lora], self.w_kc_dq)
        v = None if k_full is None else k_full[..., :lora]  # [T, 1, kv_lora] (the value view)
        o = self.attn_mqa(q_full, k_full, v, forward_batch,  # [T, H * kv_lora]
                          save_kv_cache=k_full is not None)
        # [T, H, kv_lora] x [H, kv_lora, v_head] -> [T, H, v_head]
        o_v = o.new_empty(t, heads, self.v_head_dim)
        self._absorb_into(o.view(t, heads, lora), self.w_vc, self.w_vc_scale, o_v, self.w_vc_dq)
        return self.o_proj(o_v.view(t, heads * self.v_head_dim))

    def _absorb_into(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None,
                     out: torch.Tensor, w_dq: torch.Tensor | None = None) -> None:
        """out [T, H, N] <- x [T, H, K] x w [H, K, N]. FP8 w (w has a scale): up to
        `FP8_BMM_MAX_ROWS` token rows (any rows off CUDA, or without `w_dq`)
        `fp8_per_tensor_bmm` writing out (a strided view is fine) as [H, T, N]; above it, and
        at up to `BMM_GEMV_MAX_ROWS` rows, on CUDA the 16-bit product below over w_dq (w
        dequantized to the model dtype). 16-bit w: at up to `BMM_GEMV_MAX_ROWS` token rows of a
        CUDA model the triton `bmm_gemv` writes straight into out; else on CUDA torch.bmm
        writing out as [H, T, N], elsewhere (and while torch.compile traces) torch.bmm and a
        copy."""
        compiling = torch.compiler.is_compiling()
        if w_scale is not None:
            gemv_rows = x.shape[0] <= BMM_GEMV_MAX_ROWS  # bmm_gemv over w_dq, below
            if (w_dq is None or not x.is_cuda or compiling or not gemv_rows
                    and (FP8_BMM_MAX_ROWS is None or x.shape[0] <= FP8_BMM_MAX_ROWS)):
                fp8_per_tensor_bmm(x.transpose(0, 1), w, w_scale, out=out.transpose(0, 1))
                return
            w = w_dq
        if (x.is_cuda and x.shape[0] <= BMM_GEMV_MAX_ROWS
                and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16)
                and not compiling):
            from mla_kernels.bmm_gemv import bmm_gemv

            bmm_gemv(x, w, out=out, static_weight=True)  # w_kc / w_vc: fixed after load
            return
        if x.is_cuda and not compiling and x.dtype == w.dtype == out.dtype:
            torch.bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))  # cuBLAS, strided C
            return
        out.copy_(torch.bmm(x.transpose(0, 1), w).transpose(0, 1))


class DeepseekV2DecoderLayer(nn.Module):
    """MLA + (dense MLP for layers < first_k_dense_replace, else MoE routed by `routing`)."""

    def __init__(self, hf_config: Any, layer_id: int, disable_mla: bool,
                 routing: MoERouting, quant_config: BlockFP8Config | None = None) -> None:
        super().__init__()
        c = hf_config
        mlp_qc = (None if quant_config is None
                  else quant_config.for_module(f"model.layers.{layer_id}.mlp"))
        self.self_attn = DeepseekV2Attention(c, layer_id, disable_mla, quant_config)
        n_routed = getattr(c, "n_routed_experts", None)
        if (n_routed and layer_id >= c.first_k_dense_replace
                and layer_id % (getattr(c, "moe_layer_freq", 1) or 1) == 0):
            self.mlp: nn.Module = DeepseekV2MoE(
                c.hidden_size, c.moe_intermediate_size, n_routed, c.num_experts_per_tok,
                getattr(c, "n_shared_experts", 0) or 0, routing.topk_method,
                routing.n_group, routing.topk_group, routing.norm_topk_prob,
                routing.routed_scaling_factor, scoring_func=routing.scoring_func,
                quant_config=(None if quant_config is None else quant_config.for_module(
                    f"model.layers.{layer_id}.mlp.shared_experts")),
                experts_quant_config=(None if quant_config is None else quant_config.for_module(
                    f"model.layers.{layer_id}.mlp.experts")))
        else:
            self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, quant_config=mlp_qc)
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, forward_batch: "ForwardBatch",
                path: str, rope_table: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The norms also write their output quantized per token (`RMSNorm.prenorm`) when
        the linears after them quantize it so (dynamic FP8): one pass instead of a norm and a
        quantization launch per consumer (the MoE's shared and routed experts share it)."""
        hidden, residual, hidden_fp8 = self.input_layernorm.prenorm(
            hidden, residual, self.self_attn.takes_fp8_input)
        hidden = self.self_attn(positions, hidden, forward_batch, path, rope_table, hidden_fp8)
        hidden, residual, hidden_fp8 = self.post_attention_layernorm.prenorm(
            hidden, residual, self.mlp.takes_fp8_input)
        return self.mlp(hidden, hidden_fp8), residual


class DeepseekV2Model(nn.Module):
    def __init__(self, hf_config: Any, model_config: "ModelConfig | None",
                 routing: MoERouting, quant_config: BlockFP8Config | None = None) -> None:
        super().__init__()
        self.disable_mla = bool(model_config.disable_mla) if model_config is not None else False
        self.decompress_min_tokens = (model_config.mla_decompress_min_tokens
                                      if model_config is not None else 64)
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList([
            DeepseekV2DecoderLayer(hf_config, i, self.disable_mla, routing, quant_config)
            for i in range(hf_config.num_hidden_layers)])
        self.norm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)

    def attention_path(self, forward_batch: "ForwardBatch") -> str:
        """`mha` under disable_mla; `decompressed` for a prefix-free extend of at least
        `mla_decompress_min_tokens` new tokens; else `absorbed`."""
        if self.disable_mla:
            return MHA
        fb = forward_batch
        if (fb.forward_mode.is_extend() and not fb.forward_mode.is_decode()
                and all(p == 0 for p in fb.extend_prefix_lens_cpu)
                and sum(fb.extend_seq_lens_cpu) >= self.decompress_min_tokens):
            return DECOMPRESSED
        return ABSORBED

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: "ForwardBatch") -> torch.Tensor:
        path = self.attention_path(forward_batch)
        hidden, residual = self.embed_tokens(input_ids), None
        # One cos/sin table for every layer (all rotate the same positions alike).
        rope_table = self.layers[0].self_attn.rotary_emb.table(positions) if self.layers else None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch, path,
                                     rope_table)
        hidden, _ = self.norm(hidden, residual)
        return hidden


_EXPERT_RE = re.compile(
    r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")
_EXPERT_FP8_RE = re.compile(
    r"^(.*\.mlp\.experts\.\d+\.(?:gate_proj|up_proj|down_proj)\.weight)(_scale_inv)?$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV2ForCausalLM(nn.Module):
    """DeepSeek-V2 causal LM (the model interface of docs/architecture.md).

    Args:
        hf_config: transformers `DeepseekV2Config` (or any object with its fields).
        model_config: engine `ModelConfig` (`disable_mla`, `mla_decompress_min_tokens`); None
            uses the defaults (MLA on, threshold 64).
    The config's `quantization_config`, when present, must be FP8, block-wise or per-tensor, and
    `model_config.quantization` may ask for online per-tensor FP8 (`quant_config_from_hf`, whose
    errors it raises); the result becomes `self.quant_config`.
    """

    def __init__(self, hf_config: Any, model_config: "ModelConfig | None" = None) -> None:
        super().__init__()
        self.config = hf_config
        self.quant_config = quant_config_from_hf(
            getattr(hf_config, "quantization_config", None),
            getattr(model_config, "quantization", "") or "")
        self.model = DeepseekV2Model(hf_config, model_config, self.moe_routing(hf_config),
                                     self.quant_config)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size,
                                      self.model.embed_tokens if self.tie_word_embeddings
                                      else None)

    @classmethod
    def moe_routing(cls, hf_config: Any) -> MoERouting:
        """V2 routing from the config (transformers' DeepseekV2Config fields): softmax scores,
        `topk_method` greedy (default) or group_limited_greedy.

        Raises:
            ValueError: a `scoring_func` other than softmax.
        """
        c = hf_config
        scoring = getattr(c, "scoring_func", None) or "softmax"
        if scoring != "softmax":
            raise ValueError(f"unsupported scoring_func {scoring!r} for {cls.__name__} "
                             "(softmax only; sigmoid/noaux_tc is DeepseekV3ForCausalLM)")
        return MoERouting(scoring, getattr(c, "topk_method", None) or "greedy",
                          getattr(c, "n_group", None), getattr(c, "topk_group", None),
                          bool(getattr(c, "norm_topk_prob", False)),
                          float(getattr(c, "routed_scaling_factor", 1.0) or 1.0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: "ForwardBatch") -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden [T, hidden] after the final norm."""
        return self.model(input_ids, positions, forward_batch)

    def compute_logits(self, hidden: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] fp32, or written into out [n, vocab] (the
        CUDA graphs' static buffer, of the model dtype: `ParallelLMHead.forward`)."""
        return self.lm_head(hidden, out)

    def kv_pool_layout(self) -> dict:
        """The KV pool this model needs: MLA latent pool, or MHA per-head pool (disable_mla)."""
        c = self.config
        if self.model.disable_mla:
            return {"kind": "mha", "num_layers": c.num_hidden_layers,
                    "num_kv_heads": self.model.layers[0].self_attn.num_heads,  # this rank's
                    "head_dim": c.qk_nope_head_dim + c.qk_rope_head_dim,
                    "v_head_dim": c.v_head_dim}
        return {"kind": "mla", "num_layers": c.num_hidden_layers,
                "kv_lora_rank": c.kv_lora_rank, "qk_rope_head_dim": c.qk_rope_head_dim}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters.

        Accepts the original per-expert names (`mlp.experts.{e}.gate_proj.weight`) and the
        transformers-5 stacked ones (`mlp.experts.gate_up_proj` [E, 2I, H],
        `mlp.experts.down_proj` [E, H, I]), and V3's `mlp.gate.e_score_correction_bias`.
        Skips rotary buffers and layers beyond num_hidden_layers (V3's MTP layer). FP8 KV-cache
        scales (`self_attn.k_scale` / `kv_scale`, see `load_kv_scale`) go to
        `self.kv_cache_scales` {layer: {"k": s, "v": s}} (the latent pool uses "k").

        Block-FP8 checkpoints: `X.weight` (float8_e4m3fn) + `X.weight_scale_inv` go to the FP8
        linears and block-FP8 routed experts (`StackedExperts.is_block_fp8`; each expert's
        scale through `StackedExperts.weight_loader`) as they are; routed-expert pairs of
        experts that fell back to the model dtype are dequantized here
        (`_dequantize_experts`). Per-tensor FP8 checkpoints: routed-expert weights are
        dequantized here (`_dequantize_experts_per_tensor`), requantized after load.
        Raises:
            KeyError: an unknown weight name (e.g. a `weight_scale_inv` for a layer that is not
                quantized). ValueError: a shape mismatch, an FP8 tensor for an unquantized
                parameter, an expert weight without its scale (or the reverse), or parameters
                that no weight filled.
        """
        params = dict(self.named_parameters())
        if isinstance(self.quant_config, BlockFP8Config):
            keep = {n for n, m in self.named_modules()
                    if isinstance(m, StackedExperts) and m.is_block_fp8}
            weights = _dequantize_experts(weights, self.quant_config.weight_block_size, keep)
        elif isinstance(self.quant_config, Fp8Config) and self.quant_config.is_checkpoint_fp8:
            weights = _dequantize_experts_per_tensor(weights)
        expected = self._expected_load_units(params)
        loaded: set[str] = set()
        n_layers = self.config.num_hidden_layers
        self.kv_cache_scales: dict[int, dict[str, float]] = {}
        for name, w in weights:
            if "rotary_emb." in name:
                continue
            m = _LAYER_RE.match(name)
            if m and int(m.group(1)) >= n_layers:
                # DeepSeek-V3 checkpoints carry `num_nextn_predict_layers` (1) Multi-Token
                # Prediction modules as `model.layers.{num_hidden_layers}.*` (enorm, hnorm,
                # eh_proj, shared_head, a full decoder layer). They predict the token after next
                # for training and speculative decoding; the next-token logits never read them,
                # and we do not run speculative decoding, so they are not loaded (transformers
                # ignores them too: `_keys_to_ignore_on_load_unexpected`).
                continue
            if load_kv_scale(self.kv_cache_scales, name, w):
                continue
            m = _EXPERT_RE.match(name)
            if m:
                prefix, e, shard = m.group(1), int(m.group(2)), m.group(3)[: -len("_proj")]
                pname = f"{prefix}.{'w2_weight' if shard == 'down' else 'w13_weight'}"
                suffix = m.group(4) or ""  # "_scale_inv": a block-FP8 expert's scale
                if pname + suffix not in params:
                    hint = (" (a block-FP8 scale: is the config's quantization_config missing?)"
                            if self.quant_config is None else "")
                    raise KeyError(f"unexpected weight {name!r} for {type(self).__name__}{hint}")
                _check_fp8(name, params[pname], w)
                self.get_submodule(prefix).weight_loader(params[pname + suffix], w, e, shard)
                loaded.add(f"{pname}{suffix}:{e}:{shard}")
                if not suffix and pname + "_scale_inv" in params and \
                        w.dtype != torch.float8_e4m3fn:  # quantized by the loader, scale too
                    loaded.add(f"{pname}_scale_inv:{e}:{shard}")
                continue
            if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
                stacked = name.endswith("gate_up_proj")
                prefix = name[: name.rindex(".")]
                pname = prefix + (".w13_weight" if stacked else ".w2_weight")
                _check_fp8(name, params[pname], w)
                experts = self.get_submodule(prefix)
                if experts.is_block_fp8 and w.dtype != torch.float8_e4m3fn:
                    loaded |= {u for u in expected if u.startswith(pname + "_scale_inv:")}
                full_i = experts.full_intermediate_size
                for e in range(w.shape[0]):  # through the per-expert loader (TP slicing)
                    if stacked:
                        experts.weight_loader(params[pname], w[e, :full_i], e, "gate")
                        experts.weight_loader(params[pname], w[e, full_i:], e, "up")
                    else:
                        experts.weight_loader(params[pname], w[e], e, "down")
                loaded |= {u for u in expected if u.startswith(pname + ":")}
                continue
            m = re.match(
                r"^(.*)\.(gate_proj|up_proj)\.(weight|weight_scale_inv|weight_scale|input_scale)$",
                name)
            if m:
                pname = f"{m.group(1)}.gate_up_proj.{m.group(3)}"
                shard = m.group(2)[: -len("_proj")]
                if pname not in params:
                    raise KeyError(f"unexpected weight {name!r} for {type(self).__name__}")
                _check_fp8(name, params[pname], w)
                self.get_submodule(f"{m.group(1)}.gate_up_proj").weight_loader(
                    params[pname], w, shard)
                loaded.add(f"{pname}:{shard}")
                continue
            if name not in params:
                if name == "lm_head.weight" and self.tie_word_embeddings:
                    continue
                hint = (" (a block-FP8 scale: is the config's quantization_config missing?)"
                        if name.endswith(("_scale_inv", "weight_scale", "input_scale"))
                        and self.quant_config is None else "")
                raise KeyError(f"unexpected weight {name!r} for {type(self).__name__}{hint}")
            _check_fp8(name, params[name], w)
            owner = self.get_submodule(name.rsplit(".", 1)[0])
            loader = getattr(owner, "weight_loader", None)
            if loader is not None:  # tensor-parallel layers take the full tensor and slice it
                loader(params[name], w.to(params[name].dtype))
            else:
                _copy(params[name], w)
            loaded.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}")

    def _expected_load_units(self, params: dict[str, torch.Tensor]) -> set[str]:
        """Every piece a checkpoint must fill: whole params, merged-linear shards
        (`name:shard`) and stacked-expert slices (`name:expert:shard`)."""
        units: set[str] = set()
        covered: set[str] = set()
        for mname, mod in self.named_modules():
            if isinstance(mod, StackedExperts):
                for pname, _ in mod.named_parameters():  # weights and block scales
                    full = f"{mname}.{pname}"
                    shards = ("down",) if pname.startswith("w2_") else ("gate", "up")
                    units |= {f"{full}:{e}:{s}" for e in range(mod.num_experts) for s in shards}
                    covered.add(full)
            elif hasattr(mod, "shard_offsets"):  # merged (column-parallel) linear layers
                names = ["weight"] + [p for p in ("weight_scale_inv", "weight_scale",
                                                  "input_scale") if hasattr(mod, p)]
                for p in names:
                    units |= {f"{mname}.{p}:{s}" for s in mod.shard_offsets}
                    covered.add(f"{mname}.{p}")
        return units | (set(params) - covered)

    def post_load_weights(self) -> None:
        """Finish quantized linears (compact their scales), then precompute the absorbed MLA
        matrices of every layer, and the routers' 16-bit weights (`RouterGate.prepare_16bit`)."""
        dtype = self.model.embed_tokens.weight.dtype
        for mod in self.modules():
            method = getattr(mod, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(mod)
            if isinstance(mod, RouterGate):
                mod.prepare_16bit(dtype)
        for layer in self.model.layers:
            layer.self_attn.post_load_weights()


def _check_fp8(name: str, param: torch.Tensor, w: torch.Tensor) -> None:
    """An FP8 checkpoint tensor may only fill an FP8 parameter (a cast would drop its scale)."""
    if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and param.dtype != w.dtype:
        raise ValueError(f"{name!r} is {w.dtype} but the model's parameter is {param.dtype}: "
                         "is the config's quantization_config missing?")


def _dequantize_experts(weights: Iterable[tuple[str, torch.Tensor]],
                        block_size: tuple[int, int],
                        keep: frozenset[str] | set[str] = frozenset()
                        ) -> Iterable[tuple[str, torch.Tensor]]:
    """Pass weights through, except routed-expert FP8 pairs of experts modules not in `keep`
    (the `StackedExperts` names that hold block FP8 themselves, see `StackedExperts.
    is_block_fp8`): `mlp.experts.{e}.{proj}.weight` (float8_e4m3fn [N, K]) and its
    `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] are held until both arrived, then yielded once
    as `...weight` = dequantized float32 [N, K] (DeepSeek-V3 `inference/fp8_cast_bf16.py`
    math). Expert weights that are not FP8 pass through.

    Raises:
        ValueError: an FP8 expert weight without its scale, or a scale without its weight.
    """
    from mla_kernels.block_fp8_gemm import dequant_weight_block_fp8

    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, w in weights:
        m = _EXPERT_FP8_RE.match(name)
        if m is None or (m.group(2) is None and w.dtype != torch.float8_e4m3fn) or \
                m.group(1).rsplit(".", 3)[0] in keep:
            yield name, w
            continue
        base = m.group(1)
        entry = pending.setdefault(base, {})
        entry["scale" if m.group(2) else "weight"] = w
        if len(entry) == 2:
            del pending[base]
            yield base, dequant_weight_block_fp8(entry["weight"], entry["scale"], block_size)
    if pending:
        base, entry = next(iter(pending.items()))
        missing = "weight_scale_inv" if "weight" in entry else "weight"
        raise ValueError(f"{len(pending)} routed-expert FP8 weights incomplete, e.g. "
                         f"{base!r} has no {missing}")


_EXPERT_PT_RE = re.compile(
    r"^(.*\.mlp\.experts\.\d+\.(?:gate_proj|up_proj|down_proj))\."
    r"(weight|weight_scale|input_scale)$")


def _dequantize_experts_per_tensor(weights: Iterable[tuple[str, torch.Tensor]]
                                   ) -> Iterable[tuple[str, torch.Tensor]]:
    """Per-tensor FP8 checkpoints: routed-expert `X.weight` (float8_e4m3fn [N, K]) and
    `X.weight_scale` (one float32) are held until both arrived, then yielded once as `X.weight` =
    weight * weight_scale, float32 [N, K]; `X.input_scale` is dropped (the experts run
    unquantized). Everything else passes through.

    Raises:
        ValueError: an FP8 expert weight without its scale, or a scale without its weight.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, w in weights:
        m = _EXPERT_PT_RE.match(name)
        if m is None or (m.group(2) == "weight" and w.dtype != torch.float8_e4m3fn):
            yield name, w
            continue
        if m.group(2) == "input_scale":
            continue
        entry = pending.setdefault(m.group(1), {})
        entry[m.group(2)] = w
        if len(entry) == 2:
            del pending[m.group(1)]
            yield f"{m.group(1)}.weight", entry["weight"].float() * entry["weight_scale"].float()
    if pending:
        base, entry = next(iter(pending.items()))
        missing = "weight_scale" if "weight" in entry else "weight"
        raise ValueError(f"{len(pending)} routed-expert FP8 weights incomplete, e.g. "
                         f"{base!r} has no {missing}")


def _copy(param: torch.Tensor, w: torch.Tensor) -> None:
    if param.shape != w.shape:
        raise ValueError(f"shape mismatch: param {tuple(param.shape)} vs weight {tuple(w.shape)}")
    param.data.copy_(w)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 causal LM, bf16 / fp32 weights: the V2 model with V3 routing.

    Differences from V2 (transformers `modeling_deepseek_v3.py`; DeepSeek-V3 report §2.1.2):
    MoE routing `noaux_tc` with sigmoid scores and the per-expert `e_score_correction_bias`
    (`layers.moe.select_experts_noaux_tc`; router weight and bias kept in fp32),
    `norm_topk_prob` (true in V3) and `routed_scaling_factor` (2.5) from the config. The rest
    (MLA with q_lora_rank, DeepSeek YaRN, first_k_dense_replace dense layers, shared experts) is
    V2's code. The MTP layer of the checkpoint is skipped (see `load_weights`).

    Weights: bf16 / fp32, or the published block-wise FP8 format (`quantization_config`
    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
    "weight_block_size": [128, 128]}; see the module docstring for what stays unquantized and
    how routed experts are kept in FP8).

    Args: as `DeepseekV2ForCausalLM`.
    Raises:
        ValueError: a config V3 cannot mean (another scoring_func / topk_method,
            `rope_interleave` false, `moe_layer_freq` != 1).
        NotImplementedError: a quantization other than block-wise FP8 (see
            `BlockFP8Config.from_hf`).
    """

    def __init__(self, hf_config: Any, model_config: "ModelConfig | None" = None) -> None:
        if getattr(hf_config, "rope_interleave", True) is False:
            # transformers then rotates halves (NeoX) instead of interleaved pairs.
            raise ValueError("rope_interleave=false is not supported (DeepSeek rope rotates "
                             "interleaved pairs)")
        if (getattr(hf_config, "moe_layer_freq", 1) or 1) != 1:
            # transformers' V3 makes every layer >= first_k_dense_replace an MoE layer.
            raise ValueError(f"moe_layer_freq {hf_config.moe_layer_freq} is not supported for "
                             "DeepSeek-V3 (1: every layer from first_k_dense_replace on is MoE)")
        super().__init__(hf_config, model_config)

    @classmethod
    def moe_routing(cls, hf_config: Any) -> MoERouting:
        """V3 routing: sigmoid + `noaux_tc` always (transformers' DeepseekV3 reads neither
        `scoring_func` nor `topk_method`; the published config.json says these two), with
        `n_group`, `topk_group`, `norm_topk_prob`, `routed_scaling_factor` from the config
        (DeepseekV3Config defaults 8, 4, true, 2.5 where absent).

        Raises:
            ValueError: the config names another scoring_func or topk_method.
        """
        c = hf_config
        scoring = getattr(c, "scoring_func", None) or "sigmoid"
        method = getattr(c, "topk_method", None) or "noaux_tc"
        if (scoring, method) != ("sigmoid", "noaux_tc"):
            raise ValueError(f"DeepseekV3ForCausalLM routes with scoring_func 'sigmoid' and "
                             f"topk_method 'noaux_tc'; the config says {scoring!r}, {method!r}")

        def field(name: str, default: Any) -> Any:
            value = getattr(c, name, None)
            return default if value is None else value

        return MoERouting(scoring, method, int(field("n_group", 8)), int(field("topk_group", 4)),
                          bool(field("norm_topk_prob", True)),
                          float(field("routed_scaling_factor", 2.5)))


EntryClass = DeepseekV2ForCausalLM

__all__ = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "EntryClass", "MoERouting"]
