"""The engine with the `triton` attention backend equals Hugging Face greedily, like the
`torch_native` oracle (CPU: kernels in triton's interpreter, fp32; tiny models, few tokens),
also with prefills run as decode rows through the decode kernels (`extend_as_decode`).
"""

from __future__ import annotations

import pytest

from mla_backend.config import EngineConfig
from mla_backend.engine import Engine
from mla_backend.request import SamplingParams
from tests.test_engine import PROMPTS, hf_greedy

pytest.importorskip("triton")

NEW = 6
GREEDY = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)


@pytest.fixture(scope="module")
def deepseek_dir(tiny_deepseek_factory):
    return tiny_deepseek_factory(seed=3, hidden_size=64, num_hidden_layers=2)


@pytest.fixture(scope="module")
def llama_dir(tiny_llama_factory):
    return tiny_llama_factory(seed=4)


@pytest.mark.parametrize("settings", [
    {"mla_decompress_min_tokens": 10_000},  # absorbed extend + decode
    {"mla_decompress_min_tokens": 0},  # decompressed prefill (pool_free), absorbed decode
    {"disable_mla": True},  # MHA pool with 192/128-style heads
    {"extend_as_decode": "true"},  # prefills as decode rows (the decode kernels)
    {"extend_as_decode": "true", "disable_mla": True},
])
def test_deepseek_triton_equals_hf(deepseek_dir, settings):
    expected = hf_greedy(deepseek_dir, PROMPTS[:3], NEW)
    eng = Engine(EngineConfig.create(model_path=deepseek_dir, device="cpu", dtype="float32",
                                     attention_backend="triton", **settings))
    assert [r.token_ids for r in eng.generate(PROMPTS[:3], GREEDY)] == expected
    eng.check_invariant()


@pytest.mark.parametrize("as_decode", ["false", "true"])
def test_llama_triton_equals_hf_with_prefix_hit(llama_dir, as_decode):
    expected = hf_greedy(llama_dir, PROMPTS[:3], NEW)
    eng = Engine(EngineConfig.create(model_path=llama_dir, device="cpu", dtype="float32",
                                     attention_backend="triton", extend_as_decode=as_decode))
    assert [r.token_ids for r in eng.generate(PROMPTS[:3], GREEDY)] == expected
    again = eng.generate(PROMPTS[2:3], GREEDY)[0]  # extend over a cached prefix
    assert again.cached_tokens > 0 and again.token_ids == expected[2]
