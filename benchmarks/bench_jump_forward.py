"""Jump-forward's gain (issue 43): constrained greedy requests of SmolLM2-135M (CPU, fp32) run
through the engine with jump-forward off (`jump_forward_min_tokens` 0, the default), at 4 and at
1, for a JSON schema (bench_structured's 10 fields), `json_object`, a regex (US phone number) and
a regex with long fixed runs (an order line). Per constraint and setting: the output tokens, the
tokens jump-forward appended (`jump_forward_tokens`: the forced start that joins the prefill and
the runs after a forced token, each run one EXTEND step), the forward passes by kind, the wall
time of the `generate` call, and whether every output equals the one without jump-forward.

Replaying the outputs through their grammar also counts the forced tokens (where the mask allows
exactly one token: what an exact jump may append) by run length, which says how much any jump
could skip; the SGLang-style string jump (`jump_forward_tokens`, retokenized) is counted where
its ids equal the model's own.

    .venv/bin/python benchmarks/bench_jump_forward.py
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from bench_structured import SCHEMA  # noqa: E402
from bench_suite import table  # noqa: E402

PROMPTS = ["Make up a user profile as JSON.", "Describe a customer record.",
           "Give me a JSON object for an employee named Ana."]
SPECS = {"json schema (10 fields)": {"json": SCHEMA}, "json_object": {"json_object": True},
         "regex (US phone)": {"regex": r"(\+1 )?\(\d{3}\) \d{3}-\d{4}"},
         "regex (order line)": {"regex": r"Order 0123-4567-8901-2345 for [a-z]{2,12}\. "
                                         r"Ref 99887766554433\."}}
SETTINGS = (0, 4, 1)  # jump_forward_min_tokens: off (the default), 4, every forced run


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
    from mla_backend.forward_batch import ForwardMode
    from mla_backend.request import SamplingParams
    from mla_tools.prepare import DEFAULT_MODEL_REPOSITORY, SMOLLM2, prepare, weights_dir

    prepare(DEFAULT_MODEL_REPOSITORY, models=[SMOLLM2])
    path = str(weights_dir(DEFAULT_MODEL_REPOSITORY, SMOLLM2))
    engines = {}
    for jm in SETTINGS:
        eng = Engine(EngineConfig.create(model_path=path, dtype="float32", device="cpu",
                                         jump_forward_min_tokens=jm))
        eng.forwards = []
        forward = eng.runner.forward

        def counted(fb, eng=eng, forward=forward):
            eng.forwards.append(fb.forward_mode)
            return forward(fb)

        eng.runner.forward = counted
        engines[jm] = eng
    grammars = engines[0].grammars
    compiler = GrammarCompiler(grammars.tokenizer, grammars.vocab_size,
                               stop_token_ids=grammars.stop_token_ids)
    rows, replay = [], []
    try:
        for name, spec in SPECS.items():
            sp = SamplingParams.from_dict({"temperature": 0, "max_tokens": args.max_tokens,
                                           "structured_outputs": spec})
            prompts = [chat(engines[0].tokenizer, p) for p in PROMPTS]
            for eng in engines.values():  # warm-up: compile the grammar, fill the caches
                eng.generate(prompts[:1], sp)
            base = None
            for jm, eng in engines.items():
                eng.forwards.clear()
                jumped0, jumps0 = eng.num_jump_tokens, eng.scheduler.num_jumps
                t0 = time.perf_counter()
                results = eng.generate(prompts, sp)
                wall = time.perf_counter() - t0
                eng.check_invariant()
                ids = [list(r.token_ids) for r in results]
                base = ids if base is None else base
                decodes = eng.forwards.count(ForwardMode.DECODE)
                rows.append([name, jm or "off", sum(map(len, ids)),
                             eng.num_jump_tokens - jumped0, eng.scheduler.num_jumps - jumps0,
                             decodes, len(eng.forwards) - decodes, wall,
                             "yes" if ids == base else "NO"])
            compiled = compiler.compile(parse_structured_outputs(spec))
            total = forced = string_jumps = 0
            runs: Counter[int] = Counter()
            for ids_one in base:
                state = compiler.new_state(compiled)
                mask = allocate_bitmask(1, state.vocab_size)
                total += len(ids_one)
                i = 0
                while i < len(ids_one):
                    run = forced_tokens(state, bitmask=mask, max_tokens=len(ids_one) - i,
                                        include_stop=True)
                    if run and ids_one[i:i + len(run)] == run:  # (greedy: always so)
                        forced += len(run)
                        runs[len(run)] += 1
                        for t in run:
                            state.accept_token(t)
                        i += len(run)
                        continue
                    jump = jump_forward_tokens(state, grammars.tokenizer,
                                               max_tokens=len(ids_one) - i)
                    string_jumps += bool(jump) and ids_one[i:i + len(jump)] == jump
                    state.accept_token(ids_one[i])
                    i += 1
            replay.append([name, total, forced, f"{forced / max(total, 1):.1%}",
                           ", ".join(f"{k}×{v}" for k, v in sorted(runs.items())) or "-",
                           string_jumps])
    finally:
        compiler.shutdown()
        for eng in engines.values():
            eng.close()
    table("Jump-forward through the engine (SmolLM2-135M-Instruct, CPU, fp32, greedy, "
          f"{len(PROMPTS)} requests per constraint in one batch)",
          ["constraint", "jump_forward_min_tokens", "output tokens", "tokens jumped",
           "jump extends", "decode forwards", "extend forwards", "wall s",
           "outputs equal to off"], rows)
    table("Forced tokens in those outputs (replayed through the grammar)",
          ["constraint", "output tokens", "forced tokens (a stop token included)",
           "forced share", "forced runs (length×count)",
           "string jumps equal to the model's ids"], replay)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
