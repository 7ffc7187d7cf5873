"""Whole models under tensor parallelism on CPU ranks (gloo) against the same model at TP 1.

Each rank process builds a full `Engine` with `tensor_parallel_size` = its group size on the same
checkpoint, runs the same requests (the scheduler is deterministic, so every rank steps the same
batches and meets its peers in the same collectives), and returns its greedy tokens and the
all-position prefill logits of one prompt. The parent runs the identical function at TP 1 and
compares: tokens equal, logits within fp32 tolerance (the row-parallel sums add in another order).
SmolLM2 has 9 query / 3 KV heads, so it runs at TP 3 (TP 2 must fail with a clear error).
A tiny model with DeepSeek-V2's (236B) structure runs at TP 4 and 8, each rank's weights counted
against `mla_tools.model_shapes.rank_parameter_counts`.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from tp_harness import TpRankError, TpWorkers

from mla_backend.config import EngineConfig
from mla_backend.distributed import get_tp_rank, get_tp_size
from mla_backend.engine import Engine
from mla_backend.forward_batch import ForwardMode
from mla_backend.request import SamplingParams
from mla_tools.model_shapes import rank_parameter_counts

PROMPTS = ["The capital of France is", "def fib(n):", "1, 2, 3, 4, 5,"]
NEW_TOKENS = 12
LOGIT_TOL = {"atol": 2e-4, "rtol": 1e-4}


def _prefill_logits(eng: Engine, ids: list[int]) -> torch.Tensor:
    runner = eng.runner
    row = runner.req_to_token_pool.alloc(1)[0]
    slots = runner.token_to_kv_pool_allocator.alloc(len(ids))
    runner.req_to_token_pool.req_to_token[row, : len(ids)] = slots.to(torch.int32)
    fb = runner.make_forward_batch(ForwardMode.EXTEND, ids, list(range(len(ids))), [row],
                                   [len(ids)], [0], [len(ids)], slots, return_all_logits=True)
    logits = runner.forward(fb).float()
    runner.token_to_kv_pool_allocator.free(slots)
    runner.req_to_token_pool.free(row)
    return logits


def _outputs(eng: Engine) -> tuple[int, list[list[int]], torch.Tensor]:
    """(rank, greedy tokens per prompt, prefill logits) of an engine."""
    sp = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = [o.token_ids for o in eng.generate(PROMPTS, sp)]
    eng.check_invariant()
    logits = _prefill_logits(eng, eng.tokenizer.encode(PROMPTS[0]))
    return get_tp_rank(), tokens, logits


def _engine(path: str, settings: dict) -> Engine:
    return Engine(EngineConfig.create(model_path=path, tensor_parallel_size=get_tp_size(),
                                      max_total_tokens=1024, **settings))


def _run_model(path: str, settings: dict) -> tuple[int, list[list[int]], torch.Tensor]:
    """On one rank (or the parent at TP 1): (rank, greedy tokens per prompt, prefill logits)."""
    return _outputs(_engine(path, settings))


def _run_model_and_count(path: str, settings: dict) -> tuple[tuple, tuple[int, int]]:
    """`_run_model`'s result, and (parameter elements, absorbed w_kc + w_vc elements) of this
    rank's model."""
    eng = _engine(path, settings)
    model = eng.runner.model
    absorbed = sum(layer.self_attn.w_kc.numel() + layer.self_attn.w_vc.numel()
                   for layer in model.model.layers)
    return _outputs(eng), (sum(p.numel() for p in model.parameters()), absorbed)


@pytest.fixture(scope="module")
def workers2():
    with TpWorkers(2, timeout=120.0) as w:
        yield w


def _check(results: list, expected: tuple) -> None:
    _, tokens, logits = expected
    assert [r[0] for r in results] == list(range(len(results)))
    for rank, got_tokens, got_logits in results:
        assert got_tokens == tokens, f"rank {rank}"
        torch.testing.assert_close(got_logits, logits, **LOGIT_TOL)


@pytest.mark.parametrize("overrides", [
    {},  # 4 q heads / 2 KV heads: both split
    {"num_key_value_heads": 1, "tie_word_embeddings": True},  # the KV head replicated; tied head
])
def test_tiny_llama_tp2_equals_tp1(workers2, tiny_llama_factory, overrides):
    path = tiny_llama_factory(seed=5, **overrides)
    _check(workers2.run(_run_model, path, {}), _run_model(path, {}))


@pytest.mark.parametrize("settings", [
    {},  # absorbed decode, decompressed prefill, latent pool replicated on every rank
    {"disable_mla": True},  # per-head MHA pool split by heads
])
def test_tiny_deepseek_tp2_equals_tp1(workers2, tiny_deepseek_factory, settings):
    # Dense first layer, then MoE (experts split along the intermediate dim) + shared experts.
    path = tiny_deepseek_factory(seed=6, hidden_size=64, num_hidden_layers=2)
    _check(workers2.run(_run_model, path, settings), _run_model(path, settings))


# DeepSeek-V2's structure at tiny widths: q LoRA, 16 heads (2 per rank at TP 8), group-limited
# routing (8 groups, top-3) of 32 experts top-6 + 2 shared, routed_scaling_factor 16, a dense
# first layer, expert intermediate 16 (2 per rank at TP 8).
V2_LIKE = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 16,
           "q_lora_rank": 32, "kv_lora_rank": 64, "intermediate_size": 128,
           "n_routed_experts": 32, "num_experts_per_tok": 6, "n_shared_experts": 2,
           "moe_intermediate_size": 16, "topk_method": "group_limited_greedy", "n_group": 8,
           "topk_group": 3, "routed_scaling_factor": 16.0}


@pytest.fixture(scope="module")
def v2_like(tiny_deepseek_factory):
    """(checkpoint folder, its config dict, `_run_model_and_count` at TP 1)."""
    path = tiny_deepseek_factory(seed=7, **V2_LIKE)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    return path, cfg, _run_model_and_count(path, {})


@pytest.mark.parametrize("tp", [4, 8])
def test_deepseek_v2_structure_tp_equals_tp1(v2_like, tp):
    path, cfg, (expected, counts) = v2_like
    ref = rank_parameter_counts(cfg, 1)
    assert counts == (ref["total"], ref["absorbed"])
    with TpWorkers(tp, timeout=240.0) as w:
        results = w.run(_run_model_and_count, path, {})
    _check([out for out, _ in results], expected)
    want = rank_parameter_counts(cfg, tp)
    assert [c for _, c in results] == [(want["total"], want["absorbed"])] * tp


def test_smollm2_tp3_equals_tp1(smollm2_dir):
    with TpWorkers(3, timeout=240.0) as w:
        results = w.run(_run_model, smollm2_dir, {})
    _check(results, _run_model(smollm2_dir, {}))


def test_smollm2_tp2_is_a_clear_error(workers2, smollm2_dir):
    with pytest.raises(TpRankError, match="tensor parallel size 2 does not divide num_heads=9"):
        workers2.run(_run_model, smollm2_dir, {})


def _engine_with_tp(path: str, tp: int) -> None:
    Engine(EngineConfig.create(model_path=path, tensor_parallel_size=tp, max_total_tokens=64))


def test_tp_size_other_than_the_group_is_a_clear_error(workers2, tiny_llama_factory):
    with pytest.raises(TpRankError, match="tensor_parallel_size=4, but this process is in a "
                                          "tensor-parallel group of 2"):
        workers2.run(_engine_with_tp, tiny_llama_factory(seed=5), 4)
