"""Common layers vs Hugging Face / plain-torch references (fp32 unless stated)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from mla_backend.layers.activation import SiluAndMul
from mla_backend.layers.layernorm import RMSNorm
from mla_backend.layers.linear import MergedLinear, QKVLinear, ReplicatedLinear
from mla_backend.layers.logits import LMHead, VocabEmbedding
from mla_backend.layers.rotary_embedding import (
    Llama3RotaryEmbedding,
    RotaryEmbedding,
    get_rope,
    rope_params_from_config,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ RMSNorm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf(dtype):
    g = _gen()
    ours, ref = RMSNorm(48, eps=1e-5), LlamaRMSNorm(48, eps=1e-5)
    w = 1 + 0.3 * torch.randn(48, generator=g)
    ours.weight.data.copy_(w)
    ref.weight.data.copy_(w)
    ours, ref = ours.to(dtype), ref.to(dtype)
    x = (3 * torch.randn(7, 48, generator=g)).to(dtype)
    torch.testing.assert_close(ours(x), ref(x), atol=0, rtol=0)


def test_rmsnorm_fused_residual():
    g = _gen(1)
    norm = RMSNorm(32, eps=1e-6)
    norm.weight.data.copy_(torch.rand(32, generator=g) + 0.5)
    x, res = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g)
    out, new_res = norm(x, res)
    s = (x + res).double()
    want = norm.weight.double() * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(new_res, x + res, atol=0, rtol=0)
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------ activation
def test_silu_and_mul():
    x = torch.randn(4, 3, 10, generator=_gen(2))
    gate, up = x[..., :5], x[..., 5:]
    want = gate.double() / (1 + torch.exp(-gate.double())) * up.double()
    torch.testing.assert_close(SiluAndMul()(x).double(), want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError):
        SiluAndMul()(torch.zeros(2, 3))


# ------------------------------------------------------------------ linear
def test_qkv_linear_loads_shards_and_matches_separate_projections():
    g = _gen(3)
    hidden, hd, nh, nkv = 24, 8, 4, 2
    wq, wk, wv = (torch.randn(n * hd, hidden, generator=g) for n in (nh, nkv, nkv))
    bq, bk, bv = (torch.randn(n * hd, generator=g) for n in (nh, nkv, nkv))
    layer = QKVLinear(hidden, hd, nh, nkv, bias=True)
    for shard, w, b in (("k", wk, bk), ("v", wv, bv), ("q", wq, bq)):  # any order
        layer.weight_loader(layer.weight, w, shard)
        layer.weight_loader(layer.bias, b, shard)
    x = torch.randn(6, hidden, generator=g)
    q, k, v = layer(x).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    torch.testing.assert_close(q, F.linear(x, wq, bq))
    torch.testing.assert_close(k, F.linear(x, wk, bk))
    torch.testing.assert_close(v, F.linear(x, wv, bv))
    with pytest.raises(ValueError):
        layer.weight_loader(layer.weight, torch.zeros(nh * hd + 1, hidden), "q")
    with pytest.raises(KeyError):
        layer.weight_loader(layer.weight, wq, "z")


def test_merged_and_replicated_linear():
    g = _gen(4)
    gate, up = torch.randn(10, 6, generator=g), torch.randn(10, 6, generator=g)
    layer = MergedLinear(6, [10, 10], shard_names=("gate", "up"))
    layer.weight_loader(layer.weight, up, "up")
    layer.weight_loader(layer.weight, gate, "gate")
    x = torch.randn(3, 6, generator=g)
    torch.testing.assert_close(layer(x), torch.cat([x @ gate.T, x @ up.T], dim=-1))
    rep = ReplicatedLinear(6, 4)
    assert rep.bias is None
    with pytest.raises(ValueError):
        rep.weight_loader(rep.weight, torch.zeros(6, 4))


# ------------------------------------------------------------------ rotary
def _hf_rope(cfg: LlamaConfig, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor):
    # HF layout: q [1, H, T, D]
    rope = LlamaRotaryEmbedding(cfg)
    cos, sin = rope(q.transpose(0, 1).unsqueeze(0), pos.unsqueeze(0))
    qh, kh = apply_rotary_pos_emb(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                  cos, sin)
    return qh[0].transpose(0, 1), kh[0].transpose(0, 1)


@pytest.mark.parametrize("scaling", [None, "llama3", "linear"])
def test_rotary_neox_matches_hf(scaling):
    g = _gen(5)
    hd, max_pos = 32, 512
    rope_scaling = {
        None: None,
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        "linear": {"rope_type": "linear", "factor": 2.0},
    }[scaling]
    cfg = LlamaConfig(hidden_size=4 * hd, num_attention_heads=4, max_position_embeddings=max_pos,
                      rope_theta=5000.0, rope_scaling=rope_scaling)
    theta, parsed = rope_params_from_config(cfg)
    assert theta == 5000.0
    rope = get_rope(hd, hd, max_pos, theta, True, parsed)
    if scaling == "llama3":
        assert isinstance(rope, Llama3RotaryEmbedding)
    pos = torch.tensor([0, 1, 5, 63, 64, 100, 511])
    q, k = torch.randn(7, 4, hd, generator=g), torch.randn(7, 2, hd, generator=g)
    oq, ok = rope(pos, q.reshape(7, -1), k)  # flat q and 3-d k are both accepted
    rq, rk = _hf_rope(cfg, q, k, pos)
    torch.testing.assert_close(oq.reshape(7, 4, hd), rq, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(ok, rk, atol=2e-6, rtol=1e-5)


def test_rotary_gptj_and_partial_vs_complex_reference():
    g = _gen(6)
    hd, rd, base = 16, 8, 10000.0
    rope = RotaryEmbedding(hd, rd, 64, base, is_neox_style=False)
    pos = torch.tensor([0, 3, 17, 63])
    q, k = torch.randn(4, 3, hd, generator=g), torch.randn(4, 1, hd, generator=g)
    oq, ok = rope(pos, q, k)
    inv = 1.0 / base ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    rot = torch.polar(torch.ones(4, rd // 2, dtype=torch.float64), pos[:, None].double() * inv)
    for x, o in ((q, oq), (k, ok)):
        pairs = x[..., :rd].double().reshape(*x.shape[:2], rd // 2, 2).contiguous()
        xc = torch.view_as_complex(pairs)
        want = torch.view_as_real(xc * rot[:, None, :]).flatten(-2)
        torch.testing.assert_close(o[..., :rd].double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(o[..., rd:], x[..., rd:], atol=0, rtol=0)  # pass-through


def test_rotary_rejects_bad_dims_and_unknown_type():
    with pytest.raises(ValueError):
        RotaryEmbedding(16, 7, 8, 10000.0)
    with pytest.raises(ValueError):
        get_rope(16, 16, 8, 10000.0, True, {"rope_type": "dynamic", "factor": 2.0})


def test_rope_params_legacy_fields():
    class Legacy:
        rope_theta = 500000.0
        rope_scaling = None

    assert rope_params_from_config(Legacy()) == (500000.0, None)


# ------------------------------------------------------------------ embedding / lm head
def test_lm_head_tied_and_untied():
    g = _gen(7)
    emb = VocabEmbedding(11, 5)
    emb.weight.data.copy_(torch.randn(11, 5, generator=g))
    tied = LMHead(11, 5, tied_to=emb)
    assert tied.weight is emb.weight
    h = torch.randn(3, 5, generator=g)
    torch.testing.assert_close(tied(h), h @ emb.weight.T)
    ids = torch.tensor([0, 10, 3])
    torch.testing.assert_close(emb(ids), emb.weight[ids])
    untied = LMHead(11, 5).to(torch.bfloat16)
    untied.weight.data.copy_(torch.randn(11, 5, generator=g))
    assert untied(h.to(torch.bfloat16)).dtype == torch.float32
    assert not math.isnan(float(untied(h.to(torch.bfloat16)).sum()))


def test_router_gate_keeps_fp32_under_a_bf16_default_dtype():
    from mla_backend.layers.moe import DeepseekV2MoE

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as the model runner builds a bf16 model
    try:
        moe = DeepseekV2MoE(32, 16, n_routed_experts=8, num_experts_per_tok=2)
    finally:
        torch.set_default_dtype(old)
    gate = moe.gate
    assert gate.weight.dtype == torch.float32
    w = torch.randn(8, 32).to(torch.bfloat16)
    gate.weight_loader(gate.weight, w)  # a bf16 checkpoint: exact in fp32
    assert torch.equal(gate.weight, w.float())
    x = torch.randn(3, 32).to(torch.bfloat16)
    logits = gate(x)
    assert logits.dtype == torch.float32
    # DeepSeek's MoEGate: F.linear(x.float(), weight.float())
    assert torch.equal(logits, F.linear(x.float(), w.float()))


def _router(weight: torch.Tensor):
    from mla_backend.layers.moe import RouterGate

    gate = RouterGate(weight.shape[1], weight.shape[0])
    gate.weight_loader(gate.weight, weight)
    return gate


def test_router_gate_16bit_weight_only_when_exact():
    w = torch.randn(8, 32, generator=_gen(1)).to(torch.bfloat16)
    gate = _router(w)
    gate.prepare_16bit(torch.bfloat16)
    assert gate.weight_16 is not None and gate.weight_16.dtype == torch.bfloat16
    assert torch.equal(gate.weight_16, w)
    gate.prepare_16bit(torch.float32)  # an fp32 model keeps only the fp32 weight
    assert gate.weight_16 is None
    inexact = w.float()
    inexact[3, 5] += 2.0 ** -20  # not a bf16 value
    gate = _router(inexact)
    gate.prepare_16bit(torch.bfloat16)
    assert gate.weight_16 is None
    # Off CUDA the fp32 GEMM runs whatever weight_16 holds: bit for bit DeepSeek's MoEGate.
    gate = _router(w)
    gate.prepare_16bit(torch.bfloat16)
    x = torch.randn(5, 32, generator=_gen(2)).to(torch.bfloat16)
    assert torch.equal(gate(x), F.linear(x.float(), w.float()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_router_gate_16bit_gemm_on_cuda_matches_the_fp32_gemm():
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(64, 2048, generator=g) / 45).to(torch.bfloat16)
    gate = _router(w).cuda()
    gate.prepare_16bit(torch.bfloat16)
    assert gate.weight_16 is not None and gate.weight_16.is_cuda
    for rows in (2, 97, 512):
        x = torch.randn(rows, 2048, generator=g).to(torch.bfloat16).cuda()
        got = gate(x)
        want = F.linear(x.float(), w.float().cuda())  # fp32 GEMM (TF32 off by default)
        assert got.dtype == torch.float32 and got.shape == (rows, 64)
        # exact products, fp32 sums in another order: ~1e-7 relative to the row's scale
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 1e-5, (rows, err)
