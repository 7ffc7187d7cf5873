"""Float32/float64 torch twins of every kernel op: the oracles kernel tests compare against.

Data comes from the caller as plain tensors in the pool layouts of `mla_backend.mem_cache`:
`k_buffer` [num_slots, kv_heads, qk_dim], `v_buffer` [num_slots, kv_heads, v_dim] (for MLA the
value buffer is the first `kv_lora_rank` columns of the key buffer), `req_to_token`
[rows, max_context] int32 mapping (request row, position) → slot. Everything is computed in the
dtype of the inputs after an explicit upcast to at least float32; written for clarity, not speed.
"""

from __future__ import annotations

import torch


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                  q_offset: int) -> torch.Tensor:
    """Causal attention of one request.

    Args:
        q: [n_new, H, Dk] queries for positions q_offset .. q_offset + n_new - 1.
        k: [n_ctx, Hkv, Dk] keys for positions 0 .. n_ctx - 1 (n_ctx = q_offset + n_new).
        v: [n_ctx, Hkv, Dv].
        sm_scale: softmax scale.
        q_offset: position of the first query (the cached prefix length).
    Returns:
        [n_new, H, Dv] float32 (float64 if the inputs are float64).
    Raises:
        ValueError: H is not a multiple of Hkv.
    """
    q, k, v = _upcast(q), _upcast(k), _upcast(v)
    n_new, h, _ = q.shape
    n_ctx, hkv, _ = k.shape
    if h % hkv:
        raise ValueError(f"query heads {h} not a multiple of kv heads {hkv}")
    group = h // hkv
    k = k.repeat_interleave(group, dim=1)  # [n_ctx, H, Dk]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * sm_scale  # [H, n_new, n_ctx]
    q_pos = torch.arange(n_new, device=q.device)[:, None] + q_offset
    k_pos = torch.arange(n_ctx, device=q.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)


def decode_attention_ref(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         seq_lens: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """One query token per request over all its cached tokens (read through req_to_token).

    Args:
        q: [bs, H, Dk]; k_buffer [S, Hkv, Dk]; v_buffer [S, Hkv, Dv];
        req_to_token: [R, C] int32/int64; req_pool_indices [bs]; seq_lens [bs] (>= 1, includes
        the query token, whose KV is already in the pool).
    Returns:
        [bs, H, Dv] float32.
    """
    outs = []
    for i in range(q.shape[0]):
        n = int(seq_lens[i])
        slots = req_to_token[int(req_pool_indices[i]), :n].long()
        outs.append(attention_ref(q[i:i + 1], k_buffer[slots], v_buffer[slots], sm_scale, n - 1))
    return torch.cat(outs, dim=0)


def extend_attention_ref(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                         sm_scale: float) -> torch.Tensor:
    """New tokens of each request over its cached prefix plus the causal new part.

    The new tokens' KV must already be in the pool (at req_to_token[row, prefix:prefix+extend]).
    Args:
        q: [T, H, Dk], T = sum(extend_lens), requests in order; other args as decode.
    Returns:
        [T, H, Dv] float32.
    """
    outs, start = [], 0
    for i in range(len(extend_lens)):
        p, e = int(prefix_lens[i]), int(extend_lens[i])
        slots = req_to_token[int(req_pool_indices[i]), :p + e].long()
        outs.append(attention_ref(q[start:start + e], k_buffer[slots], v_buffer[slots], sm_scale, p))
        start += e
    return torch.cat(outs, dim=0) if outs else q.new_zeros((0,) + q.shape[1:2] + v_buffer.shape[2:])


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x²) + eps) * weight, in float32.

    Args: x [T, D]; weight [D]. Returns [T, D] in x's dtype.
    """
    xf = _upcast(x)
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * _upcast(weight)
    return out.to(x.dtype)


def fused_add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rmsnorm(residual'), residual'). Shapes [T, D]."""
    new_res = (_upcast(x) + _upcast(residual)).to(x.dtype)
    return rmsnorm_ref(new_res, weight, eps), new_res


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: x [T, 2N] → silu(x[:, :N]) * x[:, N:], [T, N] in x's dtype."""
    n = x.shape[-1] // 2
    xf = _upcast(x)
    return (torch.nn.functional.silu(xf[..., :n]) * xf[..., n:]).to(x.dtype)


def moe_sum_ref(y: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of `moe_sum.moe_sum`: y [T, k, H] summed over k (+ add [T, H]) in float32 (float64
    for float64 inputs), rounded once to y's dtype: [T, H]."""
    s = _upcast(y).sum(dim=1)
    if add is not None:
        s = s + _upcast(add)
    return s.to(y.dtype)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T (+ bias [N]) in fp32 (fp64 for fp64 inputs): [T, N]."""
    out = _upcast(x) @ _upcast(weight).T
    return out if bias is None else out + _upcast(bias)


def fp8_weight_only_gemv_ref(x: torch.Tensor, weight: torch.Tensor,
                             w_scale: torch.Tensor) -> torch.Tensor:
    """Twin of `gemv.gemv` with a float x and an FP8 weight: (x [T, K] @ weight [N, K]^T e4m3,
    in fp32) * w_scale (N values, as [1, N]) -> [T, N] float32."""
    return (x.float() @ weight.float().T) * w_scale.float().reshape(1, -1)


def bmm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Twin of `bmm_gemv.bmm_gemv`: x [T, H, K], w [H, K, N] -> [T, H, N] with out[t, h] =
    x[t, h] @ w[h], in fp32 (fp64 for fp64 inputs)."""
    return torch.einsum("thk,hkn->thn", _upcast(x), _upcast(w))


def softmax_topk_ref(logits: torch.Tensor, top_k: int, renormalize: bool = False,
                     scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy softmax routing: logits [T, E] → (weights [T, top_k] fp32 (fp64 for fp64 input),
    ids [T, top_k] int64), ids in descending score order; renormalize divides by the chosen
    weights' sum (+1e-20) when top_k > 1, then everything is multiplied by `scale`."""
    p = torch.softmax(_upcast(logits), dim=-1)
    weights, ids = torch.topk(p, k=top_k, dim=-1, sorted=True)
    if renormalize and top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021) on the last dim of x.

    Args:
        x: [T, H, D] (D even); cos, sin: [T, D/2] for each token's position.
        is_neox: True rotates halves (x[:D/2], x[D/2:]); False rotates interleaved pairs
            (x[0::2], x[1::2]) as in GPT-J and DeepSeek's MLA rope.
    Returns:
        [T, H, D] in x's dtype.
    """
    xf = _upcast(x)
    c, s = _upcast(cos)[:, None, :], _upcast(sin)[:, None, :]
    if is_neox:
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    return out.to(x.dtype)


def store_kv_ref(k_buffer: torch.Tensor, v_buffer: torch.Tensor | None, loc: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor | None) -> None:
    """Write new K/V rows at slots `loc` ([T] int64) in place; slot 0 is the padding sink."""
    k_buffer[loc] = k.to(k_buffer.dtype)
    if v_buffer is not None and v is not None:
        v_buffer[loc] = v.to(v_buffer.dtype)


def mla_norm_rope_store_ref(kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            q_pe: torch.Tensor, table: torch.Tensor, k_buffer: torch.Tensor,
                            loc: torch.Tensor, q_out: torch.Tensor) -> None:
    """Absorbed-MLA decode prologue in place (`mla_rope_store.mla_norm_rope_store`): with
    L = norm_weight.numel(), R = q_pe.shape[-1], cos ‖ sin = table [T, R]:
    k_buffer[loc, 0] = rmsnorm(kv_a[:, :L]) ‖ rope(kv_a[:, L:]) and q_out = rope(q_pe)
    (interleaved rope). kv_a [T, L + R], q_pe / q_out [T, H, R], k_buffer [S, 1, L + R]."""
    lora, half = norm_weight.shape[0], q_pe.shape[-1] // 2
    cos, sin = table[:, :half], table[:, half:]
    latent = rmsnorm_ref(kv_a[:, :lora], norm_weight, eps)
    k_pe = rotary_ref(kv_a[:, None, lora:], cos, sin, is_neox=False)[:, 0]
    store_kv_ref(k_buffer, None, loc, torch.cat([latent, k_pe], dim=-1)[:, None], None)
    q_out.copy_(rotary_ref(q_pe, cos, sin, is_neox=False))


def moe_align_block_size_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch twin of `fused_moe.moe_align_block_size` (same arguments, same three int32 tensors:
    sorted_token_ids [P], expert_ids [P // block_m], num_tokens_post_padded [1]), built from a
    stable sort. P = T*k + min(E, T*k) * (block_m - 1), rounded up to a multiple of block_m."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)  # [N], N = T*k
    n = flat.numel()
    worst = n + min(num_experts, n) * (block_m - 1)
    padded_len = -(-worst // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)  # [E] inclusive end of each expert's padded run
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts  # [E] start in the unpadded sorted order
    sorted_expert, order = torch.sort(flat, stable=True)  # rows grouped by expert
    rank = torch.arange(n, device=dev) - count_start[sorted_expert]  # position within its expert
    sorted_token_ids = torch.full((padded_len,), n, dtype=torch.int32, device=dev)
    sorted_token_ids[padded_start[sorted_expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, padded_len, block_m, device=dev)
    # the first expert whose padded run ends after the block's start (empty experts passed over)
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    total = padded_end[-1:] if n else torch.zeros(1, dtype=torch.int64, device=dev)
    expert_ids = torch.where(block_start < total, expert_ids, -1).to(torch.int32)
    return sorted_token_ids, expert_ids, total.to(torch.int32)


def fused_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Routed SiLU-gated experts, one expert at a time, in float32 (float64 if x is float64).

    out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]))
    with e = topk_ids[t, j].
    Args:
        x: [T, H]; w13: [E, 2I, H] (gate rows then up rows); w2: [E, H, I];
        topk_weights: [T, k]; topk_ids: [T, k] integer ids in [0, E).
    Returns:
        [T, H] float32 (float64 if x is float64).
    """
    xf = _upcast(x)
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=xf.dtype, device=x.device)
    for e in range(w13.shape[0]):
        token, slot = torch.nonzero(topk_ids == e, as_tuple=True)  # pairs routed to expert e
        if token.numel() == 0:
            continue
        gate_up = xf[token] @ w13[e].to(xf.dtype).T  # [n, 2I]
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = act @ w2[e].to(xf.dtype).T  # [n, H]
        out.index_add_(0, token, y * topk_weights[token, slot].to(xf.dtype)[:, None])
    return out


def block_fp8_matmul_ref(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor,
                         b_scale: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """Twin of `block_fp8_gemm.block_fp8_matmul`: dequantize both operands, one fp32 matmul.

    Args:
        a: [M, K] (fp8 or float); a_scale [M, ceil(K/bk)] (one scale per token per K group).
        b: [N, K] fp8 weight; b_scale [ceil(N/bn), ceil(K/bk)] (`weight_scale_inv`).
        block_size: (bn, bk).
    Returns:
        [M, N] float32 (float64 if a_scale is float64) =
        (a * a_scale[m, k // bk]) @ (b * b_scale[n // bn, k // bk])^T.
    """
    bn, bk = block_size
    dt = torch.float64 if a_scale.dtype == torch.float64 else torch.float32
    m, k = a.shape
    n = b.shape[0]
    a_full = a.to(dt) * a_scale.to(dt).repeat_interleave(bk, 1)[:, :k]
    b_s = b_scale.to(dt).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return a_full @ (b.to(dt) * b_s).T


def _quant_act_ref(x: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """Dynamic e4m3 activation quantization then dequantization, float32 [M, K]: one scale per
    row, max(amax / 448, 1e-12), the row times the reciprocal of its scale (group_size None,
    as `fp8_quant.quantize_per_token`), or per row per group_size columns, max(amax, 1e-10) /
    448, the groups divided by their scales (as `per_token_group_quant_fp8`); values saturate
    at +-448 * scale."""
    xf = x.float()
    m, k = xf.shape
    g = k if group_size is None else group_size
    groups = -(-k // g)
    xp = torch.nn.functional.pad(xf, (0, groups * g - k)).view(m, groups, g)
    amax = xp.abs().amax(dim=-1)
    if group_size is None:
        scale = (amax / 448.0).clamp(min=1e-12).unsqueeze(-1)  # [m, 1, 1]
    else:
        scale = (amax.clamp(min=1e-10) / 448.0).unsqueeze(-1)  # [m, groups, 1]
    # per row: the kernels' x * (1 / scale), which can differ from x / scale by one e4m3 step
    # where the quotient sits on a rounding tie (frequent for bf16 rows)
    scaled = xp * (1.0 / scale) if group_size is None else xp / scale
    q = scaled.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return (q * scale).view(m, groups * g)[:, :k]


def dequant_experts_ref(w: torch.Tensor, scale: torch.Tensor,
                        block_shape: tuple[int, int] | None, fused_gate_up: bool = False
                        ) -> torch.Tensor:
    """FP8 stacked expert weights [E, N, K] -> float32 w * scale: per expert (scale [E]) or per
    (bn, bk) block (scale [E, ceil(N/bn), ceil(K/bk)]; with fused_gate_up, N = 2I and the gate
    and up halves are blocked separately: scale [E, 2*ceil(I/bn), ceil(K/bk)])."""
    wf = w.float()
    if block_shape is None:
        return wf * scale.float()[:, None, None]
    bn, bk = block_shape
    e, n, k = w.shape
    if fused_gate_up:
        half, nb = n // 2, -(-(n // 2) // bn)
        return torch.cat([dequant_experts_ref(w[:, :half], scale[:, :nb], block_shape),
                          dequant_experts_ref(w[:, half:], scale[:, nb:], block_shape)], dim=1)
    s = scale.float().repeat_interleave(bn, 1)[:, :n].repeat_interleave(bk, 2)[:, :, :k]
    return wf * s


def _rows_by_expert(a: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[R, N]: row r = a[r] @ w[ids[r]]^T, one expert at a time (no [R, N, K] weight gather).
    a: [R, K]; w: [E, N, K]; ids: [R] int64."""
    out = a.new_empty(a.shape[0], w.shape[1])
    for e in ids.unique().tolist():
        rows = (ids == e).nonzero().squeeze(1)
        out[rows] = a[rows] @ w[e].T
    return out


def fused_experts_fp8_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                          block_shape: tuple[int, int] | None = None,
                          activation_quant: bool = True,
                          round_gate_up: bool = False) -> torch.Tensor:
    """Twin of `fused_moe.fused_experts` with FP8 weights: dequantize the weights
    (`dequant_experts_ref`), quantize-dequantize each GEMM's activations as the kernel path does
    (x, then the [T*k, I] intermediate: one scale per row, or per row per bk columns with
    block scales; skipped when activation_quant is False), compute in float32.

    Args:
        x: [T, H]; w13: [E, 2I, H] fp8; w2: [E, H, I] fp8; topk_weights, topk_ids: [T, k].
        w13_scale, w2_scale: [E] (per tensor, block_shape None) or block scales as
            `fused_experts` documents. block_shape: (bn, bk) or None.
        round_gate_up: also round the gate_up product to x's dtype before the activation. The
            kernels do not; it is a perturbation of the size their summation order causes, and
            the twin's distance to itself with it is the floor that FP8 rounding flips of the
            intermediate set for any comparison with the kernels
            (`benchmarks/bench_fp8_moe_error.py`).
    Returns:
        [T, H] float32.
    """
    group = None if block_shape is None else block_shape[1]
    w13f = dequant_experts_ref(w13, w13_scale, block_shape, fused_gate_up=True)
    w2f = dequant_experts_ref(w2, w2_scale, block_shape)
    xq = _quant_act_ref(x, group) if activation_quant else x.float()
    t, k = topk_ids.shape
    inter = w2.shape[2]
    ids = topk_ids.reshape(-1).long()
    gate_up = _rows_by_expert(xq.repeat_interleave(k, 0), w13f, ids)  # row r: token r // k
    if round_gate_up:
        gate_up = gate_up.to(x.dtype).float()
    act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    act = act.to(x.dtype).float()  # the kernel rounds the intermediate to x's dtype
    if activation_quant:
        act = _quant_act_ref(act, group)
    y = _rows_by_expert(act, w2f, ids) * topk_weights.reshape(-1, 1).float()
    return y.view(t, k, -1).sum(dim=1)


def quantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of `fp8_quant.quantize_fp8`: saturating per-tensor e4m3 quantization in torch.

    Args:
        x: any float tensor. scale: static float32 scale (one element) or None = dynamic
            max(amax(|x.float()|) / 448, 1e-12).
    Returns:
        (q float8_e4m3fn, x's shape, = (x.float() / scale).clamp(-448, 448) cast (round to
        nearest even); scale float32 0-dim).
    """
    xf = x.float()
    if scale is None:
        scale = (xf.abs().amax() / 448.0).clamp(min=1e-12)
    scale = scale.float().reshape(())
    return (xf / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def quantize_fp8_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of `fp8_quant.quantize_fp8_per_token`: saturating e4m3 quantization, one dynamic
    scale per row, in torch.

    Args:
        x: [M, K] float.
    Returns:
        (q float8_e4m3fn [M, K] = (x.float() * (1 / scale)).clamp(-448, 448) cast (round to
        nearest even; the reciprocal and the product each rounded to float32); scale float32
        [M, 1] = max(amax(|x[m]|) / 448, 1e-12)).
    """
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (xf * (1.0 / scale)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def bmm_fp8_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of `bmm_fp8.bmm_fp8`: quantize x as `quantize_fp8_ref` does (same scale, same
    saturation and rounding), then torch.bmm of the fp8 values in float32, times both scales.

    Args:
        x: [H, M, K] float (any strides). w: [H, K, N] float8_e4m3fn. w_scale: float32, one
            element. x_scale: static scale (one element) or None = dynamic.
    Returns:
        [H, M, N] float32 = bmm(q, w) * (x_scale * w_scale).
    """
    q, xs = quantize_fp8_ref(x, x_scale)
    return torch.bmm(q.float(), w.float()) * (xs * w_scale.float().reshape(()))
