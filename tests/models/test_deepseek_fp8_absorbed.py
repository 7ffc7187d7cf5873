"""FP8 absorbed MLA matrices: with per-tensor FP8 linears (online quantization="fp8" or a
per-tensor FP8 checkpoint), `w_kc`/`w_vc` are float8_e4m3fn (one per-tensor
scale each, amax/448 of the dequantized kv_b_proj parts, column-major per head) and the absorbed
products run as `fp8_per_tensor_bmm` (dynamic per-tensor activation scale, `torch._scaled_mm` per
head); without them (unquantized; block-FP8 for now, pinned by test_deepseek_v3_fp8) they are
unchanged.

Tolerances (set once from measurements, seed 0):
- `fp8_per_tensor_bmm` vs its float32 twin `reference.bmm_fp8_ref` (same quantized
  operands): max |diff| <= BMM_ATOL + BMM_RTOL |ref| (1e-4 / 1e-5; measured <= 1.8e-7);
  vs the unquantized fp32 bmm: relative RMS <= BMM_REL_FP32 = 0.08 (measured 0.037-0.045).
- tiny DeepSeek-V2 with quantization="fp8", all prefill logits of prompts of 12/7/19 tokens
  (relative RMS ||a - b|| / ||b||, top-1 agreement):
  absorbed (FP8 w_kc/w_vc) vs decompressed (FP8 kv_b_proj): REL_PATHS = 0.02, TOP1 >= 0.95
  (measured 0.0044 / 1.0; decompressed vs fp32 0.0052); absorbed FP8 vs the unquantized fp32
  model: REL_FP32 = 0.02, TOP1 >= 0.95 (measured 0.0055 / 1.0).
Sensitivity: forcing `w_kc_scale` or `w_vc_scale` to 1 (scale ignored) gives relative RMS
0.127 (w_kc) / 1.40 (w_vc) vs fp32, outside REL_FP32 = 0.02.
"""

from __future__ import annotations

import pytest
import torch
from fp8_per_tensor_ckpt import write_fp8_per_tensor_copy
from test_fp8_per_tensor import _err, _Harness, _prompts

from mla_backend.forward_batch import ForwardMode
from mla_backend.layers.quantization import (
    FP8_E4M3,
    fp8_per_tensor_bmm,
    quantize_fp8_bmm_weight,
)
from mla_kernels.reference import bmm_fp8_ref

BMM_ATOL, BMM_RTOL, BMM_REL_FP32 = 1e-4, 1e-5, 0.08
REL_PATHS, REL_FP32, TOP1 = 0.02, 0.02, 0.95


# ---------------------------------------------------------------------------- the function
@pytest.mark.parametrize("shape", [(4, 7, 16, 32), (3, 1, 48, 16), (2, 33, 32, 64)])
def test_fp8_bmm_matches_reference(shape):
    h, m, k, n = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, h, k + 5, generator=g)[..., :k].transpose(0, 1)  # strided, like q_nope
    wf = torch.randn(h, k, n, generator=g) * 0.05
    w, ws = quantize_fp8_bmm_weight(wf)
    assert w.dtype == FP8_E4M3 and w.shape == (h, k, n) and w[0].stride() == (1, k)
    assert torch.isclose(ws, wf.abs().amax() / 448)
    y = fp8_per_tensor_bmm(x, w, ws)
    ref = bmm_fp8_ref(x, w, ws)
    assert y.shape == (h, m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, atol=BMM_ATOL, rtol=BMM_RTOL)
    rel = float((y - torch.bmm(x, wf)).norm() / torch.bmm(x, wf).norm())
    print(f"bmm {shape}: max|y-ref| {(y - ref).abs().max():.2e} rel vs fp32 {rel:.4f}")
    assert 1e-4 < rel <= BMM_REL_FP32
    yb = fp8_per_tensor_bmm(x.bfloat16(), w, ws)  # out dtype follows x
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), ref, atol=0.05, rtol=0.02)


def test_fp8_bmm_writes_a_strided_out():
    """out= a head-major view of token-major storage with padding columns (as the absorbed
    query's first kv_lora columns): the same values as without out, written in out's dtype,
    the padding untouched; a wrong shape is a ValueError."""
    h, m, k, n = 3, 5, 16, 24
    g = torch.Generator().manual_seed(2)
    x = torch.randn(h, m, k, generator=g)
    w, ws = quantize_fp8_bmm_weight(torch.randn(h, k, n, generator=g) * 0.05)
    store = torch.full((m, h, n + 8), 7.0, dtype=torch.bfloat16)
    out = store[..., :n].transpose(0, 1)  # [h, m, n], strides (n + 8, h * (n + 8), 1)
    assert fp8_per_tensor_bmm(x, w, ws, out=out) is out
    torch.testing.assert_close(out.float(), fp8_per_tensor_bmm(x, w, ws).bfloat16().float())
    assert (store[..., n:] == 7.0).all()
    with pytest.raises(ValueError, match="expected"):
        fp8_per_tensor_bmm(x, w, ws, out=torch.empty(h, m, n + 1))


def test_fp8_bmm_saturates_never_nan():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 16, generator=g)
    x[0, 0, 0] = 1e30  # dynamic scale: huge but finite
    w, ws = quantize_fp8_bmm_weight(torch.randn(2, 16, 16, generator=g))
    y = fp8_per_tensor_bmm(x, w, ws)
    assert torch.isfinite(y).all()
    small = torch.tensor(1e-3)  # static scale far too small: |x| / scale >> 448 saturates
    y = fp8_per_tensor_bmm(x, w, ws, x_scale=small)
    ref = bmm_fp8_ref(x, w, ws, x_scale=small)
    assert torch.isfinite(y).all()
    x = torch.sign(x) * (1 + x.abs())  # |x| / small >= 1000: every element saturates
    y = fp8_per_tensor_bmm(x, w, ws, x_scale=small)
    ref = bmm_fp8_ref(x, w, ws, x_scale=small)
    assert torch.isfinite(y).all()
    sat = torch.bmm(torch.sign(x) * 448 * small, w.float() * ws)  # +-448 * scale, fp32
    torch.testing.assert_close(y, ref, atol=BMM_ATOL, rtol=BMM_RTOL)
    torch.testing.assert_close(ref, sat, atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------------------- tiny DeepSeek-V2
def _logits(h: _Harness, prompts) -> torch.Tensor:
    return h.step([h.new_seq(p) for p in prompts], ForwardMode.EXTEND)


@pytest.fixture(scope="module")
def ds(tiny_deepseek_factory):
    path = tiny_deepseek_factory(seed=0)
    ref_h = _Harness(path, decompress_min_tokens=10**6)
    prompts = _prompts(ref_h.hf_config.vocab_size)
    ref = _logits(ref_h, prompts)
    abs_h = _Harness(path, "fp8", decompress_min_tokens=10**6)
    absorbed = _logits(abs_h, prompts)
    assert abs_h.last_path == "absorbed"
    dec_h = _Harness(path, "fp8", decompress_min_tokens=1)
    decompressed = _logits(dec_h, prompts)
    assert dec_h.last_path == "decompressed"
    return path, prompts, ref_h, ref, abs_h, absorbed, decompressed


def test_absorbed_fp8_logits_within_tolerance(ds):
    _, _, _, ref, _, absorbed, decompressed = ds
    rel_p, top_p = _err(absorbed, decompressed)
    rel_r, top_r = _err(absorbed, ref)
    rel_d, _ = _err(decompressed, ref)
    print(f"absorbed vs decompressed: rel {rel_p:.4f} top1 {top_p:.3f}; absorbed vs fp32: rel "
          f"{rel_r:.4f} top1 {top_r:.3f}; decompressed vs fp32 rel {rel_d:.4f}")
    assert rel_p <= REL_PATHS and top_p >= TOP1
    assert rel_r <= REL_FP32 and top_r >= TOP1
    assert rel_p > 1e-5  # the absorbed path really is quantized differently


def test_w_kc_w_vc_dtypes(ds, tmp_path):
    path, _, ref_h, _, abs_h, _, _ = ds
    for layer in abs_h.model.model.layers:
        a = layer.self_attn
        h, nope, v, r = a.num_heads, a.qk_nope_head_dim, a.v_head_dim, a.kv_lora_rank
        assert a.w_kc.dtype == a.w_vc.dtype == FP8_E4M3
        assert a.w_kc.shape == (h, nope, r) and a.w_vc.shape == (h, r, v)
        assert a.w_kc[0].stride() == (1, nope) and a.w_vc[0].stride() == (1, r)  # column-major
        w = a.kv_b_proj.quant_method.dequantized_weight(a.kv_b_proj).view(h, nope + v, r)
        for q, s, wf in ((a.w_kc, a.w_kc_scale, w[:, :nope]),
                         (a.w_vc, a.w_vc_scale, w[:, nope:].transpose(1, 2))):
            assert s.dtype == torch.float32 and s.dim() == 0
            assert torch.isclose(s, wf.abs().amax() / 448)
            torch.testing.assert_close(q.float() * s, wf, atol=float(s) * 2**-9, rtol=0.07)
        # the dequantized copies that large CUDA batches multiply with (FP8_BMM_MAX_ROWS)
        for q, s, dq in ((a.w_kc, a.w_kc_scale, a.w_kc_dq), (a.w_vc, a.w_vc_scale, a.w_vc_dq)):
            assert dq.dtype == a.kv_a_layernorm.weight.dtype and dq.is_contiguous()
            assert torch.equal(dq, (q.float() * s).to(dq.dtype))
    for layer in ref_h.model.model.layers:  # unquantized: exactly as before
        a = layer.self_attn
        h, nope, v, r = a.num_heads, a.qk_nope_head_dim, a.v_head_dim, a.kv_lora_rank
        w = a.kv_b_proj.weight.view(h, nope + v, r)
        assert a.w_kc_scale is None and a.w_vc_scale is None
        assert a.w_kc_dq is None and a.w_vc_dq is None
        assert a.w_kc.dtype == a.w_vc.dtype == torch.float32
        assert a.w_kc.is_contiguous() and a.w_vc.is_contiguous()
        assert torch.equal(a.w_kc, w[:, :nope])
        assert torch.equal(a.w_vc, w[:, nope:].transpose(1, 2))
    ckpt_h = _Harness(write_fp8_per_tensor_copy(path, str(tmp_path)))  # per-tensor checkpoint
    a = ckpt_h.model.model.layers[0].self_attn
    assert a.w_kc.dtype == a.w_vc.dtype == FP8_E4M3 and a.w_kc_scale.dim() == 0


@pytest.mark.parametrize("which", ["w_kc_scale", "w_vc_scale"])
def test_ignored_scale_is_caught(ds, which):
    path, prompts, _, ref, _, _, _ = ds
    h = _Harness(path, "fp8", decompress_min_tokens=10**6)
    for layer in h.model.model.layers:
        getattr(layer.self_attn, which).fill_(1.0)
    rel, _ = _err(_logits(h, prompts), ref)
    print(f"{which} ignored: rel {rel}")
    assert not rel <= REL_FP32  # NaN counts as caught too
