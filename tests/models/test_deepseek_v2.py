"""DeepSeek-V2 (MLA + MoE + YaRN) against Hugging Face transformers, and its three attention paths
against each other. fp32 on CPU, tiny random checkpoints from `mla_tools/tiny_deepseek.py`.

Tolerance for logits: atol 2e-4, rtol 1e-4 (logits have std ~3; observed max differences to HF
~7e-6). Greedy runs compare token ids exactly and the logits of every step; each step's top-2
logit gap is checked to be > 1e-4 (>10x the observed error), so equality is not luck on a tie.
"""

from __future__ import annotations

import pytest
import torch
from deepseek_harness import DeepseekHarness
from transformers import AutoModelForCausalLM

from mla_backend.forward_batch import ForwardMode

ATOL, RTOL = 2e-4, 1e-4

# Small but complete: 1 dense + 2 MoE layers, YaRN factor 40 (defaults of tiny_deepseek).
SMALL = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             num_hidden_layers=3, num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
             n_shared_experts=1)

VARIANTS = {
    "greedy_yarn": {},
    "q_lora": dict(q_lora_rank=48),
    "group_limited": dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                          routed_scaling_factor=2.5, q_lora_rank=40),
    "no_rope_scaling": dict(rope_scaling=None, num_experts_per_tok=3),
    # cos/sin magnitude mscale(40, 1.0) / mscale(40, 0.6) != 1 and softmax factor mscale(40, 0.6)^2
    "yarn_mscale_ratio": dict(rope_scaling={"type": "yarn", "factor": 40,
                                            "original_max_position_embeddings": 4096,
                                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                            "mscale_all_dim": 0.6}),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_intra_op_thread):
    """Tiny matmuls: see tests/models/conftest.py."""


def _prompts(vocab: int, lens: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def _hf(path: str):
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    m.eval()
    return m


def _check_gap(logits: torch.Tensor, min_gap: float = 1e-4) -> None:
    top2 = logits.float().topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1]).min().item()
    assert gap > min_gap, f"near-tie in greedy choice (gap {gap:.2e}); pick another seed"


@torch.inference_mode()
def _hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0,
                      output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.scores, dim=1)[0]


def assert_greedy_matches_hf(hf, prompts: list[list[int]], new_tokens: list[list[int]],
                             step_logits: list[torch.Tensor]) -> None:
    """Each prompt's greedy tokens equal HF's, its step logits within ATOL/RTOL, and HF's own
    top-2 gaps are large enough for the comparison to mean something."""
    for i, p in enumerate(prompts):
        ref_tokens, ref_scores = _hf_greedy(hf, p, len(new_tokens[i]))
        assert new_tokens[i] == ref_tokens
        torch.testing.assert_close(step_logits[i], ref_scores, atol=ATOL, rtol=RTOL)
        _check_gap(ref_scores)


def assert_absorbed_matches_hf(h, hf, prompts: list[list[int]], lens: tuple[int, ...],
                               n: int = 32) -> None:
    """Harness `h` (absorbed path) vs HF `hf`: ragged-batch prefill logits, then `n` greedy tokens
    and their step logits per prompt, within ATOL/RTOL; the continuations are not all equal."""
    new_tokens, prefill, step_logits = h.greedy(prompts, max_new_tokens=n)
    assert h.last_path == "absorbed"
    start = 0
    with torch.inference_mode():
        for p, k in zip(prompts, lens):
            ref = hf(torch.tensor([p])).logits[0]
            torch.testing.assert_close(prefill[start:start + k], ref, atol=ATOL, rtol=RTOL)
            start += k
    assert_greedy_matches_hf(hf, prompts, new_tokens, step_logits)
    # The model is not degenerate: the greedy continuations differ between prompts.
    assert len({tuple(t) for t in new_tokens}) > 1


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_hf_prefill_and_greedy(tiny_deepseek_factory, variant):
    path = tiny_deepseek_factory(seed=1, **{**SMALL, **VARIANTS[variant]})
    hf = _hf(path)
    vocab = hf.config.vocab_size
    lens = (5, 17, 1, 11)
    prompts = _prompts(vocab, lens, seed=2)
    h = DeepseekHarness(path, decompress_min_tokens=10**9)  # absorbed everywhere
    assert_absorbed_matches_hf(h, hf, prompts, lens)


def test_default_tiny_config_matches_hf(tiny_deepseek_factory):
    """`deepseek-v2-tiny` as shipped (hidden 256, 4 layers, 8 heads, kv_lora 128, YaRN)."""
    path = tiny_deepseek_factory(seed=0)
    hf = _hf(path)
    prompts = _prompts(hf.config.vocab_size, (9, 3), seed=5)
    h = DeepseekHarness(path, decompress_min_tokens=8)  # decompressed prefill, absorbed decode
    new_tokens, prefill, step_logits = h.greedy(prompts, max_new_tokens=32)
    with torch.inference_mode():
        ref = hf(torch.tensor([prompts[0]])).logits[0]
    torch.testing.assert_close(prefill[:9], ref, atol=ATOL, rtol=RTOL)
    assert_greedy_matches_hf(hf, prompts, new_tokens, step_logits)


def test_absorbed_decompressed_mha_agree(tiny_deepseek_factory):
    path = tiny_deepseek_factory(seed=3, **SMALL, q_lora_rank=48)
    prompts = _prompts(49152, (12, 30, 7), seed=4)
    absorbed = DeepseekHarness(path, decompress_min_tokens=10**9)
    decompressed = DeepseekHarness(path, decompress_min_tokens=1)
    mha = DeepseekHarness(path, disable_mla=True)
    assert mha.model.kv_pool_layout() == {"kind": "mha", "num_layers": 3, "num_kv_heads": 4,
                                          "head_dim": 24, "v_head_dim": 16}
    assert absorbed.model.kv_pool_layout() == {"kind": "mla", "num_layers": 3,
                                               "kv_lora_rank": 32, "qk_rope_head_dim": 8}
    results = {}
    for name, h in (("absorbed", absorbed), ("decompressed", decompressed), ("mha", mha)):
        seqs = [h.new_seq(p) for p in prompts]
        logits = h.step(seqs, ForwardMode.EXTEND)
        assert h.last_path == name
        results[name] = logits
    torch.testing.assert_close(results["decompressed"], results["absorbed"], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(results["mha"], results["absorbed"], atol=ATOL, rtol=RTOL)
    # The decompressed prefill still wrote the latent (c_KV ‖ rotated k_pe), identical to the
    # absorbed path's, so decode after it can absorb.
    for layer in range(3):
        torch.testing.assert_close(decompressed.kv_pool.get_key_buffer(layer),
                                   absorbed.kv_pool.get_key_buffer(layer), atol=1e-5, rtol=1e-5)
    assert decompressed.kv_pool.get_key_buffer(0)[1:50].abs().sum() > 0

    runs = {}
    for name, kwargs in (("absorbed", dict(decompress_min_tokens=10**9)),
                         ("decompressed", dict(decompress_min_tokens=1)),
                         ("mha", dict(disable_mla=True))):
        tokens, _, step_logits = DeepseekHarness(path, **kwargs).greedy(prompts, 32)
        runs[name] = (tokens, step_logits)
    assert runs["absorbed"][0] == runs["decompressed"][0] == runs["mha"][0]
    for name in ("decompressed", "mha"):
        torch.testing.assert_close(runs[name][1], runs["absorbed"][1], atol=ATOL, rtol=RTOL)
    _check_gap(runs["absorbed"][1])


@pytest.mark.parametrize("disable_mla", [False, True])
def test_extend_over_cached_prefix_equals_cold_prefill(tiny_deepseek_factory, disable_mla):
    path = tiny_deepseek_factory(seed=1, **SMALL)
    a, b, c = _prompts(49152, (13, 9, 21), seed=7)
    cold = DeepseekHarness(path, disable_mla=disable_mla, decompress_min_tokens=1)
    cold_logits = cold.step([cold.new_seq(a + b), cold.new_seq(c)], ForwardMode.EXTEND)

    warm = DeepseekHarness(path, disable_mla=disable_mla, decompress_min_tokens=1)
    s1 = warm.new_seq(a)
    first = warm.step([s1], ForwardMode.EXTEND)  # prefix-free: decompressed (MLA) prefill
    assert warm.last_path == ("mha" if disable_mla else "decompressed")
    s1.tokens += b
    s2 = warm.new_seq(c)
    # A batch mixing a request over a 13-token cached prefix and a prefix-free one.
    second = warm.step([s1, s2], ForwardMode.EXTEND)
    assert warm.last_path == ("mha" if disable_mla else "absorbed")
    torch.testing.assert_close(first, cold_logits[:13], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(second[:9], cold_logits[13:22], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(second[9:], cold_logits[22:], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("disable_mla", [False, True])
def test_model_runner_builds_pool_and_matches_hf(tiny_deepseek_factory, disable_mla):
    from mla_backend.config import EngineConfig
    from mla_backend.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from mla_backend.model_executor.model_runner import ModelRunner

    path = tiny_deepseek_factory(seed=1, **SMALL)
    runner = ModelRunner(EngineConfig.create(model_path=path, device="cpu", dtype="float32",
                                             max_total_tokens=256, disable_mla=disable_mla,
                                             mla_decompress_min_tokens=4))
    pool = runner.token_to_kv_pool
    if disable_mla:
        assert isinstance(pool, MHATokenToKVPool)
        assert tuple(pool.get_key_buffer(0).shape) == (257, 4, 24)
        assert tuple(pool.get_value_buffer(0).shape) == (257, 4, 16)
    else:
        assert isinstance(pool, MLATokenToKVPool)
        assert tuple(pool.get_key_buffer(0).shape) == (257, 1, 40)
        assert tuple(pool.get_value_buffer(0).shape) == (257, 1, 32)
    prompt = _prompts(49152, (10,), seed=9)[0]
    (row,) = runner.req_to_token_pool.alloc(1)
    slots = runner.token_to_kv_pool_allocator.alloc(11)
    runner.req_to_token_pool.req_to_token[row, :11] = slots.to(torch.int32)
    fb = runner.make_forward_batch(ForwardMode.EXTEND, prompt, list(range(10)), [row], [10],
                                   [0], [10], slots[:10])
    logits = runner.forward(fb)
    nxt = int(logits[0].argmax())
    fb = runner.make_forward_batch(ForwardMode.DECODE, [nxt], [10], [row], [11], None, None,
                                   slots[10:])
    decode_logits = runner.forward(fb)
    hf = _hf(path)
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt + [nxt]])).logits[0]
    torch.testing.assert_close(logits[0], ref[9], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(decode_logits[0], ref[10], atol=ATOL, rtol=RTOL)
