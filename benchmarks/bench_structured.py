"""Structured outputs against free generation, in one run (issue 43's benchmark).

    PYTHONPATH=. python3 benchmarks/bench_structured.py --model deepseek-v2-lite \
        --tokenizer-dir TOK [--batches 64 1024] [--quantization fp8 --kv-cache-dtype fp8_e4m3]

The engine in this process (`bench_suite.run_requests`: `Engine.step` and an `OutputProcessor`),
random weights of the model's shape (`mla_tools.model_shapes`). For each batch size B, B
requests are sent at once: constrained by a JSON schema of `SCHEMA_FIELDS` fields (greedy,
`max_tokens` 512: a request ends when its JSON is complete); the same with jump-forward on
(`Engine.jump_min` set to `--jump-forward-min-tokens`; the requests whose output length differs
are counted); then free (greedy, `ignore_eos`, each with as many tokens as its constrained twin
gave), so the runs produce the same tokens per request. Prompts: random ids of ShareGPT prompt
lengths, every one prefilled once in the warm-up (so no kernel is compiled inside a timed run)
and evicted from the radix cache before each timed run (so every run prefills every prompt).
Prints output tok/s of each run, constrained / free (target: >= 90%), jump-forward's gain and
the share of tokens it appended, each run's steps by kind with the time they waited for the GPU
(`bench_suite.StepLog`), and the schema's compile time cold (a new compiler) and cached (the
same text again). `--device cpu --shape-overrides ...` smoke-tests the script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_suite as bs  # noqa: E402
from sharegpt_lengths import DEFAULT_PATH, load_length_pairs  # noqa: E402

from mla_backend.constrained.grammar import GrammarCompiler  # noqa: E402
from mla_backend.constrained.spec import parse_structured_outputs  # noqa: E402
from mla_backend.request import SamplingParams  # noqa: E402
from mla_tools.model_shapes import SHAPES, write_shape_model  # noqa: E402

SCHEMA_FIELDS = 10
# ~10 fields of the kinds an API response has; strings bounded so random weights end them
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "name": {"type": "string", "maxLength": 24},
        "email": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "active": {"type": "boolean"},
        "score": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "city": {"type": "string", "maxLength": 16},
        "notes": {"type": ["string", "null"], "maxLength": 24},
    },
    "required": ["id", "name", "email", "age", "active", "score", "role", "tags", "city",
                 "notes"],
}
assert len(SCHEMA["properties"]) == SCHEMA_FIELDS


def compile_times(eng, repeats: int = 3) -> tuple[float, float]:
    """(cold s, cached s): the schema compiled by a new compiler, then submitted again."""
    spec = parse_structured_outputs({"json": SCHEMA})
    cold, cached = [], []
    for _ in range(repeats):
        compiler = GrammarCompiler(eng.tokenizer, eng.vocab_size,
                                   stop_token_ids=eng.grammars.stop_token_ids)
        t = time.perf_counter()
        compiler.compile(spec)
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        compiler.compile(spec)
        cached.append(time.perf_counter() - t)
        compiler.shutdown()
    return min(cold), min(cached)


def _logged(eng, prompts, outs, sampling) -> tuple[dict, "bs.StepLog"]:
    """`bs.run_requests` from a cold prefix cache, with its steps logged (`bs.StepLog`: per
    kind of step, the mean time and the time it waited for the GPU; a wait near 0 means the
    host set the pace)."""
    cache = eng.tree_cache
    cache.evict(cache.evictable_size())  # (the engine is idle: nothing is locked)
    if cache.evictable_size():
        raise RuntimeError(f"{cache.evictable_size()} cached tokens left after evicting all")
    log = bs.StepLog(eng)
    try:
        return bs.run_requests(eng, prompts, outs, log.on_step, sampling=sampling), log
    finally:
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=SHAPES, required=True)
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--lengths", default=str(DEFAULT_PATH))
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--graph-max-bs", type=int, default=1024)
    ap.add_argument("--quantization", default="", choices=["", "fp8"])
    ap.add_argument("--kv-cache-dtype", default="auto",
                    choices=["auto", "fp8_e4m3", "fp8_e5m2"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jump-forward-min-tokens", type=int, default=4,
                    help="the jump-forward run's setting (the engine's default is 0: off)")
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shape-overrides", default="{}")
    args = ap.parse_args()
    bs.DEVICE = args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_structured.py needs a CUDA GPU (or --device cpu for a smoke test)")
    bs.ENGINE_SETTINGS.update(quantization=args.quantization,
                              kv_cache_dtype=args.kv_cache_dtype)
    with tempfile.TemporaryDirectory(prefix="bench_structured_") as workdir:
        model_dir = write_shape_model(os.path.join(workdir, args.model), args.model,
                                      args.tokenizer_dir, **json.loads(args.shape_overrides))
        run(args, model_dir)


def run(args: argparse.Namespace, model_dir: str) -> None:
    most = max(args.batches)
    settings = {"max_running_requests": most}
    if args.device == "cuda":
        settings["cuda_graph_max_bs"] = min(args.graph_max_bs, most)
    eng = bs.make_engine(model_dir, **settings)
    cold, cached = compile_times(eng)
    bs.log(f"schema compile: cold {cold * 1e3:.1f} ms, cached {cached * 1e6:.0f} µs")
    vocab = eng.vocab_size
    pairs = load_length_pairs(args.lengths, most, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [bs.random_prompt(gen, p, vocab) for p, _ in pairs]
    bs.run_requests(eng, prompts, [8] * most)  # every prefill size compiled
    rows, results = [], {"date": time.strftime("%Y-%m-%d"), "schema_fields": SCHEMA_FIELDS,
                         "compile_cold_s": cold, "compile_cached_s": cached, "batches": {}}
    for b in args.batches:
        constrained = [SamplingParams.from_dict(
            {"temperature": 0, "max_tokens": 512, "structured_outputs": {"json": SCHEMA}})] * b
        bs.run_requests(eng, prompts[:min(b, 64)], [8] * min(b, 64),
                        sampling=constrained[:min(b, 64)])  # the grammar path warmed up
        con, con_steps = _logged(eng, prompts[:b], [0] * b, constrained)
        jump_min, jumped0 = eng.jump_min, eng.num_jump_tokens
        eng.jump_min = args.jump_forward_min_tokens  # the same requests with jump-forward
        jmp, jmp_steps = _logged(eng, prompts[:b], [0] * b, constrained)
        eng.jump_min = jump_min
        jumped = eng.num_jump_tokens - jumped0
        free, free_steps = _logged(eng, prompts[:b], con["tokens"], None)
        # (bf16 logits of random weights have near ties, and a batch of another composition
        # rounds differently: a few greedy outputs may differ with or without jump-forward)
        differ = sum(a != b for a, b in zip(jmp["tokens"], con["tokens"]))
        bs.log(f"batch {b}: {differ} of {b} outputs have another length with jump-forward")
        graph_max = settings.get("cuda_graph_max_bs", 0)
        for name, r, log in (("constrained", con, con_steps), ("free", free, free_steps),
                             ("constrained, jump-forward", jmp, jmp_steps)):
            bs.table(f"Steps of the {name} run at batch {b} ({r['seconds']:.1f} s)",
                     bs.StepLog.HEADER, log.table_rows(graph_max, r["seconds"]))
        if con["errors"] or free["errors"] or jmp["errors"]:
            raise RuntimeError(f"errors: constrained {con['errors']}, free {free['errors']}, "
                               f"jump-forward {jmp['errors']}")
        c_tps = con["output_tokens"] / con["seconds"]
        f_tps = free["output_tokens"] / free["seconds"]
        j_tps = jmp["output_tokens"] / jmp["seconds"]
        rows.append([b, con["output_tokens"] / b, round(f_tps), round(c_tps),
                     f"{100 * c_tps / f_tps:.1f}%", round(j_tps),
                     f"{100 * jumped / max(jmp['output_tokens'], 1):.1f}%",
                     f"{100 * (j_tps / c_tps - 1):+.1f}%"])
        results["batches"][b] = {"tokens_per_request": con["output_tokens"] / b,
                                 "free_tok_s": f_tps, "constrained_tok_s": c_tps,
                                 "constrained_jump_tok_s": j_tps, "jumped_tokens": jumped,
                                 "lengths_differ_with_jump": differ}
    bs.table(f"JSON schema ({SCHEMA_FIELDS} fields) vs free, {args.model}"
             f"{' ' + args.quantization if args.quantization else ''}, greedy, {args.device}",
             ["batch", "tokens per request", "free tok/s", "constrained tok/s",
              "constrained / free",
              f"constrained tok/s, jump_forward_min_tokens {args.jump_forward_min_tokens}",
              "tokens jumped", "jump-forward's gain"], rows)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
