"""The GEMV path's two kernels of `fused_moe` (the small-batch, sort-free path; its launch,
tile configs and path choice live in `fused_moe`: `gemv_experts`, `GemvConfig`,
`GEMV_MAX_ROWS`; `fused_moe`'s module docstring gives the math).

`_gemv_gate_up_kernel`, grid (T*k, cdiv(I, BLOCK_N)): one row's BLOCK_N gate and up outputs, a
loop over H in BLOCK_K chunks of fp32 multiply + tl.sum. `_gemv_down_kernel`, grid
(T, cdiv(H, DOWN_BLOCK_N)): one token's outputs for all k slots at once ([k_pad, BLOCK_N,
BLOCK_K] weight tiles, k_pad = next power of two >= k), weighted and summed in fp32 and written
once. Rows are grid axis 0, so rows of one expert share weight tiles through L2. No tl.dot: its
16-row minimum would waste most of the tile at T=1.

QUANT (constexpr) picks the weight format, as in `fused_moe._grouped_gemm_kernel`:
0 = weights in the activations' float dtype; 1 = float8_e4m3fn weights with one scale per
expert (WScale[e]) and one activation scale per row (row stride 0: one for all; none when
A_SCALED is off: unquantized activations), applied after the reduction; shared-expert slots
there take FP8 weights with one scale per output column (SWS13 [2*S*I], SWS2 [H]);
2 = float8_e4m3fn weights with block scales WScale[e, n // group_n, k // group_k] and
per-(row, K group) activation scales, applied per BLOCK_K step (BLOCK_K divides group_k).
FP8 tiles are upcast to fp32 (a GEMV has no tl.dot); activations arrive already quantized
(in torch) or unquantized with scales of 1.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_enter


@triton.jit
def _gemv_gate_up_kernel(
    X, W13, Inter, TopkIds, XScale, WScale, SW13, SWS13,
    H, I, up_offset, group_n, group_k, up_scale_offset, shared_up_offset,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_ir, stride_in,
    stride_idt, stride_idk, stride_xst, stride_xsk, stride_wse, stride_wsn, stride_wsk,
    stride_swn, stride_swh,
    TOP_K: tl.constexpr, N_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr, USE_PDL: tl.constexpr, A_SCALED: tl.constexpr = True,
):
    pdl_enter(USE_PDL)
    # inter[row, n-block] = silu(x[t] . gate rows) * (x[t] . up rows), e = topk_ids[t, j]; the
    # slots j >= TOP_K are the N_SHARED shared experts (s = j - TOP_K: gate rows s*I.. of SW13).
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    t = (row // (TOP_K + N_SHARED)).to(tl.int64)
    j = (row % (TOP_K + N_SHARED)).to(tl.int64)
    e = tl.load(TopkIds + t * stride_idt + tl.minimum(j, TOP_K - 1) * stride_idk).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + t * stride_xt + offs_k[None, :].to(tl.int64) * stride_xh  # [1, BLOCK_K]
    g_ptrs = (W13 + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
              + offs_k[None, :].to(tl.int64) * stride_wh)  # [BLOCK_N, BLOCK_K] gate rows
    u_ptrs = g_ptrs + up_offset  # the up rows follow the I gate rows
    w_step = BLOCK_K * stride_wh
    if N_SHARED > 0:
        if j >= TOP_K:
            g_ptrs = (SW13 + ((j - TOP_K) * I + offs_n[:, None].to(tl.int64)) * stride_swn
                      + offs_k[None, :].to(tl.int64) * stride_swh)
            u_ptrs = g_ptrs + shared_up_offset  # the up rows follow all N_SHARED * I gate rows
            w_step = BLOCK_K * stride_swh
    gs_ptrs = WScale + e * stride_wse + (offs_n // group_n).to(tl.int64) * stride_wsn  # QUANT 2
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for kb in range(tl.cdiv(H, BLOCK_K)):
        mask_k = offs_k[None, :] < H - kb * BLOCK_K
        xv = tl.load(x_ptrs, mask=mask_k, other=0.0).to(tl.float32)
        w_mask = mask_n[:, None] & mask_k
        g = tl.load(g_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        if QUANT == 2:
            grp = (kb * BLOCK_K) // group_k
            xs = tl.load(XScale + t * stride_xst + grp * stride_xsk)
            gs = tl.load(gs_ptrs + grp * stride_wsk, mask=mask_n, other=0.0)
            us = tl.load(gs_ptrs + up_scale_offset + grp * stride_wsk, mask=mask_n, other=0.0)
            acc_g += tl.sum(g * xv, axis=1) * (gs * xs)
            acc_u += tl.sum(u * xv, axis=1) * (us * xs)
        else:
            acc_g += tl.sum(g * xv, axis=1)
            acc_u += tl.sum(u * xv, axis=1)
        x_ptrs += BLOCK_K * stride_xh
        g_ptrs += w_step
        u_ptrs += w_step
    if QUANT == 1:
        if A_SCALED:
            s = tl.load(XScale + t * stride_xst) * tl.load(WScale + e * stride_wse)
        else:
            s = tl.load(WScale + e * stride_wse)
        sg = s + tl.zeros([BLOCK_N], dtype=tl.float32)  # routed: the expert's scale
        su = sg
        if N_SHARED > 0:
            if j >= TOP_K:  # a shared slot: its gate and up columns' scales
                c = (j - TOP_K) * I + offs_n
                sg = tl.load(SWS13 + c, mask=mask_n, other=0.0)
                su = tl.load(SWS13 + N_SHARED * I + c, mask=mask_n, other=0.0)
                if A_SCALED:
                    sg = tl.load(XScale + t * stride_xst) * sg
                    su = tl.load(XScale + t * stride_xst) * su
        acc_g = acc_g * sg
        acc_u = acc_u * su
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    i_ptrs = Inter + row.to(tl.int64) * stride_ir + offs_n.to(tl.int64) * stride_in
    tl.store(i_ptrs, act.to(Inter.dtype.element_ty), mask=mask_n)


@triton.jit
def _gemv_down_kernel(
    Inter, W2, Out, TopkWeights, TopkIds, AScale, WScale, SW2, SWS2,
    H, I, group_n, group_k,
    stride_ir, stride_in, stride_we, stride_wn, stride_wi, stride_ot, stride_on,
    stride_twt, stride_twk, stride_idt, stride_idk, stride_asr, stride_ask,
    stride_wse, stride_wsn, stride_wsk, stride_s2n, stride_s2i,
    TOP_K: tl.constexpr, N_SHARED: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, QUANT: tl.constexpr, USE_PDL: tl.constexpr,
    A_SCALED: tl.constexpr = True,
):
    pdl_enter(USE_PDL)
    # out[t, n-block] = sum_j topk_weights[t, j] * inter[t*k + j] . w2[e_j, n-block rows]; the
    # slots j >= TOP_K are the N_SHARED shared experts (weight 1, columns (j - TOP_K)*I.. of SW2).
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    slots = tl.arange(0, K_PAD)
    routed = slots < TOP_K
    mask_s = slots < TOP_K + N_SHARED
    e = tl.load(TopkIds + t * stride_idt + slots.to(tl.int64) * stride_idk, mask=routed,
                other=0).to(tl.int64)  # [K_PAD]
    rw = tl.load(TopkWeights + t * stride_twt + slots.to(tl.int64) * stride_twk, mask=routed,
                 other=0.0).to(tl.float32)  # [K_PAD]
    rw = tl.where(routed, rw, tl.where(mask_s, 1.0, 0.0))
    rows = t * (TOP_K + N_SHARED) + slots.to(tl.int64)  # [K_PAD]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = (Inter + rows[:, None, None] * stride_ir
              + offs_k[None, None, :].to(tl.int64) * stride_in)  # [K_PAD, 1, BLOCK_K]
    w_ptrs = (W2 + e[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn
              + offs_k[None, None, :].to(tl.int64) * stride_wi)  # [K_PAD, BLOCK_N, BLOCK_K]
    w_step = tl.zeros([K_PAD], dtype=tl.int64) + BLOCK_K * stride_wi
    if N_SHARED > 0:
        s_col = tl.maximum(slots - TOP_K, 0).to(tl.int64) * I  # first column of shared expert
        s_ptrs = (SW2 + offs_n[None, :, None].to(tl.int64) * stride_s2n
                  + (s_col[:, None, None] + offs_k[None, None, :]) * stride_s2i)
        w_ptrs = tl.where(routed[:, None, None], w_ptrs, s_ptrs)
        w_step = tl.where(routed, w_step, BLOCK_K * stride_s2i)
    ws_ptrs = (WScale + e[:, None] * stride_wse
               + (offs_n[None, :] // group_n).to(tl.int64) * stride_wsn)  # QUANT 2 [K_PAD, BN]
    mask_sn = mask_s[:, None, None] & mask_n[None, :, None]
    acc = tl.zeros([K_PAD, BLOCK_N], dtype=tl.float32)
    for kb in range(tl.cdiv(I, BLOCK_K)):
        mask_k = offs_k[None, None, :] < I - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_s[:, None, None] & mask_k, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=mask_sn & mask_k, other=0.0).to(tl.float32)
        if QUANT == 2:
            grp = (kb * BLOCK_K) // group_k
            a_s = tl.load(AScale + rows * stride_asr + grp * stride_ask, mask=mask_s, other=0.0)
            w_s = tl.load(ws_ptrs + grp * stride_wsk, mask=mask_s[:, None] & mask_n[None, :],
                          other=0.0)
            acc += tl.sum(w * a, axis=2) * w_s * a_s[:, None]
        else:
            acc += tl.sum(w * a, axis=2)
        a_ptrs += BLOCK_K * stride_in
        w_ptrs += w_step[:, None, None]
    if QUANT == 1:
        ws = tl.load(WScale + e * stride_wse, mask=routed, other=0.0)  # [K_PAD]
        if N_SHARED > 0:  # shared slots: the shared down weight's column scales
            ws2 = tl.load(SWS2 + offs_n, mask=mask_n, other=0.0)  # [BLOCK_N]
            scale = tl.where(routed[:, None], ws[:, None], ws2[None, :])  # [K_PAD, BLOCK_N]
            if A_SCALED:
                a_s = tl.load(AScale + rows * stride_asr, mask=mask_s, other=0.0)
                scale = scale * a_s[:, None]
            acc = acc * scale
        elif A_SCALED:
            a_s = tl.load(AScale + rows * stride_asr, mask=mask_s, other=0.0)  # [K_PAD]
            acc = acc * (ws * a_s)[:, None]
        else:
            acc = acc * ws[:, None]
    y = tl.sum(acc * rw[:, None], axis=0)  # [BLOCK_N]
    o_ptrs = Out + t * stride_ot + offs_n.to(tl.int64) * stride_on
    tl.store(o_ptrs, y.to(Out.dtype.element_ty), mask=mask_n)
