"""Decode throughput on the CPU: our engine vs Hugging Face `generate`, same model, same machine.

Prints a table of output tokens per second at each batch size (greedy, ignore_eos, fixed prompt
and output lengths). Default model: the SmolLM2-135M-Instruct folder made at set-up.

    .venv/bin/python benchmarks/cpu_throughput.py [--model DIR] [--batch-sizes 1 8] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mla_backend.config import EngineConfig
from mla_backend.engine import Engine
from mla_backend.request import SamplingParams

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "model_repository" / "smollm2-135m-instruct" / "weights"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def bench_hf(model_dir: str, bs: int, new_tokens: int) -> float:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok([PROMPT] * bs, return_tensors="pt").input_ids  # same prompt: no padding needed
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=tok.eos_token_id)
        dt = time.perf_counter() - t0
    produced = (out.shape[1] - ids.shape[1]) * bs
    return produced / dt


def bench_ours(model_dir: str, bs: int, new_tokens: int) -> float:
    eng = Engine(EngineConfig.create(model_path=model_dir, dtype="float32", device="cpu",
                                     enable_radix_cache=False))
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    eng.generate([PROMPT], SamplingParams(max_new_tokens=4, temperature=0.0))  # warm-up
    t0 = time.perf_counter()
    res = eng.generate([PROMPT] * bs, sp)
    dt = time.perf_counter() - t0
    return sum(len(r.token_ids) for r in res) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for bs in args.batch_sizes:
        hf = bench_hf(args.model, bs, args.new_tokens)
        ours = bench_ours(args.model, bs, args.new_tokens)
        rows.append((bs, hf, ours))
    print(f"model: {args.model}  new tokens: {args.new_tokens}  torch threads: "
          f"{torch.get_num_threads()}")
    print(f"{'batch':>5} | {'HF generate tok/s':>17} | {'mla_backend tok/s':>17} | {'ratio':>5}")
    print("-" * 56)
    for bs, hf, ours in rows:
        print(f"{bs:>5} | {hf:>17.1f} | {ours:>17.1f} | {ours / hf:>5.2f}")


if __name__ == "__main__":
    main()
