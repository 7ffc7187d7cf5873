"""How much exact jump-forward could skip (issue 43): constrained greedy outputs of SmolLM2-135M
(CPU, fp32) for a JSON schema (bench_structured's 10 fields), `json_object` and a regex, replayed
through their grammar. At each step `constrained.grammar.forced_tokens` gives the run of tokens the
mask leaves no choice for (what an exact jump could append without a forward pass); SGLang-style
string jumps (`jump_forward_tokens`) are counted where their ids equal the model's own spelling.

A jump of L forced tokens replaces L + 1 decode forwards (the one that produced the forced token's
input, then one per forced token) by one extend forward of L + 1 tokens, so the forwards drop from
one per output token to that minus the forced tokens, one per run being an extend instead of a
decode step. Prints one table row per constraint.

    .venv/bin/python benchmarks/bench_jump_forward.py
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from bench_structured import SCHEMA  # noqa: E402
from bench_suite import table  # noqa: E402

PROMPTS = ["Make up a user profile as JSON.", "Describe a customer record.",
           "Give me a JSON object for an employee named Ana."]
SPECS = {"json schema (10 fields)": {"json": SCHEMA}, "json_object": {"json_object": True},
         "regex (US phone)": {"regex": r"(\+1 )?\(\d{3}\) \d{3}-\d{4}"}}


def chat(tokenizer, prompt: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=300)
    args = ap.parse_args(argv)
    from mla_backend.config import EngineConfig
    from mla_backend.constrained.grammar import (GrammarCompiler, allocate_bitmask,
                                                 forced_tokens, jump_forward_tokens)
    from mla_backend.constrained.spec import parse_structured_outputs
    from mla_backend.engine import Engine
    from mla_backend.request import SamplingParams
    from mla_tools.prepare import DEFAULT_MODEL_REPOSITORY, SMOLLM2, prepare, weights_dir

    prepare(DEFAULT_MODEL_REPOSITORY, models=[SMOLLM2])
    path = str(weights_dir(DEFAULT_MODEL_REPOSITORY, SMOLLM2))
    eng = Engine(EngineConfig.create(model_path=path, dtype="float32", device="cpu"))
    grammars = eng.grammars
    compiler = GrammarCompiler(grammars.tokenizer, grammars.vocab_size,
                               stop_token_ids=grammars.stop_token_ids)
    rows = []
    try:
        for name, spec in SPECS.items():
            sp = SamplingParams.from_dict({"temperature": 0, "max_tokens": args.max_tokens,
                                           "structured_outputs": spec})
            results = eng.generate([chat(eng.tokenizer, p) for p in PROMPTS], sp)
            compiled = compiler.compile(parse_structured_outputs(spec))
            total = forced = string_jumps = 0
            runs: Counter[int] = Counter()
            for res in results:
                ids = list(res.token_ids)
                state = compiler.new_state(compiled)
                mask = allocate_bitmask(1, state.vocab_size)
                total += len(ids)
                i = 0
                while i < len(ids):
                    run = forced_tokens(state, bitmask=mask, max_tokens=len(ids) - i,
                                        include_stop=True)
                    if run and ids[i:i + len(run)] == run:  # (greedy: always so)
                        forced += len(run)
                        runs[len(run)] += 1
                        for t in run:
                            state.accept_token(t)
                        i += len(run)
                        continue
                    jump = jump_forward_tokens(state, eng.tokenizer, max_tokens=len(ids) - i)
                    string_jumps += bool(jump) and ids[i:i + len(jump)] == jump
                    state.accept_token(ids[i])
                    i += 1
            n_runs = sum(runs.values())
            rows.append([name, len(results), total, forced, f"{forced / max(total, 1):.1%}",
                         ", ".join(f"{k}×{v}" for k, v in sorted(runs.items())) or "-",
                         total - forced, n_runs, string_jumps])
    finally:
        compiler.shutdown()
        eng.close()
    table("Exact jump-forward on constrained greedy outputs (SmolLM2-135M-Instruct, CPU)",
          ["constraint", "requests", "output tokens", "forced tokens", "forced share",
           "forced runs (length×count)", "forwards with jumps (without: = output tokens)",
           "of them extends", "string jumps equal to the model's ids"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
