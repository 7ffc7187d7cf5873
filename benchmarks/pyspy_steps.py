"""Where the host's time goes in a peak-throughput run, from a py-spy sampling profile (issue 6:
with the overlap schedule a decode step takes max(GPU, host)).

Reads py-spy's raw output (one line per distinct stack: `frame;frame;... count`, frames as
`function (file:line)`), keeps the samples of the timed run of `bench_profile.py --sections
steps` (stacks through `section_steps` and `run_requests`, not `warm_up`) that are inside
`Engine.step`, and prints, for each function named, the samples whose stack passes through it
(inclusive: a function and what it calls), in seconds at `--rate` and as a share of the step
samples. A sampler times every function alike, where cProfile's per-call cost inflates the
Python-heavy ones; it still slows a host-bound run noticeably, and `--nonblocking` loses
samples, so read the shares, not absolute seconds, and take throughput from a run without it.

    py-spy record --nonblocking --idle --rate 200 --format raw -o run.folded -- \\
        python3 benchmarks/bench_profile.py --model deepseek-v2-lite --tokenizer-dir TOK \\
        --sections steps ...
    python3 benchmarks/pyspy_steps.py run.folded [--rate 200] [--functions F ...]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import sys

# The engine's step, by part (functions of mla_backend and the libraries it calls).
DEFAULT_FUNCTIONS = [
    "Event.synchronize",  # the host waits for the GPU (a sampled batch's tokens)
    "Engine._flush_tokens",  # detokenization, stop strings, the outputs
    "IncrementalDetokenizer.add_token",
    "Engine._emit",
    "Engine._commit_tokens",  # includes the wait above
    "Scheduler.get_next_batch",
    "Scheduler._get_new_batch_prefill",
    "Scheduler._get_new_batch_decode",
    "Scheduler.process_batch_result",
    "DeepseekV2ForCausalLM.forward",  # eager forwards: the prefills' kernel launches
    "CudaGraphRunner.replay",
    "Sampler.launch",
    "ModelRunner.make_forward_batch",
]


def open_folded(path: str):
    """A py-spy raw file for reading as text (gzip when it ends in .gz)."""
    return gzip.open(path, "rt") if path.endswith(".gz") else open(path)


def step_samples(path: str) -> tuple[int, collections.Counter]:
    """(samples inside `Engine.step` of the timed run, samples per function name through which
    those stacks pass)."""
    total = 0
    through: collections.Counter = collections.Counter()
    with open_folded(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            names = {frame.split(" (", 1)[0] for frame in stack.split(";")}
            if ("section_steps" not in names or "run_requests" not in names
                    or "warm_up" in names or "Engine.step" not in names):
                continue
            count = int(n)
            total += count
            for name in names:
                through[name] += count
    return total, through


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folded", help="py-spy --format raw output (.gz allowed)")
    ap.add_argument("--rate", type=float, default=200.0, help="py-spy's --rate (samples/s)")
    ap.add_argument("--functions", nargs="+", default=DEFAULT_FUNCTIONS)
    args = ap.parse_args(argv)
    total, through = step_samples(args.folded)
    if not total:
        print("no samples inside Engine.step of a timed bench_profile.py run", file=sys.stderr)
        return 1
    print("| function | samples | s | % of Engine.step |\n|---|---|---|---|")
    print(f"| Engine.step | {total} | {total / args.rate:.2f} | 100 |")
    for name in args.functions:
        n = through[name]
        print(f"| {name} | {n} | {n / args.rate:.2f} | {100 * n / total:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
