"""Server-path cost: output tokens/s through tritonserver (gRPC streaming) vs the in-process Engine,
same model, same settings, same requests, at each concurrency, in one run.

    .venv/bin/python benchmarks/serving_overhead.py [--model deepseek-v2-tiny]
        [--concurrency 1 64] [--max-tokens 64] [--requests N] [--repeats 3]
        [--stream-intervals 1 4] [--sender-threads 1 4]

Each request: a distinct prompt, `max_tokens` = `min_tokens` = `--max-tokens`, `ignore_eos`,
greedy, streaming. At concurrency C, N requests (default max(8, C)) run closed-loop with C in
flight (a finished request is replaced at once); C = 64 with N = 64 is "64 submitted together".
Radix cache off (every prompt is new anyway), pool and request slots sized for the largest C.

- in-process: `Engine` in this process (`serving_client.engine_load`), (1) built and stepped by
  the main thread with torch's default threads, and (2) as the adapter runs it: built and
  stepped on one second thread with the adapter's default intra-op threads
  (INTRA_OP_THREAD_COUNT "auto": one fewer than the cores, at least 1). (2) isolates the serving
  path proper (same engine, same threads); (1) shows what the engine does with every core to
  itself;
- server: a tritonserver over a temp repository with a copy of the model folder and the same
  settings, one gRPC stream carrying the C requests (`serving_client.stream_load`; the client
  runs in this process, on the same cores as the server). One copy per `--stream-intervals`
  value (the adapter's STREAM_INTERVAL: 1 = a response per token, the default; N = after the
  first, a response per N tokens) and `--sender-threads` value (the adapter's
  RESPONSE_SENDER_THREADS; 0 = the adapter's default), all in the same server, measured one
  after another.

Both sides are warmed up first (a few requests at concurrency 1 and a full wave at each C); each
measurement is repeated `--repeats` times and the median is reported, with the CPU seconds per
1000 output tokens (in-process: this process; server: tritonserver and its stub processes, plus
the client). Prints a table and writes it as JSON with `--json PATH`.
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
    REPO, Job, ProcTree, engine_load, stream_load, system_busy_s, temp_repository)

BASE_PROMPT = ("Write a detailed story about a lighthouse keeper who finds a message in a bottle "
               "and decides to")


def jobs_for(n: int, max_tokens: int, tag: str) -> list[Job]:
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


def measure(run, levels: list[int], n_requests, max_tokens: int, repeats: int, side: str,
            cpu_of=None) -> dict[int, dict]:
    """Warm up, then `repeats` runs per level; median tokens/s and CPU s per 1000 tokens.

    A run during which other programs on the machine used more than MAX_OTHER_LOAD cores (busy
    time of /proc/stat minus ours) is discarded and redone after a pause, up to RETRIES times.
    """
    run(jobs_for(2, max_tokens, f"{side}-warm"), 1)
    for c in levels:
        run(jobs_for(c, max(8, max_tokens // 4), f"{side}-warm{c}"), c)
    out = {}
    for c in levels:
        rates, cpus, client_cpus, others = [], [], [], []
        for r in range(repeats):
            for attempt in range(RETRIES + 1):
                jobs = jobs_for(n_requests(c), max_tokens, f"{side}-{c}-{r}-{attempt}")
                cpu0 = cpu_of() if cpu_of else 0.0
                busy0 = system_busy_s()
                stats = run(jobs, c)
                cpu = (cpu_of() - cpu0) if cpu_of else stats.cpu_s
                # cores' worth of CPU that other programs used during the run
                other = max(system_busy_s() - busy0 - cpu - (stats.cpu_s if cpu_of else 0.0),
                            0.0) / stats.wall_s
                if other <= MAX_OTHER_LOAD or attempt == RETRIES:
                    break
                print(f"  {side:10s} c={c:<3d} run {r}: discarded ({stats.tokens_per_s:.1f} "
                      f"tok/s; other programs used {other:.2f} cores)", flush=True)
                time.sleep(15)
            others.append(other)
            if stats.errors or stats.output_tokens != len(jobs) * max_tokens:
                raise SystemExit(f"{side} c={c}: {len(stats.errors)} errors, "
                                 f"{stats.output_tokens} tokens: {stats.errors[:3]}")
            rates.append(stats.tokens_per_s)
            cpus.append(1000 * cpu / stats.output_tokens)
            client_cpus.append(1000 * stats.cpu_s / stats.output_tokens)
            print(f"  {side:10s} c={c:<3d} run {r}: {stats.tokens_per_s:8.1f} tok/s "
                  f"({stats.output_tokens} tokens in {stats.wall_s:.2f} s; other programs "
                  f"{others[-1]:.2f} cores)", flush=True)
        out[c] = {"tokens_per_s": statistics.median(rates), "runs": rates,
                  "cpu_s_per_1k_tokens": statistics.median(cpus),
                  "client_cpu_s_per_1k_tokens": statistics.median(client_cpus),
                  "other_programs_cores": others,
                  "requests": n_requests(c)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v2-tiny",
                    help="model folder name in model_repository/")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per measurement (0: max(8, concurrency))")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stream-intervals", type=int, nargs="+", default=[1],
                    help="STREAM_INTERVAL values to serve (one model copy each)")
    ap.add_argument("--sender-threads", type=int, nargs="+", default=[0],
                    help="RESPONSE_SENDER_THREADS values to serve (0: the adapter's default)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    import torch

    from mla_backend.config import EngineConfig
    from mla_backend.engine import Engine
    from mla_backend.tools.prepare import DEFAULT_MODEL_REPOSITORY, prepare
    from mla_backend.tools.tritonserver import TritonServer

    prepare(DEFAULT_MODEL_REPOSITORY)
    levels = args.concurrency
    params = settings(max(levels), args.max_tokens)

    def n_requests(c: int) -> int:
        return args.requests or max(8, c)

    weights = REPO / "model_repository" / args.model / "weights"
    print(f"model {args.model}, settings {params}, max_tokens {args.max_tokens}, "
          f"torch threads {torch.get_num_threads()}", flush=True)

    default_threads = torch.get_num_threads()
    engine = Engine(EngineConfig.create(model_path=str(weights), **params))
    inproc = measure(lambda jobs, c: engine_load(engine, jobs, c), levels, n_requests,
                     args.max_tokens, args.repeats, "in-process")
    engine.check_invariant()
    engine.shutdown()
    del engine
    gc.collect()
    threaded: dict[int, dict] = {}
    adapter_threads = max(1, len(os.sched_getaffinity(0)) - 1)  # INTRA_OP_THREAD_COUNT "auto"

    def as_the_adapter() -> None:  # built and stepped on one non-main thread, capped threads
        torch.set_num_threads(adapter_threads)
        eng = Engine(EngineConfig.create(model_path=str(weights), **params))
        threaded.update(measure(lambda jobs, c: engine_load(eng, jobs, c), levels,
                                n_requests, args.max_tokens, args.repeats, "in-proc adp"))
        eng.check_invariant()
        eng.shutdown()

    worker = threading.Thread(target=as_the_adapter)
    worker.start()
    worker.join()
    if not threaded:
        raise SystemExit("the in-process run as the adapter runs it failed")
    torch.set_num_threads(default_threads)

    variants = [(k, n) for k in args.stream_intervals for n in args.sender_threads]
    names = {v: f"{args.model}-bench-si{v[0]}-st{v[1]}" for v in variants}
    adapter_params = {}
    for (k, n), name in names.items():
        adapter_params[name] = {"STREAM_INTERVAL": str(k)}
        if n > 0:
            adapter_params[name]["RESPONSE_SENDER_THREADS"] = str(n)
    served: dict[tuple[int, int], dict[int, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="serving-overhead-") as tmp:
        models = {name: (args.model, params) for name in names.values()}
        repo = temp_repository(Path(tmp) / "repo", models, adapter_params)
        with TritonServer(repo, startup_timeout=600) as server:
            tree = ProcTree(server.proc.pid)
            for (k, n), name in names.items():
                served[(k, n)] = measure(
                    lambda jobs, c, name=name: stream_load(server.grpc_url, name, jobs, c),
                    levels, n_requests, args.max_tokens, args.repeats,
                    f"server si{k} st{n or 'default'}", cpu_of=tree.cpu_s)

    rows = []
    print(f"\nmodel {args.model}, {args.max_tokens} output tokens per request, greedy, "
          f"median of {args.repeats}; {platform.processor() or platform.machine()}, "
          f"torch threads: {default_threads} in-process, {adapter_threads} as the adapter")
    print("| concurrency | requests | STREAM_INTERVAL | RESPONSE_SENDER_THREADS "
          "| in-process tok/s (main thread) "
          "| in-process tok/s (as the adapter) | server tok/s | server / in-process "
          "| server / in-process (as the adapter) | in-process CPU s/1k tok | server CPU s/1k tok "
          "| client CPU s/1k tok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in levels:
        a, t = inproc[c], threaded[c]
        for k, n in variants:
            b = served[(k, n)][c]
            ratio = b["tokens_per_s"] / a["tokens_per_s"]
            ratio_t = b["tokens_per_s"] / t["tokens_per_s"]
            rows.append({"concurrency": c, "stream_interval": k, "sender_threads": n,
                         "in_process": a, "in_process_thread": t, "server": b, "ratio": ratio,
                         "ratio_thread": ratio_t})
            print(f"| {c} | {a['requests']} | {k} | {n or 'default'} | {a['tokens_per_s']:.1f} | "
                  f"{t['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | {100 * ratio:.1f}% | "
                  f"{100 * ratio_t:.1f}% | {a['cpu_s_per_1k_tokens']:.2f} | "
                  f"{b['cpu_s_per_1k_tokens']:.2f} | {b['client_cpu_s_per_1k_tokens']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "settings": params,
                                               "max_tokens": args.max_tokens, "rows": rows,
                                               "date": time.strftime("%Y-%m-%d")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
