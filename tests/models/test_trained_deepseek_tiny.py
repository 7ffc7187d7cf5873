"""The shipped, trained `deepseek-v2-tiny` (checkpoints/deepseek-v2-tiny): transformers' DeepseekV2
and our engine agree token for token, on the absorbed MLA path and the decompressed one.

Oracle: HF `generate` greedy in float32 on the CPU. Our engine runs the same files in float32
(torch_native backend); the chosen tokens' cumulative log-probabilities must agree with HF's
log-softmax of its own scores within 2e-3 nats per token (both fp32; only summation order
differs).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mla_backend.config import EngineConfig
from mla_backend.engine import Engine
from mla_backend.request import SamplingParams

CKPT = Path(__file__).resolve().parents[2] / "checkpoints" / "deepseek-v2-tiny"
PROMPTS = [
    "Fellow-Citizens of the Senate and House of Representatives:",
    "Call me Ishmael.",
    "The sea was",
    "In the year 1850 the Congress",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_greedy():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(CKPT)
    model = AutoModelForCausalLM.from_pretrained(CKPT, dtype=torch.float32).eval()
    out = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            g = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                               output_scores=True, return_dict_in_generate=True)
        new = g.sequences[0, ids.shape[1]:].tolist()
        lp = sum(float(torch.log_softmax(s[0].double(), -1)[t]) for s, t in zip(g.scores, new))
        out.append((ids[0].tolist(), new, lp))
    return out


def test_checkpoint_files_and_shape():
    cfg = json.loads((CKPT / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"]
    assert cfg["q_lora_rank"] is None and cfg["kv_lora_rank"] == 128
    assert cfg["rope_scaling"]["type"] == "yarn" and cfg["n_routed_experts"] == 8
    files = sorted(CKPT.glob("*.safetensors"))
    assert files and all(f.stat().st_size < 20 * 10**6 for f in files)
    index = json.loads((CKPT / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    # Per-expert names, as the published DeepSeek checkpoints have them.
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in index["weight_map"]


@pytest.mark.parametrize("disable_mla", [False, True], ids=["absorbed", "decompressed"])
def test_engine_equals_transformers(hf_greedy, disable_mla):
    engine = Engine(EngineConfig.create(model_path=str(CKPT), disable_mla=disable_mla,
                                        max_total_tokens=4096, max_running_requests=8))
    try:
        sp = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        results = engine.generate([ids for ids, _, _ in hf_greedy], sp)
    finally:
        engine.close()
    for (_, want, want_lp), r in zip(hf_greedy, results):
        assert r.error is None
        assert r.token_ids == want
        assert math.isclose(r.cumulative_logprob, want_lp, abs_tol=2e-3 * NEW_TOKENS)
    # The model is trained, not random: the continuation of the addresses' opening is English
    # made of the corpus's words, and the prompts lead to different texts.
    assert len({tuple(t) for _, t, _ in hf_greedy}) == len(PROMPTS)
    assert "United States" in results[0].text
