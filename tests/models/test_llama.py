"""Llama family through ModelRunner + paged pools + torch_native attention vs Hugging Face.

Exactness checks (fp32, CPU):
- prefill logits of several prompts of different lengths run together in ONE extend batch equal
  HF `model(input_ids)` per prompt (every position), atol 1e-4 (tiny) / 2e-3 (SmolLM2, logits
  up to ~30 through 30 layers);
- greedy loop (batched extend, then batched decode steps, slots allocated here) equals HF
  `generate(do_sample=False)` token for token, 32 new tokens;
- an extend over a prefix cached by an earlier extend equals the cold extend.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mla_backend.config import EngineConfig
from mla_backend.forward_batch import ForwardMode
from mla_backend.model_executor.model_runner import ModelRunner

PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog because",
    "In 1492, Columbus sailed across the Atlantic Ocean. Historians still debate what he",
]
NEW_TOKENS = 32


@dataclass
class Seq:
    """One request as the engine would track it: a row and its tokens; the first `kv_len`
    tokens have KV in the pool."""

    row: int
    tokens: list[int]
    kv_len: int = 0
    slots: list[int] = field(default_factory=list)


def new_seq(runner: ModelRunner, tokens: list[int]) -> Seq:
    rows = runner.req_to_token_pool.alloc(1)
    assert rows is not None
    return Seq(rows[0], list(tokens))


def step(runner: ModelRunner, seqs: list[Seq], mode: ForwardMode,
         return_all_logits: bool = False) -> torch.Tensor:
    """Run every token of each seq that has no KV yet; returns the runner's fp32 logits."""
    ids, pos, locs = [], [], []
    prefix, ext = [], []
    for s in seqs:
        n = len(s.tokens) - s.kv_len
        slots = runner.token_to_kv_pool_allocator.alloc(n)
        assert slots is not None
        runner.req_to_token_pool.req_to_token[s.row, s.kv_len: s.kv_len + n] = slots.to(
            runner.req_to_token_pool.req_to_token)
        ids += s.tokens[s.kv_len:]
        pos += list(range(s.kv_len, len(s.tokens)))
        locs += slots.tolist()
        prefix.append(s.kv_len)
        ext.append(n)
    fb = runner.make_forward_batch(
        mode, ids, pos, [s.row for s in seqs], [len(s.tokens) for s in seqs],
        prefix, ext, locs, return_all_logits=return_all_logits)
    logits = runner.forward(fb)
    for s in seqs:
        s.kv_len = len(s.tokens)
    return logits


def release(runner: ModelRunner, seqs: list[Seq]) -> None:
    for s in seqs:
        table = runner.req_to_token_pool.req_to_token
        runner.token_to_kv_pool_allocator.free(table[s.row, : s.kv_len].long().cpu())
        runner.req_to_token_pool.free(s.row)


def greedy(runner: ModelRunner, prompts: list[list[int]], n: int) -> list[list[int]]:
    seqs = [new_seq(runner, p) for p in prompts]
    logits = step(runner, seqs, ForwardMode.EXTEND)
    for _ in range(n - 1):
        for s, tok in zip(seqs, logits.argmax(-1).tolist()):
            s.tokens.append(tok)
        assert all(len(s.tokens) - s.kv_len == 1 for s in seqs)
        logits = step(runner, seqs, ForwardMode.DECODE)
    for s, tok in zip(seqs, logits.argmax(-1).tolist()):
        s.tokens.append(tok)
    out = [s.tokens[len(p):] for s, p in zip(seqs, prompts)]
    release(runner, seqs)
    return out


def hf_generate(hf, prompt: list[int], n: int) -> list[int]:
    """HF greedy tokens; stops after EOS like any HF generate (min_new_tokens is not used: it
    would mask EOS and change the argmax)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.int64))
    return out[0, len(prompt):].tolist()


def assert_same_greedy(hf, prompt: list[int], ours: list[int]) -> int:
    """`ours` (always n tokens) equals HF's, up to and including HF's EOS if it stopped early.
    Returns how many tokens were compared."""
    want = hf_generate(hf, prompt, len(ours))
    assert ours[: len(want)] == want
    if len(want) < len(ours):
        eos = hf.generation_config.eos_token_id
        assert want[-1] in (eos if isinstance(eos, list) else [eos])
    return len(want)


def check_prefill_logits(runner, hf, prompts: list[list[int]], atol: float) -> None:
    seqs = [new_seq(runner, p) for p in prompts]
    logits = step(runner, seqs, ForwardMode.EXTEND, return_all_logits=True)
    assert logits.dtype == torch.float32
    assert logits.shape == (sum(map(len, prompts)), runner.vocab_size)
    off = 0
    for p in prompts:
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0].float()
        torch.testing.assert_close(logits[off: off + len(p)], want, atol=atol, rtol=0)
        off += len(p)
    # Last-token logits (the default) are the same rows (up to matmul blocking: fewer rows).
    release(runner, seqs)
    seqs = [new_seq(runner, p) for p in prompts]
    last = step(runner, seqs, ForwardMode.EXTEND)
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    torch.testing.assert_close(last, logits[ends], atol=atol, rtol=0)
    release(runner, seqs)


def make_runner(path: str, **settings) -> ModelRunner:
    return ModelRunner(EngineConfig.create(model_path=path, max_total_tokens=1024,
                                           max_running_requests=8, **settings))


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Small CPU matmuls: one intra-op thread is faster, and ~10x faster when other processes
    compete for the cores (spinning OpenMP workers)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer(p).input_ids for p in PROMPTS]


TINY_CONFIGS = {
    "gqa_untied": {},
    "tied": {"tie_word_embeddings": True},
    "mqa_head_dim32": {"num_key_value_heads": 1, "head_dim": 32},
    "sharded": {"max_shard_size": "1MB", "num_hidden_layers": 3},
    "qwen2_bias": {"model_type": "qwen2"},
    "mistral": {"model_type": "mistral", "sliding_window": None},
    "llama3_rope": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 16}},
}


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_tiny_llama_matches_hf(name, tiny_llama_factory, prompt_ids):
    path = tiny_llama_factory(seed=1, **TINY_CONFIGS[name])
    runner = make_runner(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    check_prefill_logits(runner, hf, prompt_ids, atol=1e-4)
    got = greedy(runner, prompt_ids, NEW_TOKENS)
    for p, g in zip(prompt_ids, got):
        assert_same_greedy(hf, p, g)
    # Every slot and row went back.
    assert runner.token_to_kv_pool_allocator.available_size() == runner.max_total_num_tokens
    assert runner.req_to_token_pool.available_size() == runner.max_running_requests + 1


def test_sharded_checkpoint_has_several_files(tiny_llama_factory):
    import os

    path = tiny_llama_factory(seed=1, **TINY_CONFIGS["sharded"])
    shards = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(shards) >= 2 and os.path.exists(os.path.join(path, "model.safetensors.index.json"))


def test_extend_over_cached_prefix_equals_cold(tiny_llama_factory, prompt_ids):
    runner = make_runner(tiny_llama_factory(seed=2))
    long_prompt = prompt_ids[2]
    cold_seq = [new_seq(runner, long_prompt)]
    cold = step(runner, cold_seq, ForwardMode.EXTEND, return_all_logits=True)
    # Warm: first 7 tokens in one extend, then the rest (batched with a fresh request).
    warm = new_seq(runner, long_prompt[:7])
    first = step(runner, [warm], ForwardMode.EXTEND, return_all_logits=True)
    warm.tokens = list(long_prompt)
    other = new_seq(runner, prompt_ids[1])
    rest = step(runner, [other, warm], ForwardMode.EXTEND, return_all_logits=True)
    n_other = len(prompt_ids[1])
    torch.testing.assert_close(torch.cat([first, rest[n_other:]]), cold, atol=1e-5, rtol=0)
    alone = step(runner, [new_seq(runner, prompt_ids[1])], ForwardMode.EXTEND,
                 return_all_logits=True)
    torch.testing.assert_close(rest[:n_other], alone, atol=1e-5, rtol=0)
    # A second request sharing the cached prefix slots (as the radix cache would hand out).
    shared = new_seq(runner, long_prompt)
    table = runner.req_to_token_pool.req_to_token
    table[shared.row, :7] = table[warm.row, :7]
    shared.kv_len = 7
    again = step(runner, [shared], ForwardMode.EXTEND, return_all_logits=True)
    torch.testing.assert_close(again, cold[7:], atol=1e-5, rtol=0)


# ------------------------------------------------------------------ SmolLM2-135M-Instruct
@pytest.fixture(scope="module")
def smol(smollm2_dir):
    runner = make_runner(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return runner, hf


def test_smollm2_prefill_logits_match_hf(smol, prompt_ids):
    runner, hf = smol
    assert runner.model.tie_word_embeddings
    check_prefill_logits(runner, hf, prompt_ids, atol=2e-3)


def test_smollm2_greedy_matches_hf_generate(smol, prompt_ids, tokenizer):
    runner, hf = smol
    france = tokenizer("The capital of France is").input_ids
    prompts = [france, prompt_ids[2], prompt_ids[1]]
    got = greedy(runner, prompts, NEW_TOKENS)
    assert tokenizer.decode(got[0][:2]) == " Paris."
    compared = [assert_same_greedy(hf, p, g) for p, g in zip(prompts, got)]
    assert compared[1] == NEW_TOKENS  # this one runs the full 32 tokens without EOS
