"""FP8 paths on a CUDA GPU (marker `gpu`): the FP8 KV cache, online per-tensor
FP8 weights (linears, routed experts, absorbed w_kc/w_vc) and DeepSeek-V3's block-FP8 checkpoint,
through `ModelRunner` with the `triton` attention backend and CUDA graphs (decode steps replay a
graph), in bf16, against the same model in bf16 without FP8 (or, for the block-FP8 checkpoint,
the same code in fp32 on the CPU).

Protocol (as tests/model_executor/test_fp8_kv_cache.py): teacher-forced logits of 92 random tokens
fed as a 70-token prefill, a 10-token extend over the cached 70 and 12 decode steps. Metrics:
relative RMS error ||x - ref|| / ||ref|| over all 92 positions and the vocabulary, and top-1
agreement over the positions.

Tolerances: the CPU tests' (fp32) tolerances, widened for bf16 — the reference itself is bf16, and
the tiny models' logits move by ~1% between bf16 and fp32 (tests/test_engine_gpu.py):
- KV cache: DeepSeek REL 0.03, top-1 0.9; Llama (init_std 0.1) REL 0.2, top-1 0.75.
- online FP8 weights: DeepSeek REL 0.05, top-1 0.9; Llama REL 0.35, top-1 0.6.
- block-FP8 V3 (bf16) vs its dequantized fp32 twin on the GPU: REL 0.06, top-1 0.85 (the CPU
  test against HF on the twin measured 0.016-0.022).
The KV-cache figures measured on a GPU are in docs/benchmarks.md ("FP8 vs bf16"). The weight
and block-FP8 tests were corrected after their last GPU run and have not run on a GPU since.

    MLA_TEST_TOKENIZER_DIR=<SmolLM2 tokenizer folder> PYTHONPATH=. \
        python3 -m pytest -m gpu tests/model_executor/test_fp8_gpu.py -s
"""

from __future__ import annotations

import pytest
import torch
from fp8_kv_harness import teacher_forced_logits

from mla_backend.config import EngineConfig
from mla_backend.engine import Engine
from mla_backend.model_executor.model_runner import ModelRunner
from mla_backend.request import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CHUNKS, DECODE = (70, 10), 12
FP8 = torch.float8_e4m3fn


def _tokens(vocab: int) -> list[int]:
    return torch.randint(0, vocab, (sum(CHUNKS) + DECODE,),
                         generator=torch.Generator().manual_seed(0)).tolist()


def _runner(path: str, device: str = "cuda", dtype: str = "bfloat16", **kw) -> ModelRunner:
    return ModelRunner(EngineConfig.create(
        model_path=path, dtype=dtype, device=device, max_total_tokens=256, max_running_requests=4,
        attention_backend="triton" if device == "cuda" else "torch_native", **kw))


def _logits(r: ModelRunner) -> torch.Tensor:
    vocab = int(r.hf_config.vocab_size)
    return teacher_forced_logits(r, _tokens(vocab), CHUNKS, DECODE).float().cpu()


def _compare(got: torch.Tensor, ref: torch.Tensor, label: str) -> tuple[float, float]:
    assert torch.isfinite(got).all(), label
    rel = float((got - ref).norm() / ref.norm())
    top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"\n[fp8 gpu] {label}: relative RMS {rel:.4f}, top-1 agreement {top1:.3f}")
    return rel, top1


@pytest.fixture(scope="module")
def refs(deepseek, llama):
    out = {}
    for name, path in (("deepseek", deepseek), ("llama", llama)):
        r = _runner(path)
        assert r.cuda_graph_runner is not None  # decode steps below replay graphs
        out[name] = (path, _logits(r))
        del r
    return out


TOL = {"kv": {"deepseek": (0.03, 0.9), "llama": (0.2, 0.75)},
       "weights": {"deepseek": (0.05, 0.9), "llama": (0.35, 0.6)}}


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("name", ["deepseek", "llama"])
def test_fp8_kv_cache_on_gpu(refs, name, kv):
    path, ref = refs[name]
    r = _runner(path, kv_cache_dtype=kv)
    assert r.token_to_kv_pool.is_fp8
    rel, top1 = _compare(_logits(r), ref, f"{name} kv {kv}")
    tol_rel, tol_top1 = TOL["kv"][name]
    assert rel <= tol_rel and top1 >= tol_top1


@pytest.mark.parametrize("name", ["deepseek", "llama"])
def test_online_fp8_weights_on_gpu(refs, name):
    path, ref = refs[name]
    r = _runner(path, quantization="fp8")
    # The layers' matrices (embedding and LM head stay in the model dtype, as in vLLM; the tiny
    # models' 49k-token vocabulary makes those most of the parameters).
    mats = [(n, p) for n, p in r.model.named_parameters()
            if p.dim() >= 2 and "embed_tokens" not in n and "lm_head" not in n]
    n_fp8 = sum(p.numel() for _, p in mats if p.dtype == FP8)
    n_all = sum(p.numel() for _, p in mats)
    print(f"\n[fp8 gpu] {name}: {n_fp8 / n_all:.1%} of the layers' matrix elements are FP8")
    assert n_fp8 > 0.9 * n_all  # linears and routed experts; the MoE router stays unquantized
    rel, top1 = _compare(_logits(r), ref, f"{name} online fp8 weights")
    tol_rel, tol_top1 = TOL["weights"][name]
    assert rel <= tol_rel and top1 >= tol_top1


def test_fp8_absorbed_products_at_large_batches_use_the_dequantized_weights(refs, monkeypatch):
    """Above `FP8_BMM_MAX_ROWS` token rows the absorbed products run as 16-bit torch.bmm over
    w_kc_dq / w_vc_dq. The harness's absorbed calls have at most 10 rows, so the limit 0 sends
    every one there and None none but the one-row calls (bmm_gemv over the same weights): both
    stay within the online-FP8 tolerance of the bf16 model, close to each other, and not equal
    (the FP8 products quantize the activations)."""
    import mla_backend.models.deepseek_v2 as ds_mod

    path, ref = refs["deepseek"]
    got = {}
    for limit in (None, 0):
        monkeypatch.setattr(ds_mod, "FP8_BMM_MAX_ROWS", limit)
        got[limit] = _logits(_runner(path, quantization="fp8"))
        rel, top1 = _compare(got[limit], ref, f"deepseek online fp8, FP8_BMM_MAX_ROWS={limit}")
        assert rel <= TOL["weights"]["deepseek"][0] and top1 >= TOL["weights"]["deepseek"][1]
    rel, top1 = _compare(got[0], got[None], "dequantized vs FP8 absorbed products")
    assert 0 < rel <= 0.02 and top1 >= 0.9


def test_fp8_absorbed_products_at_one_row_run_bmm_gemv_over_the_dequantized_weights(
        refs, monkeypatch):
    """At one token row (decode at batch size 1) an FP8 model's absorbed products are one
    `bmm_gemv` launch each over w_kc_dq / w_vc_dq (no amax pass, no FP8 bmm), with the values of
    the fp32 product over the same weights within one bf16 rounding."""
    import mla_kernels.bmm_gemv as bmm_gemv_mod

    r = _runner(refs["deepseek"][0], quantization="fp8")
    a = r.model.model.layers[0].self_attn
    used = []
    real = bmm_gemv_mod.bmm_gemv
    monkeypatch.setattr(bmm_gemv_mod, "bmm_gemv",
                        lambda x, w, **kw: used.append(w) or real(x, w, **kw))
    g = torch.Generator(device="cuda").manual_seed(0)
    for w, scale, dq in ((a.w_kc, a.w_kc_scale, a.w_kc_dq), (a.w_vc, a.w_vc_scale, a.w_vc_dq)):
        assert w.dtype == FP8 and dq.dtype == torch.bfloat16
        h, k, n = dq.shape
        x = torch.randn(1, h, k, device="cuda", generator=g).bfloat16()
        out = torch.empty(1, h, n, device="cuda", dtype=torch.bfloat16)
        a._absorb_into(x, w, scale, out, dq)
        assert used and used[-1] is dq
        want = torch.einsum("thk,hkn->thn", x.float(), dq.float())
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=1.6e-2)
    assert len(used) == 2


def test_block_fp8_v3_on_gpu_close_to_dequantized(tiny_deepseek_v3_fp8_factory):
    fp8, dequantized = tiny_deepseek_v3_fp8_factory(seed=0)
    gpu = _runner(fp8)
    assert gpu.model.model.layers[1].self_attn.o_proj.weight.dtype == FP8
    assert gpu.model.model.layers[1].mlp.experts.w13_weight.dtype == FP8
    got = _logits(gpu)
    ref = _logits(_runner(dequantized, dtype="float32"))  # no FP8 anywhere
    rel, top1 = _compare(got, ref, "V3 block-FP8 (bf16) vs its dequantized twin (fp32)")
    assert rel <= 0.06 and top1 >= 0.85


def test_engine_fp8_weights_and_cache_serves(deepseek):
    """The whole engine (scheduler, graphs, sampler) with every FP8 option on: requests finish,
    the pool invariant holds, and the capacity at equal memory is ~2x the bf16 cache's."""
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
    eng = Engine(EngineConfig.create(model_path=deepseek, device="cuda", dtype="bfloat16",
                                     quantization="fp8", kv_cache_dtype="fp8_e4m3",
                                     max_total_tokens=4096))
    res = eng.generate(prompts, sp)
    assert all(r.error is None and len(r.token_ids) == 24 for r in res)
    eng.check_invariant()
    pool = eng.runner.token_to_kv_pool
    bf16 = _runner(deepseek).token_to_kv_pool
    assert pool.cell_bytes() * 2 == bf16.cell_bytes()
