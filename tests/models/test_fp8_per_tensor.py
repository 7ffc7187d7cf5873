"""Per-tensor FP8 linears (`Fp8LinearMethod`): online quantization (`quantization="fp8"`) and
per-tensor FP8 checkpoints (vLLM / ModelOpt format, written by `fp8_per_tensor_ckpt`), on the tiny
Llama (ModelRunner, torch_native attention) and the tiny DeepSeek-V2 (`DeepseekHarness`, absorbed
and decompressed paths), against the unquantized fp32 model.

Metric: relative RMS logit error ||fp8 - fp32|| / ||fp32|| over all prefill positions of the
prompts and the vocabulary; top-1 agreement over those positions (teacher forced).
Tolerances (set once from measurements, seed 0, prompts of 12/7/19 tokens):
- tiny Llama, init_std 0.05 (the factory's default 0.2 makes a chaotic random net whose FP8
  top-1 flips on noise: there per-tensor activations measured checkpoint top-1 0.763 and
  per-token 0.579 at nearly equal RMS error): REL_RMS 0.15, TOP1 0.75 (measured with per-token
  dynamic activations: online 0.066 / 0.842, checkpoint 0.070 / 0.868; with one scale per
  tensor: 0.072 / 0.842 and 0.076 / 0.763), checkpoint vs online 0.1 (measured 0.048).
- tiny DeepSeek-V2, absorbed and decompressed: REL_RMS 0.02, TOP1 0.95 (measured online
  0.0049-0.0052 / 1.0, checkpoint 0.0050-0.0053 / 1.0 with bf16/fp32 routed experts; with the
  routed experts FP8 per expert per tensor too: online 0.0052-0.0055, checkpoint 0.0053-0.0055,
  top-1 1.0), checkpoint vs online 0.01 (measured 0.0024-0.0032, with FP8 experts
  0.0032-0.0035; they differ only where per-shard scales are requantized to their max, and
  where the checkpoint's FP8 experts, dequantized at load, are requantized per expert).
Sensitivity: the Llama checkpoint with `weight_scale` (and the rowwise GEMM's copy of it,
`weight_scale_row`) forced to 1 (scale ignored; stored fp8 values are W / (amax/448), far too
large) gives relative RMS 1.38, outside REL_RMS.
"""

from __future__ import annotations

import pytest
import torch
from deepseek_harness import DeepseekHarness
from fp8_per_tensor_ckpt import write_fp8_per_tensor_copy
from test_llama import make_runner, new_seq, release, step

from mla_backend.config import ConfigError, EngineConfig
from mla_backend.forward_batch import ForwardMode
from mla_backend.layers.quantization import Fp8LinearMethod

LLAMA_REL_RMS, LLAMA_TOP1, LLAMA_CKPT_ONLINE = 0.15, 0.75, 0.1
DS_REL_RMS, DS_TOP1, DS_CKPT_ONLINE = 0.02, 0.95, 0.01
LENS = (12, 7, 19)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENS]


def _err(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    rel = float((a - ref).norm() / ref.norm())
    top1 = float((a.argmax(-1) == ref.argmax(-1)).float().mean())
    return rel, top1


# ---------------------------------------------------------------------------- Llama
def _llama_logits(path: str, prompts, **settings) -> tuple[torch.Tensor, object]:
    runner = make_runner(path, attention_backend="torch_native", **settings)
    seqs = [new_seq(runner, p) for p in prompts]
    logits = step(runner, seqs, ForwardMode.EXTEND, return_all_logits=True)
    release(runner, seqs)
    return logits, runner


@pytest.fixture(scope="module")
def llama(tiny_llama_factory, tmp_path_factory):
    path = tiny_llama_factory(seed=0, init_std=0.05)
    prompts = _prompts(256)
    ref, _ = _llama_logits(path, prompts)
    online, runner = _llama_logits(path, prompts, quantization="fp8")
    ckpt = write_fp8_per_tensor_copy(path, str(tmp_path_factory.mktemp("llama_fp8")))
    return path, ckpt, prompts, ref, online, runner


def test_llama_online_fp8_close_to_fp32(llama):
    _, _, _, ref, online, runner = llama
    linears = [m for m in runner.model.modules() if hasattr(m, "quant_method")]
    assert linears and all(isinstance(m.quant_method, Fp8LinearMethod) for m in linears)
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.weight_scale.dim() == 0
               for m in linears)
    assert runner.model.lm_head.weight.dtype == torch.float32
    rel, top1 = _err(online, ref)
    print(f"llama online: rel {rel:.4f} top1 {top1:.3f}")
    assert rel <= LLAMA_REL_RMS and top1 >= LLAMA_TOP1
    assert rel > 1e-4  # really quantized


def test_llama_fp8_checkpoint_matches_online(llama):
    _, ckpt, prompts, ref, online, _ = llama
    got, runner = _llama_logits(ckpt, prompts)
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, Fp8LinearMethod) and qkv.weight_scale.dim() == 0
    rel, top1 = _err(got, ref)
    rel_on, _ = _err(got, online)
    print(f"llama ckpt: rel {rel:.4f} top1 {top1:.3f} vs online {rel_on:.4f}")
    assert rel <= LLAMA_REL_RMS and top1 >= LLAMA_TOP1
    assert rel_on <= LLAMA_CKPT_ONLINE


def test_llama_fp8_checkpoint_scale_ignored_is_caught(llama):
    _, ckpt, prompts, ref, _, _ = llama
    runner = make_runner(ckpt, attention_backend="torch_native")
    for m in runner.model.modules():
        if isinstance(getattr(m, "quant_method", None), Fp8LinearMethod):
            m.weight_scale.data.fill_(1.0)
            m.weight_scale_row.data.fill_(1.0)
    seqs = [new_seq(runner, p) for p in prompts]
    got = step(runner, seqs, ForwardMode.EXTEND, return_all_logits=True)
    rel, _ = _err(got, ref)
    print(f"llama scale ignored: rel {rel}")
    assert not rel <= LLAMA_REL_RMS  # NaN counts as caught too


def test_llama_norms_hand_fp8_inputs_to_the_linears(llama, monkeypatch):
    """Online FP8: qkv_proj and gate_up_proj take their input quantized by the norm before
    them (`RMSNorm.prenorm`), down_proj by the SiLU-and-mul (`SiluAndMul.forward_fp8`): those
    FP8 GEMMs get an x_fp8, and the logits equal, bit for bit, those of the same model where
    each linear quantizes its own input."""
    import mla_backend.layers.quantization as quant
    from mla_backend.layers.activation import SiluAndMul
    from mla_backend.layers.layernorm import RMSNorm

    path, _, prompts, _, _, runner = llama
    layer = runner.model.model.layers[0]
    assert layer.self_attn.takes_fp8_input and layer.mlp.takes_fp8_input
    handed = []
    real_mm = quant.fp8_per_token_mm
    monkeypatch.setattr(quant, "fp8_per_token_mm",
                        lambda *a, **kw: handed.append(kw.get("x_fp8") is not None)
                        or real_mm(*a, **kw))
    got, runner = _llama_logits(path, prompts, quantization="fp8")
    n_layers = len(runner.model.model.layers)
    # per layer: qkv (the norm's), o_proj (quantizes the attention output itself), gate_up
    # (the norm's), down (the SiLU-and-mul's)
    assert handed == [True, False, True, True] * n_layers
    real = RMSNorm.prenorm
    monkeypatch.setattr(RMSNorm, "prenorm", lambda self, x, r, fp8=False: real(self, x, r, False))
    monkeypatch.setattr(SiluAndMul, "forward_fp8", lambda self, x: (self(x), None))
    handed.clear()
    own, _ = _llama_logits(path, prompts, quantization="fp8")
    assert handed == [False] * 4 * n_layers
    assert torch.equal(got, own)


def test_quantization_setting_validated():
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig.create(model_path="x", quantization="int8")


# ---------------------------------------------------------------------------- DeepSeek-V2
class _Harness(DeepseekHarness):
    """DeepseekHarness with an engine `quantization` setting."""

    def __init__(self, path: str, quantization: str = "", **kw) -> None:
        import deepseek_harness
        from mla_backend.config import ModelConfig

        real = deepseek_harness.ModelConfig

        def mc(**a):
            return ModelConfig(quantization=quantization, **a)

        deepseek_harness.ModelConfig = mc
        try:
            super().__init__(path, **kw)
        finally:
            deepseek_harness.ModelConfig = real


def _ds_logits(path: str, prompts, decompress: bool, quantization: str = ""):
    h = _Harness(path, quantization, decompress_min_tokens=1 if decompress else 10**6)
    logits = h.step([h.new_seq(p) for p in prompts], ForwardMode.EXTEND)
    assert h.last_path == ("decompressed" if decompress else "absorbed")
    return logits, h


@pytest.fixture(scope="module")
def deepseek(tiny_deepseek_factory, tmp_path_factory):
    path = tiny_deepseek_factory(seed=0)
    h = _Harness(path)
    prompts = _prompts(h.hf_config.vocab_size)
    ckpt = write_fp8_per_tensor_copy(path, str(tmp_path_factory.mktemp("ds_fp8")))
    return path, ckpt, prompts


@pytest.mark.parametrize("decompress", [False, True], ids=["absorbed", "decompressed"])
def test_deepseek_online_and_checkpoint_fp8(deepseek, decompress):
    path, ckpt, prompts = deepseek
    ref, h_ref = _ds_logits(path, prompts, decompress)
    online, h = _ds_logits(path, prompts, decompress, "fp8")
    attn = h.model.model.layers[0].self_attn
    assert isinstance(attn.kv_b_proj.quant_method, Fp8LinearMethod)
    for m in h.model.modules():  # routed experts: FP8 per expert per tensor (router fp32)
        if type(m).__name__ == "StackedExperts":
            assert m.w13_weight.dtype == m.w2_weight.dtype == torch.float8_e4m3fn
            assert m.w13_weight_scale.shape == m.w2_weight_scale.shape == (m.num_experts,)
    got, hc = _ds_logits(ckpt, prompts, decompress)
    assert isinstance(hc.model.model.layers[0].self_attn.o_proj.quant_method, Fp8LinearMethod)
    for m in hc.model.modules():  # checkpoint experts: dequantized at load, requantized per expert
        if type(m).__name__ == "StackedExperts":
            assert m.w13_weight.dtype == torch.float8_e4m3fn
    rel_o, top_o = _err(online, ref)
    rel_c, top_c = _err(got, ref)
    rel_co, _ = _err(got, online)
    print(f"deepseek decompress={decompress}: online rel {rel_o:.4f} top1 {top_o:.3f}; "
          f"ckpt rel {rel_c:.4f} top1 {top_c:.3f}; ckpt vs online {rel_co:.4f}")
    assert rel_o <= DS_REL_RMS and top_o >= DS_TOP1 and rel_o > 1e-4
    assert rel_c <= DS_REL_RMS and top_c >= DS_TOP1
    assert rel_co <= DS_CKPT_ONLINE
