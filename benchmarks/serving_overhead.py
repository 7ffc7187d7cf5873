"""Server-path cost: output tokens/s through tritonserver (gRPC streaming) vs the in-process Engine,
same model, same settings, same requests, at each concurrency, in one run.

    .venv/bin/python benchmarks/serving_overhead.py [--model deepseek-v2-tiny]
        [--concurrency 1 64] [--max-tokens 64] [--requests N] [--repeats 3]
        [--stream-intervals 1 4] [--sender-threads 1 4] [--engine-process true false]

Each request: a distinct prompt (the same prompts on every side of a comparison), `max_tokens`
= `min_tokens` = `--max-tokens`, `ignore_eos`, greedy, streaming. At concurrency C, N requests
(default max(16, C)) run closed-loop with C in flight (a finished request is replaced at once);
C = 64 with N = 64 is "64 submitted together".
Radix cache off (every prompt is new anyway), pool and request slots sized for the largest C.

- in-process: `Engine` in this process (`serving_client.engine_load`), (1) with torch's
  default threads (every core to itself), measured first and alone, and (2) as the adapter runs
  it: built and stepped on the main thread of its process (the adapter's engine process) with
  the adapter's default intra-op threads (INTRA_OP_THREAD_COUNT "auto": one fewer than the
  cores, at least 1). (2) isolates the serving path proper (same engine, same threads);
- server: a tritonserver over a temp repository with a copy of the model folder and the same
  settings, one gRPC stream carrying the C requests (`serving_client.stream_load`; the client
  runs in this process, on the same cores as the server). One copy per combination of
  `--stream-intervals` (the adapter's STREAM_INTERVAL: 1 = a response per token, the default;
  N = after the first, a response per N tokens), `--sender-threads` (RESPONSE_SENDER_THREADS;
  0 = the adapter's default) and `--engine-process` (ENGINE_PROCESS) values, all in the same
  server. The runs of (2) and of every server copy alternate (repeat 1 of each, then repeat 2,
  ...), so a drift of the machine's speed during the benchmark hits every side alike.

Both sides are warmed up first (a few requests at concurrency 1 and a full wave at each C); each
measurement is repeated `--repeats` times and the median is reported; the server / in-process
(as the adapter) ratio also per run pair (median and quartiles; the pair's two runs are back to
back) and fastest run against fastest run (a shared VM's noise only slows runs down), with the
CPU seconds per 1000 output tokens (in-process: this process; server: tritonserver and its stub
processes, plus the client), and per program the CPU and run-queue wait per output token and
how often its threads were scheduled in (/proc/<pid>/task/<tid>/schedstat: a thread that
blocks, e.g. on the GIL, or is preempted is scheduled in again). Prints the tables and writes
them as JSON with `--json PATH`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_client import (  # noqa: E402
    REPO, Job, ProcTree, engine_load, sched_of, stream_load, system_busy_s, temp_repository)

BASE_PROMPT = ("Write a detailed story about a lighthouse keeper who finds a message in a bottle "
               "and decides to")


def jobs_for(n: int, max_tokens: int, tag: str) -> list[Job]:
    """`n` requests with distinct prompts "[<tag> <i>] ..."; every side of a comparison must get
    the same `tag` (the same prompts): a longer tag is a longer prompt, i.e. more work."""
    sampling = {"max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0}
    return [Job(f"[{tag} {i}] {BASE_PROMPT} visit island number {i}.", sampling)
            for i in range(n)]


def settings(max_concurrency: int, max_tokens: int) -> dict[str, str]:
    return {"context_length": "512",
            "max_total_tokens": str(max(4096, max_concurrency * (64 + max_tokens) * 2)),
            "max_running_requests": str(max_concurrency), "enable_radix_cache": "false",
            "chunked_prefill_size": "4096", "max_prefill_tokens": "8192"}


MAX_OTHER_LOAD = 0.15  # cores; a run during which other programs used more is redone
RETRIES = 20


def warm_up(run, levels: list[int], max_tokens: int) -> None:
    """A few requests at concurrency 1, then one short wave at each level."""
    run(jobs_for(2, max_tokens, "warm"), 1)
    for c in levels:
        run(jobs_for(c, max(8, max_tokens // 4), f"warm{c}"), c)


def one_run(run, c: int, n: int, max_tokens: int, tag: str, side: str, sched, cpu_of=None
            ) -> dict:
    """One measurement of `n` requests at concurrency `c` (prompts `jobs_for(..., tag)`: give
    each side of a comparison the same `tag`): tokens/s and CPU s per 1000 tokens,
    and per program (`sched`: a callable of program name → `sched_of` counters) µs of CPU and of
    run-queue wait per output token and times scheduled in per 1000 tokens.

    A run during which other programs on the machine used more than MAX_OTHER_LOAD cores (busy
    time of /proc/stat minus ours) is discarded and redone after a pause, up to RETRIES times.

    Raises:
        SystemExit: a request failed or a run produced the wrong number of tokens.
    """
    for attempt in range(RETRIES + 1):
        jobs = jobs_for(n, max_tokens, f"{tag}-{attempt}")
        cpu0 = cpu_of() if cpu_of else 0.0
        sched0 = sched()
        busy0 = system_busy_s()
        stats = run(jobs, c)
        cpu = (cpu_of() - cpu0) if cpu_of else stats.cpu_s
        sched1 = sched()
        split = {name: [b - a for a, b in zip(sched0.get(name, [0.0] * 3), counters)]
                 for name, counters in sched1.items()}
        # cores' worth of CPU that other programs used during the run
        other = max(system_busy_s() - busy0 - cpu - (stats.cpu_s if cpu_of else 0.0),
                    0.0) / stats.wall_s
        if other <= MAX_OTHER_LOAD or attempt == RETRIES:
            break
        print(f"  {side:24s} c={c:<3d}: discarded ({stats.tokens_per_s:.1f} tok/s; other "
              f"programs used {other:.2f} cores)", flush=True)
        time.sleep(15)
    if stats.errors or stats.output_tokens != len(jobs) * max_tokens:
        raise SystemExit(f"{side} c={c}: {len(stats.errors)} errors, "
                         f"{stats.output_tokens} tokens: {stats.errors[:3]}")
    print(f"  {side:24s} c={c:<3d}: {stats.tokens_per_s:8.1f} tok/s ({stats.output_tokens} "
          f"tokens in {stats.wall_s:.2f} s; other programs {other:.2f} cores)", flush=True)
    return {"tokens_per_s": stats.tokens_per_s,
            "cpu_s_per_1k_tokens": 1000 * cpu / stats.output_tokens,
            "client_cpu_s_per_1k_tokens": 1000 * stats.cpu_s / stats.output_tokens,
            "other_programs_cores": other,
            "sched": {name: [1e6 * cpu / stats.output_tokens, 1e6 * wait / stats.output_tokens,
                             1e3 * slices / stats.output_tokens]
                      for name, (cpu, wait, slices) in split.items()}}


def pair_ratios(in_process: list[float], server: list[float]) -> list[float]:
    """server / in-process tokens/s of each repeat: the two runs of a pair ran back to back, so
    the ratio cancels the drifts of this VM's speed slower than a pair (median and quartiles in
    the table). The fastest run of each side is the other robust reading: noise on a shared
    VM only ever slows a run down."""
    return [b / a for a, b in zip(in_process, server)]


def summarize(runs: list[dict], n: int) -> dict:
    """Median tokens/s and CPU of `runs` (dicts of `one_run`), with every run's rate."""
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "runs": [r["tokens_per_s"] for r in runs],
            "cpu_s_per_1k_tokens": statistics.median(r["cpu_s_per_1k_tokens"] for r in runs),
            "client_cpu_s_per_1k_tokens": statistics.median(
                r["client_cpu_s_per_1k_tokens"] for r in runs),
            "other_programs_cores": [r["other_programs_cores"] for r in runs], "requests": n,
            "sched": {name: [statistics.median(r["sched"][name][i] for r in runs)
                             for i in range(3)] for name in runs[0]["sched"]}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v2-tiny",
                    help="model folder name in model_repository/")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per measurement (0: max(16, concurrency))")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stream-intervals", type=int, nargs="+", default=[1],
                    help="STREAM_INTERVAL values to serve (one model copy each)")
    ap.add_argument("--sender-threads", type=int, nargs="+", default=[0],
                    help="RESPONSE_SENDER_THREADS values to serve (0: the adapter's default)")
    ap.add_argument("--engine-process", nargs="+", default=["true"], choices=["true", "false"],
                    help="ENGINE_PROCESS values to serve (true, the default: the engine in a "
                         "child process of the stub; false: on a thread of the stub)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    import torch

    from mla_backend.config import EngineConfig
    from mla_backend.engine import Engine
    from mla_tools.prepare import DEFAULT_MODEL_REPOSITORY, prepare
    from mla_tools.tritonserver import TritonServer

    prepare(DEFAULT_MODEL_REPOSITORY)
    levels = args.concurrency
    params = settings(max(levels), args.max_tokens)

    def n_requests(c: int) -> int:
        return args.requests or max(16, c)

    weights = REPO / "model_repository" / args.model / "weights"
    print(f"model {args.model}, settings {params}, max_tokens {args.max_tokens}, "
          f"torch threads {torch.get_num_threads()}", flush=True)

    # (1) the engine with every core to itself: torch's default threads, measured alone.
    default_threads = torch.get_num_threads()
    engine = Engine(EngineConfig.create(model_path=str(weights), **params))
    run_main = lambda jobs, c: engine_load(engine, jobs, c)  # noqa: E731
    warm_up(run_main, levels, args.max_tokens)
    # the thread that steps the in-process engine (engine_load runs on this, the main thread)
    main_tid = threading.get_native_id()
    sched_self = lambda: {"in-process engine": sched_of(os.getpid(), main_tid)}  # noqa: E731
    inproc = {c: summarize([one_run(run_main, c, n_requests(c), args.max_tokens,
                                    f"{c}-{r}", "in-process (default threads)",
                                    sched_self)
                            for r in range(args.repeats)], n_requests(c)) for c in levels}
    engine.check_invariant()
    engine.shutdown()
    del engine, run_main
    gc.collect()

    # (2) as the adapter runs it: built and stepped on the main thread of its process (the
    # engine process) with INTRA_OP_THREAD_COUNT "auto" threads; its runs alternate with the
    # server's, so drifts of this VM's speed hit both alike.
    adapter_threads = max(1, len(os.sched_getaffinity(0)) - 1)
    torch.set_num_threads(adapter_threads)
    engine = Engine(EngineConfig.create(model_path=str(weights), **params))
    run_adp = lambda jobs, c: engine_load(engine, jobs, c)  # noqa: E731

    variants = [(k, n, p) for k in args.stream_intervals for n in args.sender_threads
                for p in args.engine_process]
    names = {v: f"{args.model}-bench-si{v[0]}-st{v[1]}-ep{v[2][0]}" for v in variants}
    adapter_params = {}
    for (k, n, p), name in names.items():
        adapter_params[name] = {"STREAM_INTERVAL": str(k), "ENGINE_PROCESS": p}
        if n > 0:
            adapter_params[name]["RESPONSE_SENDER_THREADS"] = str(n)
    label = {v: f"server si{v[0]} st{v[1] or 'default'} ep {v[2]}" for v in variants}
    adp_runs: dict[int, list[dict]] = {c: [] for c in levels}
    srv_runs: dict[tuple, dict[int, list[dict]]] = {v: {c: [] for c in levels} for v in variants}
    with tempfile.TemporaryDirectory(prefix="serving-overhead-") as tmp:
        models = {name: (args.model, params) for name in names.values()}
        repo = temp_repository(Path(tmp) / "repo", models, adapter_params)
        with TritonServer(repo, startup_timeout=600) as server:
            tree = ProcTree(server.proc.pid)

            # (Not the client: its gRPC threads end with each run, and an ended thread's
            # counters are gone; its CPU is in the main table.)
            sched_server = tree.sched_by_name
            serve = {v: (lambda jobs, c, name=name: stream_load(server.grpc_url, name, jobs, c))
                     for v, name in names.items()}
            warm_up(run_adp, levels, args.max_tokens)
            for v in variants:
                warm_up(serve[v], levels, args.max_tokens)
            for r in range(args.repeats):
                for c in levels:
                    adp_runs[c].append(one_run(run_adp, c, n_requests(c), args.max_tokens,
                                               f"{c}-{r}", "in-process (as the adapter)",
                                               sched_self))
                    for v in variants:
                        srv_runs[v][c].append(one_run(serve[v], c, n_requests(c),
                                                      args.max_tokens, f"{c}-{r}",
                                                      label[v], sched_server,
                                                      cpu_of=tree.cpu_s))
    engine.check_invariant()
    engine.shutdown()
    torch.set_num_threads(default_threads)
    threaded = {c: summarize(adp_runs[c], n_requests(c)) for c in levels}
    served = {v: {c: summarize(srv_runs[v][c], n_requests(c)) for c in levels} for v in variants}

    rows = []
    print(f"\nmodel {args.model}, {args.max_tokens} output tokens per request, greedy, "
          f"median of {args.repeats}; {platform.processor() or platform.machine()}, "
          f"torch threads: {default_threads} in-process, {adapter_threads} as the adapter")
    print("| concurrency | requests | STREAM_INTERVAL | RESPONSE_SENDER_THREADS | ENGINE_PROCESS "
          "| in-process tok/s (default threads) "
          "| in-process tok/s (as the adapter) | server tok/s | server / in-process "
          "| server / in-process (as the adapter) | same, per run pair: median [quartiles] "
          "| same, fastest / fastest | in-process CPU s/1k tok | server CPU s/1k tok "
          "| client CPU s/1k tok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in levels:
        a, t = inproc[c], threaded[c]
        for k, n, p in variants:
            b = served[(k, n, p)][c]
            ratio = b["tokens_per_s"] / a["tokens_per_s"]
            ratio_t = b["tokens_per_s"] / t["tokens_per_s"]
            pairs = pair_ratios(t["runs"], b["runs"])
            best = max(b["runs"]) / max(t["runs"])
            rows.append({"concurrency": c, "stream_interval": k, "sender_threads": n,
                         "engine_process": p, "in_process": a, "in_process_thread": t,
                         "server": b, "ratio": ratio, "ratio_thread": ratio_t,
                         "ratio_thread_pairs": pairs, "ratio_thread_fastest": best})
            q1, q2, q3 = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else pairs * 3
            print(f"| {c} | {a['requests']} | {k} | {n or 'default'} | {p} | "
                  f"{a['tokens_per_s']:.1f} | "
                  f"{t['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | {100 * ratio:.1f}% | "
                  f"{100 * ratio_t:.1f}% | {100 * q2:.1f}% [{100 * q1:.1f}–{100 * q3:.1f}%] | "
                  f"{100 * best:.1f}% | {a['cpu_s_per_1k_tokens']:.2f} | "
                  f"{b['cpu_s_per_1k_tokens']:.2f} | {b['client_cpu_s_per_1k_tokens']:.2f} |")
    print("\nPer program, medians of the runs: CPU µs / run-queue wait µs per output token, "
          "times scheduled in per 1000 tokens (python3: the engine process)")
    print("| concurrency | side | program | CPU µs/token | run-queue wait µs/token "
          "| scheduled in /1k tokens |")
    print("|---|---|---|---|---|---|")
    for c in levels:
        sides = [("in-process (as the adapter)", threaded[c])] + [
            (f"server ENGINE_PROCESS {p}, STREAM_INTERVAL {k}, senders {n or 'default'}",
             served[(k, n, p)][c]) for k, n, p in variants]
        for side, result in sides:
            for name, (cpu, wait, slices) in sorted(result["sched"].items()):
                print(f"| {c} | {side} | {name} | {cpu:.1f} | {wait:.1f} | {slices:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "settings": params,
                                               "max_tokens": args.max_tokens, "rows": rows,
                                               "date": time.strftime("%Y-%m-%d")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
