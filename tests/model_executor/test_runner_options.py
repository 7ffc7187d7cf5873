"""CPU-side parts of the GPU fast path: graph bucket sizes, the new runner settings and their
validation, dummy weights (`load_format="dummy"`) and the pool capacity of MLA vs MHA at the
published DeepSeek-V2-Lite shape. The graphs themselves run in test_cuda_graph_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from mla_backend.config import ConfigError, EngineConfig
from mla_backend.engine import Engine
from mla_backend.layers.layernorm import RMSNorm
from mla_backend.model_executor.cuda_graph_runner import batch_size_buckets
from mla_backend.model_executor.model_runner import ModelRunner, kv_cell_bytes
from mla_backend.models.registry import get_model_class_for_config
from mla_backend.request import SamplingParams
from mla_tools.model_shapes import shape_config, write_shape_model


def test_batch_size_buckets():
    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(5) == [1, 2, 4, 5]
    assert batch_size_buckets(8) == [1, 2, 4, 8]
    assert batch_size_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    b = batch_size_buckets(160)
    assert b[:5] == [1, 2, 4, 8, 16] and b[-1] == 160 and len(b) == 23
    assert all(y - x == 8 for x, y in zip(b[4:], b[5:]))
    with pytest.raises(ValueError):
        batch_size_buckets(0)


@pytest.mark.parametrize("settings, key", [
    ({"enable_torch_compile": True, "disable_cuda_graph": True}, "enable_torch_compile"),
    ({"cuda_graph_max_bs": 0}, "cuda_graph_max_bs"),
    ({"torch_compile_max_bs": 0}, "torch_compile_max_bs"),
    ({"torch_compile_mode": "fastest"}, "torch_compile_mode"),
    ({"load_format": "pt"}, "load_format"),
    ({"warmup": "yes"}, "warmup"),
])
def test_runner_settings_validated(settings, key):
    with pytest.raises(ConfigError, match=key):
        EngineConfig.create(model_path="/x", **settings)


def test_runner_settings_from_strings():
    cfg = EngineConfig.from_parameters({"model_path": "/x", "disable_cuda_graph": "true",
                                        "cuda_graph_max_bs": "48", "load_format": "dummy"})
    assert cfg.runner.disable_cuda_graph is True and cfg.runner.cuda_graph_max_bs == 48
    assert cfg.model.load_format == "dummy"
    assert cfg.runner.enable_torch_compile is False and cfg.runner.torch_compile_max_bs == 32


def test_cpu_runner_has_no_graphs(tiny_llama_factory):
    r = ModelRunner(EngineConfig.create(model_path=tiny_llama_factory(seed=3), max_total_tokens=64))
    assert r.cuda_graph_runner is None


@pytest.fixture(scope="module")
def dummy_llama_dir(tmp_path_factory, tokenizer_dir):
    # Llama-3.1-8B's layout scaled down, config + tokenizer only: no weights on disk.
    return write_shape_model(str(tmp_path_factory.mktemp("dummy_llama")), "llama-3.1-8b",
                             tokenizer_dir, num_hidden_layers=2, hidden_size=64,
                             intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, vocab_size=49152)


def test_dummy_weights(dummy_llama_dir):
    def runner(seed):
        return ModelRunner(EngineConfig.create(model_path=dummy_llama_dir, load_format="dummy",
                                               seed=seed, max_total_tokens=64))

    a, b, c = runner(0), runner(0), runner(1)
    pa, pb, pc = (dict(r.model.named_parameters()) for r in (a, b, c))
    assert set(pa) == set(pb) and len(pa) > 5
    for name, p in pa.items():
        assert torch.equal(p, pb[name]), name
    norms = [m.weight for m in a.model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * 2 + 1 and all(bool((w == 1).all()) for w in norms)
    emb = pa["model.embed_tokens.weight"]
    assert float(emb.abs().max()) <= 0.02 and float(emb.std()) > 0.005
    assert not torch.equal(emb, pc["model.embed_tokens.weight"])


def test_dummy_weights_hold_checkpoint_dtype_values():
    # A bf16 model's fp32 router weight gets bf16 values, as from a bf16 checkpoint, so the
    # router's 16-bit GEMM (RouterGate.prepare_16bit) is used with dummy weights too.
    from mla_backend.layers.moe import DeepseekV2MoE
    from mla_backend.model_executor.model_loader import init_dummy_weights

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        moe = DeepseekV2MoE(32, 16, n_routed_experts=8, num_experts_per_tok=2,
                            n_shared_experts=1)
    finally:
        torch.set_default_dtype(old)
    w = moe.gate.weight
    init_dummy_weights(moe, seed=0, checkpoint_dtype=torch.bfloat16)
    assert w.dtype == torch.float32 and float(w.abs().max()) <= 0.02 and float(w.std()) > 0.005
    assert torch.equal(w.to(torch.bfloat16).float(), w)
    moe.gate.prepare_16bit(torch.bfloat16)
    assert moe.gate.weight_16 is not None
    init_dummy_weights(moe, seed=0)  # without it: fp32 values, no 16-bit copy
    moe.gate.prepare_16bit(torch.bfloat16)
    assert moe.gate.weight_16 is None


def test_dummy_weights_serve(dummy_llama_dir):
    eng = Engine(EngineConfig.create(model_path=dummy_llama_dir, load_format="dummy",
                                     max_total_tokens=256))
    sp = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    outs = eng.generate(["hello there", "a"], sp)
    assert [len(o.token_ids) for o in outs] == [5, 5]
    eng.check_invariant()


def test_v2_lite_mla_capacity_ratio():
    """MHA (disable_mla: K 16x192 + V 16x128 per layer) vs the MLA latent (512 + 64) per token,
    both bf16: 276,480 vs 31,104 bytes over 27 layers (REFERENCE §1.7), 8.89x the tokens."""
    from transformers import DeepseekV2Config

    from mla_backend.config import ModelConfig

    hf = DeepseekV2Config(**shape_config("deepseek-v2-lite"))
    cls = get_model_class_for_config(hf)
    layouts = {}
    for disable in (False, True):
        with torch.device("meta"):
            model = cls(hf, ModelConfig(model_path="/x", disable_mla=disable))
        layouts[disable] = model.kv_pool_layout()
    mla = kv_cell_bytes(layouts[False], torch.bfloat16)
    mha = kv_cell_bytes(layouts[True], torch.bfloat16)
    assert (mla, mha) == (31104, 276480)
    assert mha / mla == pytest.approx(8.89, abs=0.01)
