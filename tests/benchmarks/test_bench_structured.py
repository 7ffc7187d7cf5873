"""benchmarks/bench_structured.py on the CPU (a V2-Lite-shaped model cut small, SmolLM2's
tokenizer): the results file holds the runs' speeds (jump-forward off and on), the tokens jumped
and the compile times, and each run's steps are reported by kind; the constrained and the free
run prefill every prompt (the cache is emptied before each)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMALL = {"vocab_size": 49152, "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 64,
         "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
         "num_attention_heads": 2, "kv_lora_rank": 16, "q_lora_rank": None,
         "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}


def test_constrained_and_free_runs_and_their_steps(tmp_path, tokenizer_dir):
    out = tmp_path / "structured.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_structured.py"),
         "--model", "deepseek-v2-lite", "--tokenizer-dir", tokenizer_dir, "--device", "cpu",
         "--batches", "4", "8", "--shape-overrides", json.dumps(SMALL), "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["schema_fields"] == 10 and 0 < doc["compile_cached_s"] < doc["compile_cold_s"]
    assert sorted(doc["batches"]) == ["4", "8"]
    for b in doc["batches"].values():
        assert b["tokens_per_request"] > 10  # a JSON object of 10 fields
        assert b["free_tok_s"] > 0 and b["constrained_tok_s"] > 0
        assert b["constrained_jump_tok_s"] > 0
        assert 0 <= b["jumped_tokens"] < b["tokens_per_request"] * 8
    for name in ("constrained", "free", "constrained, jump-forward"):
        assert f"### Steps of the {name} run at batch 8" in proc.stdout
    assert "| prefill / extend | 1 |" in proc.stdout
    prefilled = {}  # run -> prompt tokens its prefill steps computed, at batch 8
    for name in ("constrained", "free"):
        section = proc.stdout.split(f"### Steps of the {name} run at batch 8")[1].split("###")[0]
        prefilled[name] = int(re.search(r"\| prefill / extend \|.*\| ([\d,]+) \|\n", section)
                              .group(1).replace(",", ""))
    assert prefilled["constrained"] == prefilled["free"] > 8 * 4, prefilled
    assert "| decode bs 1-15 (eager) |" in proc.stdout
