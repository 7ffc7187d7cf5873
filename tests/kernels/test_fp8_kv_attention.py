"""Decode and extend attention kernels reading FP8 pools (float8_e4m3fn / float8_e5m2) with
per-tensor k/v scales, against the float32 references run on the dequantized pools
(stored.float() * scale) — CPU under TRITON_INTERPRET=1, fp32 queries.

The interpreter loads fp8 tensors and converts them exactly; the kernels fold k_scale into the
softmax scale and v_scale into P·V, so the only difference to the reference is fp32 rounding
(|K|, |V| up to ~15 here, 576-wide dot products: atol 1e-4, rtol 1e-3 — fp32 rounding level; an
fp8 rounding error or a missing scale is > 0.1)."""

from __future__ import annotations

import pytest
import torch

from mla_kernels.decode_attention import decode_attention_fwd, get_num_kv_splits, num_head_programs
from mla_kernels.extend_attention import extend_attention_fwd
from mla_kernels.reference import decode_attention_ref, extend_attention_ref
from mla_backend.mem_cache.memory_pool import quantize_fp8

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]
LAYOUTS = [  # (H, Hkv, Lk, Lv, mla)
    pytest.param(4, 2, 64, 64, False, id="gqa"),
    pytest.param(4, 1, 576, 512, True, id="mla"),
]
ATOL, RTOL = 1e-4, 1e-3


def _pool(n_slots, hkv, lk, lv, mla, dtype, k_scale, v_scale, g):
    """(k_buf, v_buf) fp8 pools holding N(0, 3) data quantized with the scales; unused rows hold
    huge stored values (never read) and slot 0 (sink) likewise."""
    k = quantize_fp8(torch.randn(n_slots, hkv, lk, generator=g) * 3, k_scale, dtype)
    if mla:
        return k, k[..., :lv]
    return k, quantize_fp8(torch.randn(n_slots, hkv, lv, generator=g) * 3, v_scale, dtype)


def _decode_pool(seq_lens, hkv, lk, lv, mla, dtype, k_scale, v_scale, g):
    """(k_buf, v_buf, req_to_token [4, 80], rows [bs]): an fp8 pool (`_pool`) with 5 spare
    slots and the requests' tokens on shuffled slots, in rows 2, 0, 3."""
    n_slots = sum(seq_lens) + 5
    k_buf, v_buf = _pool(n_slots, hkv, lk, lv, mla, dtype, k_scale, v_scale, g)
    perm = torch.randperm(n_slots - 1, generator=g) + 1
    req_to_token = torch.zeros(4, 80, dtype=torch.int32)
    rows = torch.tensor([2, 0, 3])
    off = 0
    for r, n in zip(rows.tolist(), seq_lens):
        req_to_token[r, :n] = perm[off:off + n].to(torch.int32)
        off += n
    return k_buf, v_buf, req_to_token, rows


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("h,hkv,lk,lv,mla", LAYOUTS)
def test_decode_reads_fp8_pool(dtype, h, hkv, lk, lv, mla):
    g = torch.Generator().manual_seed(1)
    k_scale, v_scale = (0.37, 0.37) if mla else (0.37, 2.5)
    seq_lens = [1, 33, 70]
    k_buf, v_buf, req_to_token, rows = _decode_pool(seq_lens, hkv, lk, lv, mla, dtype, k_scale,
                                                    v_scale, g)
    bs = len(seq_lens)
    q = torch.randn(bs, h, lk, generator=g)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    max_splits = 4
    splits = get_num_kv_splits(seq, num_head_programs(h, hkv, lv), max_splits, 8)
    o = torch.full((bs, h, lv), float("nan"))
    logits = torch.full((bs, h, max_splits, lv), float("nan"))
    lse = torch.full((bs, h, max_splits), float("nan"))
    sm = lk ** -0.5
    decode_attention_fwd(q, k_buf, v_buf, o, req_to_token, rows, seq, splits, max_splits,
                         logits, lse, sm, k_scale, v_scale)
    kd, vd = k_buf.float() * k_scale, v_buf.float() * v_scale
    ref = decode_attention_ref(q, kd, vd, req_to_token, rows, seq, sm)
    torch.testing.assert_close(o, ref, atol=ATOL, rtol=RTOL)
    # ignoring the scales gives a different answer (the test would notice)
    o2 = torch.empty_like(o)
    decode_attention_fwd(q, k_buf, v_buf, o2, req_to_token, rows, seq, splits, max_splits,
                         logits, lse, sm)
    assert (o2 - ref).abs().max() > 0.1


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("h,hkv,lk,lv,mla", LAYOUTS)
def test_extend_reads_fp8_prefix(dtype, h, hkv, lk, lv, mla):
    """Prefix tokens come from the fp8 pool (scaled), new tokens from the given fp32 k/v."""
    g = torch.Generator().manual_seed(2)
    k_scale, v_scale = (1.7, 1.7) if mla else (1.7, 0.3)
    prefix, extend = [0, 21, 40], [5, 17, 3]
    total = sum(prefix) + sum(extend)
    n_slots = total + 4
    k_buf, v_buf = _pool(n_slots, hkv, lk, lv, mla, dtype, k_scale, v_scale, g)
    t = sum(extend)
    q = torch.randn(t, h, lk, generator=g)
    k = torch.randn(t, hkv, lk, generator=g)
    v = k[..., :lv] if mla else torch.randn(t, hkv, lv, generator=g)
    perm = torch.randperm(n_slots - 1, generator=g) + 1
    req_to_token = torch.zeros(3, 64, dtype=torch.int32)
    rows = torch.tensor([1, 2, 0])
    kd = k_buf.float() * k_scale  # the reference's pool: dequantized prefix + exact new rows
    vd = kd[..., :lv] if mla else v_buf.float() * v_scale
    off, start, starts = 0, 0, []
    for i, r in enumerate(rows.tolist()):
        n = prefix[i] + extend[i]
        s = perm[off:off + n]
        off += n
        req_to_token[r, :n] = s.to(torch.int32)
        kd[s[prefix[i]:]] = k[start:start + extend[i]]
        if not mla:
            vd[s[prefix[i]:]] = v[start:start + extend[i]]
        starts.append(start)
        start += extend[i]
    o = torch.full((t, h, lv), float("nan"))
    args = (req_to_token, rows, torch.tensor(prefix), torch.tensor(extend),
            torch.tensor(starts), max(extend), 0.125)
    extend_attention_fwd(q, k, v, o, k_buf, v_buf, *args, k_scale, v_scale)
    ref = extend_attention_ref(q, kd, vd, req_to_token, rows, torch.tensor(prefix),
                               torch.tensor(extend), 0.125)
    torch.testing.assert_close(o, ref, atol=ATOL, rtol=RTOL)
    o2 = torch.empty_like(o)
    extend_attention_fwd(q, k, v, o2, k_buf, v_buf, *args)  # scales ignored: noticeably off
    assert (o2 - ref).abs().max() > 0.1


@pytest.mark.parametrize("h,hkv,lk,lv,mla", LAYOUTS)
def test_bf16_q_over_fp8_pool_runs_the_products_in_fp16(h, hkv, lk, lv, mla):
    """A bf16 q over an e4m3 pool: decode rounds q to fp16 (`decode_attention.mma_operand`,
    saturating: a q element of 1e6 acts as 65504, where bf16 -> fp16 without saturation would
    give inf and NaN outputs) and converts the tiles to fp16. Against the reference on the
    dequantized pool with that clamped q; bf16-level tolerance (p is rounded to 16 bits before
    P·V). (The extend kernel's prefix phase does the same, but its phase 2 multiplies bf16
    tiles, which triton's interpreter computes wrongly — errors of ~1e8 with a bf16 pool too —
    so that path is checked on the GPU, `tests/model_executor/test_fp8_gpu.py`.)"""
    g = torch.Generator().manual_seed(3)
    dtype, k_scale, v_scale = torch.float8_e4m3fn, 0.37, (0.37 if mla else 2.5)
    seq_lens = [1, 33, 70]
    k_buf, v_buf, req_to_token, rows = _decode_pool(seq_lens, hkv, lk, lv, mla, dtype, k_scale,
                                                    v_scale, g)
    kd, vd = k_buf.float() * k_scale, v_buf.float() * v_scale
    bs = len(seq_lens)
    q = torch.randn(bs, h, lk, generator=g).to(torch.bfloat16)
    q[1, 0, 3] = 1e6  # beyond fp16: saturated
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    splits = get_num_kv_splits(seq, num_head_programs(h, hkv, lv), 4, 8)
    o = torch.full((bs, h, lv), float("nan"))
    sm = lk ** -0.5
    decode_attention_fwd(q, k_buf, v_buf, o, req_to_token, rows, seq, splits, 4,
                         torch.empty(bs, h, 4, lv), torch.empty(bs, h, 4), sm, k_scale, v_scale)
    ref = decode_attention_ref(q.float().clamp(-65504, 65504), kd, vd, req_to_token, rows, seq,
                               sm)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, ref, atol=2e-2, rtol=2e-2)
