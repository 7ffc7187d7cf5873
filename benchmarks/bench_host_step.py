"""Host work of one decode step, by part, on the CPU (issue 6: with the overlap schedule a GPU
decode step takes max(GPU, host), and the host's share grows with the batch).

Runs the engine on the CPU with the tiny DeepSeek checkpoint (`checkpoints/deepseek-v2-tiny`,
float32), `--requests` streaming greedy requests of 16 prompt tokens submitted at once, and after
`--warmup` steps times `--steps` steps: the whole `Engine.step` and, wrapped around the engine's
methods, scheduling (`Scheduler.get_next_batch`), the forward batch
(`ModelRunner.make_forward_batch`), the forward, the sampler launch, committing the tokens
(`Engine._commit_tokens`), handing the batch back (`Scheduler.process_batch_result`) and
emitting them (`Engine._flush_tokens`), and, as one more column outside the step, the output
processor (`OutputProcessor.process`: text and stop strings of the step's outputs, which the
engine's front door runs on its own side). The forward and the sampler are the CPU's compute
here; the other parts are the per-request Python a GPU host runs too. Prints one table row of
ms per step and the per-request µs of the host parts.

    .venv/bin/python benchmarks/bench_host_step.py [--requests 512] [--steps 20] [--min-tokens]
        [--overlap] [--free-forward] [--max-total-tokens N]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_suite import table  # noqa: E402

from mla_backend.config import EngineConfig  # noqa: E402
from mla_backend.engine import Engine  # noqa: E402
from mla_backend.request import GenerateRequest, SamplingParams  # noqa: E402
from mla_backend.tokenizer.output_processor import OutputProcessor  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HOST_PARTS = ("schedule", "forward batch", "commit", "release", "flush")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(REPO / "checkpoints" / "deepseek-v2-tiny"))
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--min-tokens", action="store_true",
                    help="min_tokens = max_tokens on every request (as genai-perf sends)")
    ap.add_argument("--overlap", action="store_true",
                    help="the engine's overlap schedule, as on CUDA (each batch launched before "
                         "the previous one's tokens are read)")
    ap.add_argument("--free-forward", action="store_true",
                    help="the forward returns zero logits instead of running the model, so that "
                         "thousands of rows fit in the time (the sampler still runs)")
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="KV pool tokens (default: the engine's, from memory)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    extra = {} if args.max_total_tokens is None else {"max_total_tokens": args.max_total_tokens}
    eng = Engine(EngineConfig.create(model_path=args.model, dtype="float32", device="cpu",
                                     max_running_requests=args.requests, context_length=256,
                                     overlap_schedule="true" if args.overlap else "false",
                                     **extra))
    if args.free_forward:
        zeros = torch.zeros(args.requests, eng.runner.vocab_size)
        eng.runner.forward = lambda fb: zeros[: fb.batch_size]
    processor = OutputProcessor(eng.tokenizer)
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(obj: object, name: str, part: str) -> None:
        inner = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[part] += time.perf_counter() - t
        setattr(obj, name, wrapper)

    timed(eng.scheduler, "get_next_batch", "schedule")
    timed(eng.runner, "make_forward_batch", "forward batch")
    timed(eng.runner, "forward", "forward")
    timed(eng.sampler, "launch", "sampler")
    timed(eng, "_commit_tokens", "commit")
    timed(eng.scheduler, "process_batch_result", "release")
    timed(eng, "_flush_tokens", "flush")
    gen = torch.Generator().manual_seed(0)
    for i in range(args.requests):
        prompt = torch.randint(10, 1000, (16,), generator=gen).tolist()
        n = args.warmup + args.steps + 8
        sp = SamplingParams(max_new_tokens=n, min_new_tokens=n if args.min_tokens else 0,
                            temperature=0.0, ignore_eos=True)
        processor.add(f"h{i}", prompt, sp, stream=True)
        eng.add_request(GenerateRequest(rid=f"h{i}", input_ids=prompt, sampling_params=sp,
                                        stream=True))

    def step() -> int:
        outs = eng.step()
        t = time.perf_counter()
        processor.process(outs)
        spent["output processor"] += time.perf_counter() - t
        return len(outs)

    for _ in range(args.warmup):
        step()
    spent.clear()
    batch, t0 = 0, time.perf_counter()
    for _ in range(args.steps):
        batch = step()
    wall = 1000 * (time.perf_counter() - t0) / args.steps
    ms = {part: 1000 * s / args.steps for part, s in spent.items()}
    host = sum(ms.get(p, 0.0) for p in HOST_PARTS)
    table(f"Decode step on the CPU, {Path(args.model).name}, {batch} streaming requests "
          f"(ms per step, mean of {args.steps})",
          ["step", *ms.keys(), "host parts", "host µs per request"],
          [[round(wall, 2), *(round(v, 2) for v in ms.values()), round(host, 2),
            round(1000 * host / max(batch, 1), 1)]])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
