"""ModelRunner construction (device/dtype, pool sizing, context length, weight checks) and
`make_forward_batch` validation. Numerical equivalence with HF lives in tests/models/test_llama.py.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mla_backend.config import EngineConfig
from mla_backend.forward_batch import ForwardMode
from mla_backend.layers.attention.torch_native import TorchNativeAttnBackend
from mla_backend.mem_cache.memory_pool import MHATokenToKVPool
from mla_backend.model_executor.model_loader import iterate_weights, safetensors_files
from mla_backend.model_executor.model_runner import (
    CPU_DEFAULT_MAX_TOTAL_TOKENS,
    ModelRunner,
    create_attention_backend,
    kv_cell_bytes,
    resolve_dtype,
)
from mla_backend.models.registry import UnsupportedModelError


@pytest.fixture(scope="module")
def tiny(tiny_llama_factory) -> str:
    return tiny_llama_factory(seed=3)


def test_cpu_defaults(tiny):
    r = ModelRunner(EngineConfig.create(model_path=tiny))
    assert r.device == torch.device("cpu") and r.dtype == torch.float32
    assert r.max_total_num_tokens == CPU_DEFAULT_MAX_TOTAL_TOKENS
    assert r.max_running_requests == 256
    assert r.req_to_token_pool.size == 257
    assert r.context_len == r.hf_config.max_position_embeddings == 2048
    assert r.req_to_token_pool.req_to_token.shape[1] >= r.context_len
    assert r.token_to_kv_pool_allocator.available_size() == CPU_DEFAULT_MAX_TOTAL_TOKENS
    pool = r.token_to_kv_pool
    assert isinstance(pool, MHATokenToKVPool) and pool.layer_num == 2
    assert pool.get_key_buffer(0).shape == (CPU_DEFAULT_MAX_TOTAL_TOKENS + 1, 2, 16)
    assert isinstance(r.attn_backend, TorchNativeAttnBackend)
    assert r.vocab_size == 49152
    assert pool.cell_bytes() == kv_cell_bytes(r.model.kv_pool_layout(), r.dtype) == 2 * 2 * 32 * 4


def test_explicit_sizes_and_context_cap(tiny):
    r = ModelRunner(EngineConfig.create(model_path=tiny, max_total_tokens=100,
                                        max_running_requests=3, context_length=64))
    assert (r.max_total_num_tokens, r.max_running_requests, r.context_len) == (100, 3, 64)
    assert r.req_to_token_pool.size == 4
    # Derived request limit: half the slots when that is below the CPU default.
    r2 = ModelRunner(EngineConfig.create(model_path=tiny, max_total_tokens=40))
    assert r2.max_running_requests == 20
    # Longer than the checkpoint's positions: capped (rope cache has max_position_embeddings).
    r3 = ModelRunner(EngineConfig.create(model_path=tiny, context_length=10**6, max_total_tokens=8))
    assert r3.context_len == 2048


def test_sliding_window_caps_context(tiny_llama_factory):
    path = tiny_llama_factory(seed=3, model_type="mistral", sliding_window=128)
    r = ModelRunner(EngineConfig.create(model_path=path, max_total_tokens=64))
    assert r.context_len == 128


def test_bf16_on_cpu_close_to_fp32(tiny):
    r32 = ModelRunner(EngineConfig.create(model_path=tiny, max_total_tokens=64))
    r16 = ModelRunner(EngineConfig.create(model_path=tiny, max_total_tokens=64, dtype="bfloat16"))
    assert r16.dtype == torch.bfloat16 and r16.token_to_kv_pool.dtype == torch.bfloat16
    assert next(r16.model.parameters()).dtype == torch.bfloat16
    outs = []
    for r in (r32, r16):
        row = r.req_to_token_pool.alloc(1)[0]
        slots = r.token_to_kv_pool_allocator.alloc(6)
        r.req_to_token_pool.req_to_token[row, :6] = slots.to(torch.int32)
        fb = r.make_forward_batch(ForwardMode.EXTEND, [10, 20, 30, 40, 50, 60], range(6), [row],
                                  [6], [0], [6], slots)
        outs.append(r.forward(fb))
    assert outs[1].dtype == torch.float32 and outs[1].shape == (1, 49152)
    assert outs[0].argmax() == outs[1].argmax()
    torch.testing.assert_close(outs[1], outs[0], atol=0.15, rtol=0.05)


def test_make_forward_batch_decode_defaults_and_errors(tiny):
    r = ModelRunner(EngineConfig.create(model_path=tiny, max_total_tokens=64))
    fb = r.make_forward_batch(ForwardMode.DECODE, [1, 2], [4, 9], [0, 1], [5, 10], None, None,
                              torch.tensor([3, 7]))
    assert fb.extend_prefix_lens_cpu == [4, 9] and fb.extend_seq_lens_cpu == [1, 1]
    assert fb.batch_size == 2 and fb.out_cache_loc.dtype == torch.int64
    assert fb.token_to_kv_pool is r.token_to_kv_pool and fb.attn_backend is r.attn_backend
    with pytest.raises(ValueError, match="inconsistent"):
        r.make_forward_batch(ForwardMode.EXTEND, [1, 2, 3], [0, 1, 2], [0], [3], [0], [2],
                             [1, 2, 3])
    with pytest.raises(ValueError, match="EXTEND needs"):
        r.make_forward_batch(ForwardMode.EXTEND, [1], [0], [0], [1], None, None, [1])
    with pytest.raises(ValueError, match="one entry per input token"):
        r.make_forward_batch(ForwardMode.EXTEND, [1, 2], [0, 1], [0], [2], [0], [2], [1])


def test_forward_checks_req_to_token_contract(tiny):
    r = ModelRunner(EngineConfig.create(model_path=tiny, max_total_tokens=64))
    fb = r.make_forward_batch(ForwardMode.EXTEND, [1, 2], [0, 1], [0], [2], [0], [2], [5, 6])
    with pytest.raises(ValueError, match="out_cache_loc"):  # row 0 was never written
        r.forward(fb)


def test_missing_weight_and_unknown_tensor_are_errors(tiny, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    state = load_file(str(bad / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj"):
        ModelRunner(EngineConfig.create(model_path=str(bad), max_total_tokens=8))
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 128)
    state["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(KeyError, match="extra"):
        ModelRunner(EngineConfig.create(model_path=str(bad), max_total_tokens=8))


def test_unsupported_architecture(tiny, tmp_path):
    bad = tmp_path / "arch"
    shutil.copytree(tiny, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelRunner(EngineConfig.create(model_path=str(bad), max_total_tokens=8))


def test_loader_single_and_sharded(tiny, tiny_llama_factory):
    sharded = tiny_llama_factory(seed=3, max_shard_size="100KB")
    files = safetensors_files(sharded)
    assert len(files) > 2 and all(os.path.dirname(f) == sharded for f in files)
    a, b = dict(iterate_weights(tiny)), dict(iterate_weights(sharded))
    assert a.keys() == b.keys() and len(safetensors_files(tiny)) == 1
    assert all(torch.equal(a[k], b[k]) for k in a)  # same seed, same weights
    with pytest.raises(FileNotFoundError):
        safetensors_files(os.path.join(tiny, "nope"))


def test_helpers():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    mla = {"kind": "mla", "num_layers": 27, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    assert kv_cell_bytes(mla, torch.bfloat16) == 576 * 2 * 27  # REFERENCE §2.2
    with pytest.raises(ValueError):
        create_attention_backend("no_such_backend", torch.device("cpu"))
    auto_cpu = create_attention_backend("auto", torch.device("cpu"))
    assert type(auto_cpu).__name__ == "TorchNativeAttnBackend"
