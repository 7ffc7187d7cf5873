"""DeepSeek mixture of experts: router, routed experts, shared experts; and the dense gated MLP.

Owns the expert weights (`w13_weight` [E, 2I, H] = gate ‖ up, `w2_weight` [E, H, I], loaded from
HF per-expert names) and the routing math (REFERENCE §1.6); input/output are hidden states.

| scoring_func | topk_method          | experts chosen by                          | model   |
|--------------|----------------------|--------------------------------------------|---------|
| softmax      | greedy               | top-k of the softmax                       | V2-Lite |
| softmax      | group_limited_greedy | groups by best member, then top-k          | V2      |
| sigmoid      | noaux_tc             | sigmoid + e_score_correction_bias; groups  | V3      |
|              |                      | by the sum of their top-2; then top-k      |         |

Weights: the chosen experts' scores (noaux_tc: sigmoid WITHOUT the bias), optionally renormalized
(`norm_topk_prob`), times `routed_scaling_factor`; shared experts (a `GatedMLP`) always run.
Routed experts, same math two ways: on CUDA (or `fused_moe=True`) the triton grouped GEMM
`mla_kernels.fused_moe.fused_experts` (no host sync, CUDA-graph safe; adds the shared output),
else `experts_forward`, a loop over the used experts. Storage (`StackedExperts.quant_method`):
`UnquantizedMoEMethod`, `BlockFP8MoEMethod` (checkpoint 128x128 blocks; a TP slice that is not
whole blocks falls back to the model dtype, `fp8_fallback_reason`) or `Fp8MoEMethod` (per tensor).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mla_backend.distributed import divide, get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from mla_backend.layers.activation import SiluAndMul, gated_mlp
from mla_backend.layers.linear import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from mla_backend.layers.quantization import (
    FP8_E4M3,
    BlockFP8Config,
    Fp8Config,
    Fp8LinearMethod,
    PerTokenFp8,
    QuantConfig,
    UnquantizedLinearMethod,
    quantize_fp8_per_tensor,
    takes_per_token_fp8,
)

logger = logging.getLogger(__name__)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); HF names gate_proj/up_proj are merged into `gate_up_proj`
    (shards "gate", "up"), `down_proj` as in HF. Tensor parallel: the intermediate dim is split
    across ranks; `reduce_results=False` leaves the all-reduce to the caller (the MoE sums the
    shared and routed parts first, then reduces once).

    `quant_config` (None or a `BlockFP8Config`) applies to both linears (DeepSeek-V3's
    block-FP8 dense MLPs and shared experts).

    Args of forward: x [T, hidden]; x_fp8: optional x quantized per token
    (`quantization.PerTokenFp8`, for dynamic FP8 weights). Returns [T, hidden].
    """

    def __init__(self, hidden_size: int, intermediate_size: int,
                 reduce_results: bool = True,
                 quant_config: BlockFP8Config | None = None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       shard_names=("gate", "up"),
                                                       quant_config=quant_config)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size,
                                           reduce_results=reduce_results,
                                           quant_config=quant_config)
        self.act_fn = SiluAndMul()

    @property
    def takes_fp8_input(self) -> bool:
        """Whether forward uses an x_fp8 (its gate/up linear quantizes x per token)."""
        return takes_per_token_fp8(self.gate_up_proj)

    def forward(self, x: torch.Tensor, x_fp8: PerTokenFp8 | None = None) -> torch.Tensor:
        return gated_mlp(x, x_fp8, self.gate_up_proj, self.act_fn, self.down_proj)


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    topk_method: str = "greedy",
    n_group: int | None = None,
    topk_group: int | None = None,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 routing.

    Args:
        router_logits: [T, E] (any float dtype; math in fp32).
        top_k: experts per token.
        topk_method: "greedy" (top-k of the softmax) or "group_limited_greedy" (experts split into
            `n_group` contiguous groups scored by their best expert; only the best `topk_group`
            groups compete).
        norm_topk_prob: renormalize the chosen weights to sum 1 (when top_k > 1).
        routed_scaling_factor: multiplies the chosen weights (after renormalization).
    Returns:
        (weights [T, top_k] fp32, ids [T, top_k] int64).
    Raises:
        ValueError: unknown topk_method, or E not divisible by n_group.

    "greedy" on CUDA (not while torch.compile traces) runs as one triton kernel,
    `mla_kernels.moe_routing.softmax_topk` (same math; ids in descending score order, where
    torch's unsorted top-k leaves them in any order).
    """
    if (topk_method == "greedy" and router_logits.is_cuda
            and not torch.compiler.is_compiling()):
        from mla_kernels.moe_routing import softmax_topk

        return softmax_topk(router_logits, top_k, norm_topk_prob, routed_scaling_factor)
    scores = router_logits.float().softmax(dim=-1)
    num_tokens, num_experts = scores.shape
    if topk_method == "greedy":
        weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    elif topk_method == "group_limited_greedy":
        if not n_group or num_experts % n_group:
            raise ValueError(f"n_group {n_group} must divide the {num_experts} experts")
        per_group = num_experts // n_group
        group_scores = scores.view(num_tokens, n_group, per_group).max(dim=-1).values  # [T, G]
        group_idx = torch.topk(group_scores, k=topk_group or 1, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        score_mask = group_mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, -1)
        masked = scores.masked_fill(score_mask == 0, 0.0)
        weights, ids = torch.topk(masked, k=top_k, dim=-1, sorted=False)
    else:
        raise ValueError(f"unsupported topk_method {topk_method!r} for softmax scoring "
                         "(greedy and group_limited_greedy; noaux_tc is select_experts_noaux_tc)")
    if norm_topk_prob and top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def select_experts_noaux_tc(
    router_logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: sigmoid scores, auxiliary-loss-free bias, group-limited top-k.

    Source: transformers `modeling_deepseek_v3.DeepseekV3TopkRouter.forward` (the oracle of the
    tests); DeepSeek-V3 technical report (arXiv 2412.19437) §2.1.2, eqs. 13-16 and §2.3.2
    node-limited routing (a group is a node; a group scores the sum of its best K_r / M = 2).

        s = sigmoid(logits)                        # affinities
        c = s + e_score_correction_bias            # used only to CHOOSE experts
        group score = sum of the top-2 c in each of n_group contiguous groups
        keep the topk_group best groups; ids = top-k of c inside them (others -inf)
        weights = s[ids] (no bias); / sum (norm_topk_prob); * routed_scaling_factor

    Args:
        router_logits: [T, E] (any float dtype; math in fp32).
        e_score_correction_bias: [E] (fp32 in the checkpoint; read as fp32).
        top_k: experts per token.
        n_group, topk_group: E is split into `n_group` contiguous groups of E / n_group (>= 2)
            experts; the best `topk_group` groups compete.
        norm_topk_prob: divide the chosen weights by their sum (+1e-20), for any top_k (as HF).
        routed_scaling_factor: multiplies the weights after normalization (2.5 in V3).
    Returns:
        (weights [T, top_k] fp32, ids [T, top_k] int64), in no particular order within a row.
    Raises:
        ValueError: n_group does not divide E into groups of at least 2, or the kept groups hold
            fewer than top_k experts.
    """
    scores = router_logits.float().sigmoid()  # [T, E]
    num_tokens, num_experts = scores.shape
    if not n_group or num_experts % n_group or num_experts // n_group < 2:
        raise ValueError(f"n_group {n_group} must divide the {num_experts} experts into groups "
                         "of at least 2 (a group scores the sum of its top-2)")
    per_group = num_experts // n_group
    topk_group = topk_group or n_group
    if topk_group * per_group < top_k:
        raise ValueError(f"top_k {top_k} exceeds the {topk_group * per_group} experts of "
                         f"{topk_group} groups")
    choice = scores + e_score_correction_bias.float()  # [T, E]
    group_scores = choice.view(num_tokens, n_group, per_group).topk(2, dim=-1).values.sum(-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False).indices  # [T, g]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    score_mask = group_mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, -1)
    # NOTE: -inf, not 0: biased scores may be negative, and a 0 would let an expert of a dropped
    # group win over them.
    choice = choice.masked_fill(~score_mask, float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False).indices  # [T, k]
    weights = scores.gather(1, ids)  # un-biased affinities of the chosen experts
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def experts_forward(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
    activation_quant: bool = True,
) -> torch.Tensor:
    """sum_k w[t, k] * expert_{ids[t, k]}(x[t]) with SiLU-gated experts.

    FP8 weights (w13, w2 float8_e4m3fn with scales, as `mla_kernels.fused_moe.fused_experts`
    takes them): the same math as the fused kernels, in torch: each used expert's weights are
    dequantized on the fly (float32), each GEMM's activations quantized dynamically
    (`quantize_activations_fp8`: x, then the [T*k, I] intermediate rounded to x's dtype; per
    row, or per row per bk columns with block scales) unless `activation_quant` is off.
    Args:
        x: [T, H]. w13: [E, 2I, H] (gate rows then up rows). w2: [E, H, I].
        topk_weights: [T, k] fp32. topk_ids: [T, k] int64.
        w13_scale, w2_scale, block_shape, activation_quant: FP8 only (see `fused_experts`).
    Returns:
        [T, H], dtype of x.
    """
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    inter = w2.shape[2]
    flat_ids = topk_ids.reshape(-1)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    if w13_scale is None:
        for e, n in enumerate(counts):
            if n == 0:
                continue
            token_idx, slot = torch.where(topk_ids == e)
            h = F.linear(x[token_idx], w13[e])  # [n, 2I]
            h = F.silu(h[:, :inter]) * h[:, inter:]
            h = F.linear(h, w2[e]) * topk_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out
    from mla_kernels.fused_moe import quantize_activations_fp8

    group = None if block_shape is None else block_shape[1]

    def act(a: torch.Tensor) -> torch.Tensor:  # quantized-dequantized activations, float32
        if not activation_quant:
            return a.float()
        q, sc = quantize_activations_fp8(a, group)
        if group is None:
            return q.float() * sc
        return q.float() * sc.repeat_interleave(group, 1)[:, : a.shape[1]]

    top_k = topk_ids.shape[1]
    xq = act(x)
    h_act = torch.zeros(x.shape[0] * top_k, inter, dtype=x.dtype, device=x.device)  # [T*k, I]
    used = [e for e, n in enumerate(counts) if n]
    for e in used:  # GEMM1 for every expert, then the intermediate quantized per row
        token_idx, slot = torch.where(topk_ids == e)
        h = F.linear(xq[token_idx], dequantize_expert(w13, w13_scale, e, block_shape, True))
        h_act[token_idx * top_k + slot] = (F.silu(h[:, :inter]) * h[:, inter:]).to(x.dtype)
    hq = act(h_act)
    for e in used:
        token_idx, slot = torch.where(topk_ids == e)
        y = F.linear(hq[token_idx * top_k + slot],
                     dequantize_expert(w2, w2_scale, e, block_shape, False))
        out.index_add_(0, token_idx, (y * topk_weights[token_idx, slot, None]).to(out.dtype))
    return out


def dequantize_expert(w: torch.Tensor, scale: torch.Tensor, e: int,
                      block_shape: tuple[int, int] | None, gate_up: bool) -> torch.Tensor:
    """Expert e of FP8 stacked weights -> float32 [N, K] = w[e] * scale: per tensor
    (scale [E]) or per (bn, bk) block (scale [E, nb, kb]; with gate_up the gate and up halves
    of w13 are blocked separately, scale rows gate's then up's)."""
    if block_shape is None:
        return w[e].float() * scale[e].float()
    from mla_kernels.block_fp8_gemm import dequant_weight_block_fp8

    if not gate_up:
        return dequant_weight_block_fp8(w[e], scale[e], block_shape)
    half = w.shape[1] // 2
    nb = -(-half // block_shape[0])
    return torch.cat([dequant_weight_block_fp8(w[e, :half], scale[e, :nb], block_shape),
                      dequant_weight_block_fp8(w[e, half:], scale[e, nb:], block_shape)])


class RouterGate(ReplicatedLinear):
    """MoE router: a replicated linear hidden -> E whose weight is kept in fp32 whatever the
    model dtype, so the logits come out in fp32 (DeepSeek's `MoEGate` computes
    `F.linear(x.float(), weight.float())`; a bf16 checkpoint's values are exact in fp32, and no
    cast runs per layer and step). `UnquantizedLinearMethod` takes the 16-bit x as it is.

    Parameters: `weight` [E, H] fp32 (`mlp.gate.weight`), filled through `weight_loader`.
    Forward: x [T, H] -> logits [T, E] fp32.

    After load, `prepare_16bit(dtype)` keeps `weight_16`, the weight in the model's 16-bit
    dtype, when that holds every value exactly (a bf16 checkpoint). A CUDA x of that dtype with
    more than one row (outside torch.compile) then runs as one cuBLAS 16-bit GEMM with fp32
    output (`torch.mm(..., out_dtype=torch.float32)`): the products of two bf16 values are
    exact in fp32 and are summed in fp32, as `F.linear(x.float(), weight)` does, but without
    the cast of x and the slow fp32 SIMT GEMM. The sums may differ from the fp32 GEMM's in the
    last bits (another summation order).
    """

    def __init__(self, in_features: int, num_experts: int) -> None:
        super().__init__(in_features, num_experts)
        self.weight = nn.Parameter(torch.empty(num_experts, in_features, dtype=torch.float32),
                                   requires_grad=False)
        self.weight_16: torch.Tensor | None = None

    def prepare_16bit(self, dtype: torch.dtype) -> None:
        """Set `weight_16` = the weight in `dtype` (float16 / bfloat16) when the cast is exact
        for every value, else None (then every call takes the fp32 weight). Reads the weight
        once (a host sync): call after load, never inside a CUDA graph capture."""
        w = self.weight.detach()
        self.weight_16 = None
        if dtype in (torch.float16, torch.bfloat16):
            w16 = w.to(dtype)
            if torch.equal(w16.float(), w):
                self.weight_16 = w16

    def forward(self, x: torch.Tensor, x_fp8: PerTokenFp8 | None = None) -> torch.Tensor:
        w16 = self.weight_16
        if (w16 is not None and x.is_cuda and x.dim() == 2 and x.shape[0] > 1
                and x.dtype == w16.dtype and w16.device == x.device
                and not torch.compiler.is_compiling()):
            return torch.mm(x, w16.t(), out_dtype=torch.float32)
        return super().forward(x, x_fp8)


class NoAuxRouterGate(RouterGate):
    """Router of `noaux_tc` (DeepSeek-V3): `RouterGate` plus the per-expert
    `e_score_correction_bias`, also fp32 (as transformers' `_keep_in_fp32_modules_strict`; the
    checkpoint stores the bias in fp32, and a bf16 bias would shift expert choices).

    Parameters: `weight` [E, H] fp32 (`mlp.gate.weight`), `e_score_correction_bias` [E] fp32
    (`mlp.gate.e_score_correction_bias`). Both are filled through `weight_loader`.
    """

    def __init__(self, in_features: int, num_experts: int) -> None:
        super().__init__(in_features, num_experts)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                    requires_grad=False)


# (scoring_func, topk_method) pairs that DeepseekV2MoE routes.
ROUTING_METHODS = (("softmax", "greedy"), ("softmax", "group_limited_greedy"),
                   ("sigmoid", "noaux_tc"))


class DeepseekV2MoE(nn.Module):
    """Routed + shared experts of one DeepSeek-V2 / V3 decoder layer.

    Args:
        hidden_size, moe_intermediate_size: expert sizes.
        n_routed_experts, num_experts_per_tok: E and top-k.
        n_shared_experts: shared expert width multiplier (0: none).
        topk_method, n_group, topk_group, norm_topk_prob, routed_scaling_factor: routing
            (see `select_experts`, and `select_experts_noaux_tc` for "noaux_tc").
        fused_moe: routed experts through the triton `fused_experts` (True), the loop
            `experts_forward` (False), or the fused form for CUDA tensors only (None, default).
            The attribute of the same name may be changed after construction.
        scoring_func: "softmax" (V2) or "sigmoid" (V3, only with topk_method "noaux_tc"); one of
            `ROUTING_METHODS`.
        quant_config: None, a `BlockFP8Config` or `Fp8Config` for the shared experts' linears.
            The router stays unquantized (as in DeepSeek-V3's checkpoint).
        experts_quant_config: None, a `BlockFP8Config` or `Fp8Config` for the routed experts
            (see `StackedExperts`).
    Parameters (HF names in brackets): `gate.weight` [E, H] fp32 (`mlp.gate.weight`;
    `RouterGate`, `NoAuxRouterGate` with noaux_tc), `gate.e_score_correction_bias` [E] fp32
    (noaux_tc only, `mlp.gate.e_score_correction_bias`), `experts.w13_weight` [E, 2I, H]
    (`mlp.experts.{e}.gate_proj/up_proj.weight`), `experts.w2_weight` [E, H, I]
    (`mlp.experts.{e}.down_proj.weight`), with block FP8 also `experts.w13_weight_scale_inv` /
    `experts.w2_weight_scale_inv` (`...weight_scale_inv`), `shared_experts.*`.
    Raises:
        ValueError: a (scoring_func, topk_method) pair outside `ROUTING_METHODS`.
    """

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        n_routed_experts: int,
        num_experts_per_tok: int,
        n_shared_experts: int = 0,
        topk_method: str = "greedy",
        n_group: int | None = None,
        topk_group: int | None = None,
        norm_topk_prob: bool = False,
        routed_scaling_factor: float = 1.0,
        fused_moe: bool | None = None,
        scoring_func: str = "softmax",
        quant_config: BlockFP8Config | None = None,
        experts_quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        if (scoring_func, topk_method) not in ROUTING_METHODS:
            raise ValueError(f"unsupported routing: scoring_func {scoring_func!r} with "
                             f"topk_method {topk_method!r}; supported {ROUTING_METHODS}")
        self.top_k = num_experts_per_tok
        self.topk_method = topk_method
        self.scoring_func = scoring_func
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.fused_moe = fused_moe
        self.gate = (NoAuxRouterGate(hidden_size, n_routed_experts) if topk_method == "noaux_tc"
                     else RouterGate(hidden_size, n_routed_experts))
        self.experts = StackedExperts(n_routed_experts, hidden_size, moe_intermediate_size,
                                      experts_quant_config)
        self.shared_experts = (GatedMLP(hidden_size, moe_intermediate_size * n_shared_experts,
                                        reduce_results=False, quant_config=quant_config)
                               if n_shared_experts else None)

    @property
    def takes_fp8_input(self) -> bool:
        """Whether forward uses an x_fp8: per-tensor FP8 routed experts, or shared experts
        whose gate/up linear quantizes x per token (both then share one quantization)."""
        return (type(self.experts.quant_method) is Fp8MoEMethod
                or (self.shared_experts is not None and self.shared_experts.takes_fp8_input))

    def forward(self, x: torch.Tensor, x_fp8: PerTokenFp8 | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. x_fp8: optional x quantized per token
        (`quantization.PerTokenFp8`), used by per-tensor FP8 routed and shared experts instead
        of quantizing x themselves; the router reads x."""
        logits = self.gate(x)  # [T, E] fp32
        if self.topk_method == "noaux_tc":
            weights, ids = select_experts_noaux_tc(
                logits, self.gate.e_score_correction_bias, self.top_k, self.n_group,
                self.topk_group, self.norm_topk_prob, self.routed_scaling_factor)
        else:
            weights, ids = select_experts(logits, self.top_k, self.topk_method, self.n_group,
                                          self.topk_group, self.norm_topk_prob,
                                          self.routed_scaling_factor)
        use_fused = x.is_cuda if self.fused_moe is None else self.fused_moe
        shared = self._foldable_shared(x) if use_fused else None
        # The shared experts' output (unless folded into the GEMV launches) is added by the
        # routed experts' combine, in the same rounding (`moe_sum.moe_sum(add=)`).
        add = (self.shared_experts(x, x_fp8)
               if self.shared_experts is not None and shared is None else None)
        out = self.experts(x, weights, ids, use_fused, shared=shared, x_fp8=x_fp8, add=add)
        # Tensor parallel: each rank holds a slice of every expert's intermediate dim, so routed
        # and shared outputs are partial sums; one all-reduce (a no-op at TP 1).
        return tensor_model_parallel_all_reduce(out)

    def _foldable_shared(self, x: torch.Tensor) -> SharedFold | None:
        """(gate_up weight [2*S*I, H], down weight [H, S*I], and for FP8 their column scales
        [2*S*I] and [H], else None, None) of the shared experts when they run inside the routed
        experts' GEMV launches (`fused_experts(shared_w13=, ...)`): at most
        `SHARED_FOLD_MAX_ROWS` token rows, without bias, the shared width a multiple of the
        routed I, not while torch.compile traces (inductor then compiles the shared MLP
        itself), and either unquantized routed and shared weights of x's dtype, or per-tensor
        FP8 routed experts (`Fp8MoEMethod`) with dynamic per-tensor FP8 shared linears
        (`Fp8LinearMethod`, no static input scale; their weights then run weight-only, as the
        routed ones do at one row: `StackedExperts.forward`). Else None."""
        se = self.shared_experts
        ex = self.experts
        if se is None or x.shape[0] > SHARED_FOLD_MAX_ROWS or torch.compiler.is_compiling():
            return None
        gu, down = se.gate_up_proj, se.down_proj
        # after load: FP8 weights are float8_e4m3fn (Fp8LinearMethod then has weight_scale_row)
        fp8 = type(ex.quant_method) is Fp8MoEMethod
        method, dtype = ((Fp8LinearMethod, FP8_E4M3) if fp8
                         else (UnquantizedLinearMethod, x.dtype))
        if (type(ex.quant_method) is not UnquantizedMoEMethod and not fp8
                or ex.w13_weight.dtype != dtype):
            return None
        for lin in (gu, down):
            if (type(lin.quant_method) is not method or lin.bias is not None
                    or lin.weight.dtype != dtype or hasattr(lin, "input_scale")):
                return None
        inter = ex.intermediate_size
        width = down.weight.shape[1]
        if inter == 0 or width % inter or tuple(gu.weight.shape) != (2 * width, x.shape[1]):
            return None
        if not fp8:
            return SharedFold(gu.weight, down.weight, None, None)
        return SharedFold(gu.weight, down.weight, gu.weight_scale_row.view(-1),
                          down.weight_scale_row.view(-1))


class SharedFold(NamedTuple):
    """Shared experts folded into the routed experts' GEMV launches (`_foldable_shared`):
    gate_up [2*S*I, H] and down [H, S*I] weights; with FP8 weights their float32 column
    scales [2*S*I] and [H] (`Fp8LinearMethod`'s weight_scale_row), else None."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None


# Token rows up to which the shared experts run inside the routed experts' GEMV launches
# (`DeepseekV2MoE._foldable_shared`): each row reads the shared weights itself there, so only
# decode at batch size 1 gains.
SHARED_FOLD_MAX_ROWS = 1


@torch.compiler.disable
def _fused_experts_opaque(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                          weights: torch.Tensor, ids: torch.Tensor, **kwargs: object
                          ) -> torch.Tensor:
    """`mla_kernels.fused_moe.fused_experts`, not traced by torch.compile (inductor compiles the
    router and the shared experts around it)."""
    from mla_kernels.fused_moe import fused_experts

    return fused_experts(x, w13, w2, weights, ids, **kwargs)


class UnquantizedMoEMethod:
    """Routed experts in the model dtype: `w13_weight` [E, 2I, H], `w2_weight` [E, H, I]."""

    def create_weights(self, layer: "StackedExperts") -> None:
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
        layer.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(e, h, i), requires_grad=False)

    def process_weights_after_loading(self, layer: "StackedExperts") -> None:
        pass

    def kernel_args(self, layer: "StackedExperts") -> dict:
        """Extra keyword arguments of `fused_experts` / `experts_forward`."""
        return {}


class Fp8MoEMethod(UnquantizedMoEMethod):
    """Per-tensor FP8 routed experts (`Fp8Config`: online `quantization="fp8"`, or a per-tensor
    FP8 checkpoint, whose expert weights the loader dequantizes (weight * weight_scale) into the
    model-dtype parameters; their `input_scale` is not used).

    Loads like `UnquantizedMoEMethod`; `process_weights_after_loading` quantizes each expert's
    stacked w13 and w2 per tensor (scale = amax(|W_e|) / 448, one for gate and up together, as
    vLLM's Fp8MoEMethod after `requantize_with_max_scale`): `w13_weight` float8_e4m3fn
    [E, 2I, H] + `w13_weight_scale` float32 [E], `w2_weight` [E, H, I] + `w2_weight_scale` [E].
    Activations are quantized dynamically per token (one scale per row of each GEMM's input).
    """

    def __init__(self, config: Fp8Config) -> None:
        self.config = config

    def process_weights_after_loading(self, layer: "StackedExperts") -> None:
        for name in ("w13_weight", "w2_weight"):
            w = getattr(layer, name)
            if w.dtype == FP8_E4M3:
                continue  # already processed
            pairs = [quantize_fp8_per_tensor(w.data[e]) for e in range(w.shape[0])]
            q = torch.stack([p[0] for p in pairs]) if pairs else w.data.to(FP8_E4M3)
            scale = torch.stack([p[1] for p in pairs]) if pairs else torch.ones(0)
            setattr(layer, name, nn.Parameter(q, requires_grad=False))
            setattr(layer, name + "_scale", nn.Parameter(scale.float().to(q.device),
                                                         requires_grad=False))

    def kernel_args(self, layer: "StackedExperts") -> dict:
        if layer.w13_weight.dtype != FP8_E4M3:  # before processing: still the model dtype
            return {}
        return {"w13_scale": layer.w13_weight_scale, "w2_scale": layer.w2_weight_scale}


class BlockFP8MoEMethod(UnquantizedMoEMethod):
    """DeepSeek-V3 block-FP8 routed experts kept in FP8 (`BlockFP8Config`, blocks (bn, bk)).

    Parameters: `w13_weight` float8_e4m3fn [E, 2I, H] + `w13_weight_scale_inv` float32
    [E, 2*ceil(I/bn), ceil(H/bk)] (gate's block rows, then up's: the checkpoint blocks gate and
    up separately), `w2_weight` float8_e4m3fn [E, H, I] + `w2_weight_scale_inv` float32
    [E, ceil(H/bn), ceil(I/bk)], I the local (per TP rank) intermediate size. Activations are
    quantized per token per bk columns (`activation_quant`, the format's dynamic scheme).
    """

    def __init__(self, config: BlockFP8Config) -> None:
        self.config = config
        self.block_shape = tuple(int(v) for v in config.weight_block_size)

    @staticmethod
    def unsupported_reason(config: BlockFP8Config, full_intermediate: int,
                           tp_size: int) -> str | None:
        """Why the experts cannot stay block-FP8 (None: they can): under tensor parallelism a
        rank's slice of the intermediate dim must be whole blocks (a multiple of bn for the
        gate/up rows and of bk for the down columns)."""
        bn, bk = config.weight_block_size
        local = full_intermediate // tp_size
        if tp_size > 1 and (local % bn or local % bk):
            return (f"moe_intermediate_size {full_intermediate} / tp {tp_size} = {local} is not "
                    f"a multiple of the FP8 block {bn}x{bk}: a rank's slice would cut blocks")
        return None

    def create_weights(self, layer: "StackedExperts") -> None:
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
        bn, bk = self.block_shape
        nbi = -(-i // bn)
        layer.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h, dtype=FP8_E4M3),
                                        requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(e, h, i, dtype=FP8_E4M3), requires_grad=False)
        layer.w13_weight_scale_inv = nn.Parameter(
            torch.empty(e, 2 * nbi, -(-h // bk), dtype=torch.float32), requires_grad=False)
        layer.w2_weight_scale_inv = nn.Parameter(
            torch.empty(e, -(-h // bn), -(-i // bk), dtype=torch.float32), requires_grad=False)

    def kernel_args(self, layer: "StackedExperts") -> dict:
        return {"w13_scale": layer.w13_weight_scale_inv, "w2_scale": layer.w2_weight_scale_inv,
                "block_shape": self.block_shape,
                "activation_quant": self.config.activation_quant}


class StackedExperts(nn.Module):
    """Holds the routed experts' weights stacked over experts and runs them.
    Tensor parallel: each rank holds rows [r*I/tp, (r+1)*I/tp) of every gate and up matrix and
    the same columns of every down matrix (`intermediate_size` is the local I/tp).

    `quant_config` picks `quant_method`: None -> `UnquantizedMoEMethod` (model dtype);
    `Fp8Config` -> `Fp8MoEMethod` (per-expert per-tensor FP8 after load); `BlockFP8Config` ->
    `BlockFP8MoEMethod` (the checkpoint's FP8 weights and block scales), or, when a TP slice
    would cut blocks (`BlockFP8MoEMethod.unsupported_reason`, logged and kept in
    `fp8_fallback_reason`), `UnquantizedMoEMethod` with the loader dequantizing at load.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.full_intermediate_size = intermediate_size
        self.hidden_size = hidden_size
        tp = get_tp_size()
        intermediate_size = divide(intermediate_size, tp, "moe_intermediate_size")
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.fp8_fallback_reason: str | None = None
        if isinstance(quant_config, BlockFP8Config):
            self.fp8_fallback_reason = BlockFP8MoEMethod.unsupported_reason(
                quant_config, self.full_intermediate_size, tp)
            if self.fp8_fallback_reason:
                logger.warning("routed experts dequantized at load: %s", self.fp8_fallback_reason)
        if isinstance(quant_config, Fp8Config):
            self.quant_method: UnquantizedMoEMethod = Fp8MoEMethod(quant_config)
        elif isinstance(quant_config, BlockFP8Config) and not self.fp8_fallback_reason:
            self.quant_method = BlockFP8MoEMethod(quant_config)
        else:
            self.quant_method = UnquantizedMoEMethod()
        self.quant_method.create_weights(self)

    @property
    def is_block_fp8(self) -> bool:
        """The experts keep a block-FP8 checkpoint's weights and scales (no dequantization)."""
        return isinstance(self.quant_method, BlockFP8MoEMethod)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                fused: bool, shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                x_fp8: PerTokenFp8 | None = None, add: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Routed output [T, H] in x's dtype (before any TP all-reduce), plus `add`.

        Args:
            x: [T, H]. topk_weights: [T, k] fp32. topk_ids: [T, k] int64.
            fused: the triton `fused_experts` (no host sync: the form CUDA graphs capture; kept
                while torch.compile traces, as an opaque call), else the loop `experts_forward`
                (reads per-expert counts to the host). Both do the same (FP8) math.
            shared: optional shared experts (`SharedFold`) added inside the fused GEMV
                launches (fused only; `fused_experts(shared_w13=...)`). With FP8 shared
                weights the launches are weight-only (`activation_quant=False`: x and the
                intermediate unquantized, no quantization launch), as at one row they read the
                same weight bytes.
            x_fp8: optional x quantized per token (`fused_experts(x_fp8=)`: used with
                per-tensor FP8 weights). The loop quantizes x itself, to the same values.
            add: optional [T, H] in x's dtype (the shared experts' output) added to the routed
                sum: fused, inside its combine (`fused_experts(add=)`, one rounding); the loop
                adds it after.
        Raises:
            ValueError: shared weights with fused False.
        """
        args = self.quant_method.kernel_args(self)
        if fused:
            if shared is not None:
                args = dict(args, shared_w13=shared.w13, shared_w2=shared.w2, path="gemv")
                if shared.w13_scale is not None:
                    args.update(shared_w13_scale=shared.w13_scale,
                                shared_w2_scale=shared.w2_scale, activation_quant=False)
                    x_fp8 = None
            if x_fp8 is not None and type(self.quant_method) is Fp8MoEMethod:
                args = dict(args, x_fp8=x_fp8)
            if add is not None:
                args = dict(args, add=add)
            return _fused_experts_opaque(x, self.w13_weight, self.w2_weight, topk_weights,
                                         topk_ids, **args)
        if shared is not None:
            raise ValueError("StackedExperts: shared experts are folded on the fused path only")
        out = experts_forward(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, **args)
        return out if add is None else out + add

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int,
                      shard: str) -> None:
        """Copy one HF expert matrix, or (block FP8) its `weight_scale_inv`, into this rank's
        slice. shard: "gate" | "up" (into w13) or "down" (into w2). A block-FP8 layer given an
        unquantized weight quantizes it in blocks here (weight and scale both filled).

        Raises:
            ValueError: expert_id out of range, unknown shard or shape mismatch.
        """
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id {expert_id} out of range 0..{self.num_experts - 1}")
        inter, full_i, hidden = self.intermediate_size, self.full_intermediate_size, self.hidden_size
        if shard not in ("gate", "up", "down"):
            raise ValueError(f"unknown expert shard {shard!r}")
        rank = get_tp_rank()
        is_scale = param is getattr(self, "w13_weight_scale_inv", None) or \
            param is getattr(self, "w2_weight_scale_inv", None)
        if is_scale:
            bn, bk = self.quant_method.block_shape
            nbi = -(-inter // bn)
            # shard -> (scale rows of the expert's entry, full checkpoint shape, dim, start, len)
            layout = {"gate": (slice(0, nbi), (-(-full_i // bn), -(-hidden // bk)), 0,
                               rank * inter // bn, nbi),
                      "up": (slice(nbi, 2 * nbi), (-(-full_i // bn), -(-hidden // bk)), 0,
                             rank * inter // bn, nbi),
                      "down": (slice(None), (-(-hidden // bn), -(-full_i // bk)), 1,
                               rank * inter // bk, -(-inter // bk))}
            rows, full, dim, start, length = layout[shard]
            if tuple(loaded.shape) != full:
                raise ValueError(f"expert {expert_id} {shard} weight_scale_inv: expected "
                                 f"{full}, got {tuple(loaded.shape)}")
            param.data[expert_id, rows].copy_(loaded.narrow(dim, start, length))
            return
        # shard -> (rows of w13 / the whole w2 entry, full HF shape, dim split across TP ranks)
        layout = {"gate": (slice(0, inter), (full_i, hidden), 0),
                  "up": (slice(inter, 2 * inter), (full_i, hidden), 0),
                  "down": (slice(None), (hidden, full_i), 1)}
        rows, full, dim = layout[shard]
        if tuple(loaded.shape) != full:
            raise ValueError(f"expert {expert_id} {shard}: expected the full HF matrix "
                             f"{full}, got {tuple(loaded.shape)}")
        if param.dtype == FP8_E4M3 and loaded.dtype != FP8_E4M3 and self.is_block_fp8:
            from mla_kernels.block_fp8_gemm import quant_weight_block_fp8

            q, s = quant_weight_block_fp8(loaded.float(), self.quant_method.block_shape)
            scale = self.w2_weight_scale_inv if shard == "down" else self.w13_weight_scale_inv
            self.weight_loader(scale, s, expert_id, shard)
            loaded = q
        target = param.data[expert_id, rows]
        loaded = loaded.narrow(dim, rank * inter, inter)  # this rank's slice
        target.copy_(loaded)


__all__ = ["ROUTING_METHODS", "BlockFP8MoEMethod", "DeepseekV2MoE", "Fp8MoEMethod", "GatedMLP",
           "NoAuxRouterGate", "StackedExperts", "UnquantizedMoEMethod", "dequantize_expert",
           "experts_forward", "select_experts", "select_experts_noaux_tc"]
