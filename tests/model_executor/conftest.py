"""Checkpoints shared by the FP8 tests of this folder (CPU: test_fp8_kv_cache.py, GPU:
test_fp8_gpu.py): the tiny DeepSeek-V2 (MLA latent pool) and the tiny Llama (MHA pool) whose
tolerances those files state."""

import pytest


@pytest.fixture(scope="module")
def deepseek(tiny_deepseek_factory):
    return tiny_deepseek_factory(seed=1, hidden_size=128, num_hidden_layers=3)


@pytest.fixture(scope="module")
def llama(tiny_llama_factory):
    # init_std 0.1: the default 0.2 makes attention so sharp that e5m2 flips near-tied argmaxes
    return tiny_llama_factory(seed=2, init_std=0.1)
