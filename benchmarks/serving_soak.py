"""Soak test: many streaming requests through tritonserver at a fixed concurrency, on a tiny model;
zero errors, zero leaked KV / request slots at the end, server memory flat after warm-up.

    .venv/bin/python benchmarks/serving_soak.py [--requests 10000] [--concurrency 32]
        [--model deepseek-v2-tiny] [--warmup 1000] [--json PATH]

Starts a tritonserver (`TritonServer`) over a temp repository with a copy of the model folder
(context 512, 4096-slot KV pool, radix cache on, request slots = concurrency) and sends
`--requests` requests closed-loop on one gRPC stream with `--concurrency` in flight
(`serving_client.stream_load`). Requests vary: 12 prompt templates (shared prefixes, so the radix
cache hits and evicts) with a per-request suffix, 4..24 output tokens (`ignore_eos`, so each must
return exactly its `max_tokens`), half greedy, half sampled (temperature 0.8, top_p 0.95; a seed on
most of them).

While it runs, a sampler thread reads the resident memory (RSS, /proc) of tritonserver and every
descendant (the Python-backend stub of the model) every `--sample-s` seconds. After the last
request: the model's gauges must show 0 running / 0 waiting requests and 0 KV usage; Triton's
request counters must match the client's (every request the server took ended normally: our
model answers a failed request with an error response, which Triton counts as a success, so
success count == our finished count and generated tokens == sum of max_tokens); then the server is
stopped and the model's unload line must report `pool invariant ok`, no live request and no
protected (request-held) KV slot.

Prints a table: requests, errors, wall time, requests/s, output tokens/s, RSS after warm-up (the
first `--warmup` requests) and at the end, the RSS trend after warm-up (least-squares slope, KiB per
1000 requests) and the end-of-run checks. Exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_client import (  # noqa: E402
    Job, LoadStats, ProcTree, read_metrics, series, stream_load, system_busy_s, temp_repository)

TEMPLATES = [
    "Write a short story about a lighthouse keeper who",
    "Explain to a child why the sky is blue and why sunsets are",
    "List three facts about the planet",
    "def fibonacci(n):\n    # compute the n-th Fibonacci number for n =",
    "Translate into French: the train to the coast leaves at",
    "Summarize the plot of a novel in which a detective",
    "Q: What is the capital of the country whose flag is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Give me a recipe for a soup made with",
    "The most important idea in multi-head latent attention is",
    "Compose a haiku about the number",
    "Describe the sound of rain on a tin roof during",
]


def make_jobs(n: int, seed: int = 0) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        prompt = f"{rng.choice(TEMPLATES)} {rng.randrange(10**6)} (request {i})"
        max_tokens = rng.randint(4, 24)
        sampling: dict = {"max_tokens": max_tokens, "ignore_eos": True}
        if i % 2 == 0:
            sampling["temperature"] = 0
        else:
            sampling.update(temperature=0.8, top_p=0.95)
            if i % 5 != 1:
                sampling["seed"] = i
        jobs.append(Job(prompt, sampling))
    return jobs


class RssSampler(threading.Thread):
    """Samples the RSS of the server's process tree every `period` seconds."""

    def __init__(self, tree: ProcTree, period: float) -> None:
        super().__init__(daemon=True)
        self.tree, self.period = tree, period
        self.done = 0  # requests finished so far (set by the caller)
        self.samples: list[tuple[float, int, int, dict[str, int]]] = []  # t, done, total, by name
        self._halt = threading.Event()

    def sample(self) -> tuple[int, dict[str, int]]:
        by_pid = self.tree.rss_bytes()
        by_name: dict[str, int] = {}
        for pid, rss in by_pid.items():
            name = ProcTree.name(pid)
            by_name[name] = by_name.get(name, 0) + rss
        total = sum(by_pid.values())
        self.samples.append((time.monotonic(), self.done, total, by_name))
        return total, by_name

    def run(self) -> None:
        while not self._halt.wait(self.period):
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join()


def slope_per_1k(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of RSS (bytes) over finished requests, in bytes per 1000 requests."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    if var == 0:
        return 0.0
    return 1000 * sum((x - mx) * (y - my) for x, y in points) / var


def settle(server, model: str, timeout: float = 60.0) -> dict:
    """Metrics once the model is idle (gauges 0) and its counters stopped moving."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        m = read_metrics(server)
        counters = (series(m, "nv_inference_request_success", model),
                    series(m, "vllm:e2e_request_latency_seconds_count", model),
                    series(m, "vllm:generation_tokens_total", model))
        idle = (series(m, "mla_backend:num_requests_running", model) == 0
                and series(m, "mla_backend:num_requests_waiting", model) == 0
                and series(m, "mla_backend:kv_cache_usage_ratio", model) == 0)
        if idle and counters == last:
            return m
        if time.monotonic() > deadline:
            return m
        last = counters
        time.sleep(0.5)


def mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--model", default="deepseek-v2-tiny",
                    help="model folder name in model_repository/")
    ap.add_argument("--warmup", type=int, default=1000,
                    help="requests before the 'after warm-up' RSS reading")
    ap.add_argument("--sample-s", type=float, default=2.0, help="RSS sampling period (s)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    from mla_tools.prepare import DEFAULT_MODEL_REPOSITORY, prepare
    from mla_tools.tritonserver import TritonServer

    prepare(DEFAULT_MODEL_REPOSITORY)
    name = f"{args.model}-soak"
    params = {"context_length": "512", "max_total_tokens": "4096",
              "max_running_requests": str(args.concurrency), "enable_radix_cache": "true",
              "chunked_prefill_size": "256", "max_prefill_tokens": "1024"}
    jobs = make_jobs(args.requests)
    expected_tokens = sum(j.sampling["max_tokens"] for j in jobs)
    warmup = min(args.warmup, args.requests)
    checks: dict[str, bool] = {}
    result: dict = {"model": args.model, "settings": params, "requests": args.requests,
                    "concurrency": args.concurrency, "date": time.strftime("%Y-%m-%d")}

    with tempfile.TemporaryDirectory(prefix="serving-soak-") as tmp:
        repo = temp_repository(Path(tmp) / "repo", {name: (args.model, params)})
        server = TritonServer(repo, startup_timeout=600, log_path=Path(tmp) / "server.log")
        with server:
            tree = ProcTree(server.proc.pid)
            sampler = RssSampler(tree, args.sample_s)
            rss_start, _ = sampler.sample()
            sampler.start()
            warm_rss: list[int] = []
            t0 = time.monotonic()

            def progress(done: int, stats: LoadStats) -> None:
                sampler.done = done
                if done == warmup:
                    warm_rss.append(sampler.sample()[0])
                if done % 1000 == 0 or done == warmup:
                    rss = sampler.samples[-1][2] if sampler.samples else 0
                    elapsed = time.monotonic() - t0
                    print(f"  {done:6d} done, {len(stats.errors)} errors, "
                          f"{done / elapsed:6.1f} req/s, RSS {mib(rss)}", flush=True)

            before = read_metrics(server)
            busy0, server_cpu0 = system_busy_s(), tree.cpu_s()
            stats = stream_load(server.grpc_url, name, jobs, args.concurrency, timeout_s=300.0,
                                progress_every=1, on_progress=progress)
            sampler.done = stats.requests
            server_cpu = tree.cpu_s() - server_cpu0
            other_cores = max(system_busy_s() - busy0 - server_cpu - stats.cpu_s,
                              0.0) / stats.wall_s
            m = settle(server, name)
            rss_end, by_name_end = sampler.sample()
            sampler.stop()
            server.check_alive()
        # stopped: the unload line of the model
        log = server.log_path.read_text(errors="replace")

    def delta(metric: str) -> float:
        return (series(m, metric, name) or 0.0) - (series(before, metric, name) or 0.0)

    failures = sum(v for (n, lab), v in m.items()
                   if n == "nv_inference_request_failure" and f'model="{name}"' in lab)
    success, finished = delta("nv_inference_request_success"), delta(
        "vllm:e2e_request_latency_seconds_count")
    generated = delta("vllm:generation_tokens_total")
    unload = re.search(rf"\[mla_backend\] {re.escape(name)}: unloaded; engine stats: ([^;]*); "
                       r"pool invariant (\w+)", log)
    unload_stats = ({k: int(v) for k, v in (kv.split("=") for kv in unload.group(1).split())}
                    if unload else {})
    error_lines = [ln for ln in log.splitlines() if ln.startswith("E") and "mla_backend" in ln]

    checks["zero client errors"] = not stats.errors
    checks["every request got all its tokens"] = (stats.output_tokens == expected_tokens
                                                  and stats.short == 0)
    checks["server counters match (success == finished, tokens)"] = (
        failures == 0 and success == finished == args.requests and generated == expected_tokens)
    checks["gauges idle at the end (running, waiting, KV usage 0)"] = (
        series(m, "mla_backend:num_requests_running", name) == 0
        and series(m, "mla_backend:num_requests_waiting", name) == 0
        and series(m, "mla_backend:kv_cache_usage_ratio", name) == 0)
    checks["unload: pool invariant ok, no live request, no held slot"] = bool(
        unload and unload.group(2) == "ok" and unload_stats.get("live") == 0
        and unload_stats.get("protected_slots") == 0
        and unload_stats["free_slots"] + unload_stats["evictable_slots"]
        == unload_stats["total_slots"])
    checks["no error lines from the adapter in the server log"] = not error_lines

    rss_warm = warm_rss[0] if warm_rss else rss_start
    post = [(done, rss) for _, done, rss, _ in sampler.samples if done >= warmup]
    trend = slope_per_1k(post)
    peak = max(rss for _, _, rss, _ in sampler.samples)
    result.update({
        "errors": len(stats.errors), "error_samples": stats.errors[:5],
        "wall_s": stats.wall_s, "requests_per_s": stats.requests_per_s,
        "output_tokens": stats.output_tokens, "output_tokens_per_s": stats.tokens_per_s,
        "rss_start_bytes": rss_start, "rss_after_warmup_bytes": rss_warm,
        "rss_end_bytes": rss_end, "rss_peak_bytes": peak, "rss_by_process_end": by_name_end,
        "rss_trend_bytes_per_1k_requests": trend, "server_success": success,
        "server_finished": finished, "server_failures": failures,
        "server_generated_tokens": generated, "unload_stats": unload_stats,
        "server_cpu_s": server_cpu, "client_cpu_s": stats.cpu_s,
        "other_programs_cores": other_cores,
        "checks": checks,
        "rss_samples": [(round(t - sampler.samples[0][0], 1), d, r)
                        for t, d, r, _ in sampler.samples],
    })
    print()
    print(f"model {args.model} ({params}), {args.requests} requests at concurrency "
          f"{args.concurrency}, one gRPC stream")
    print("| requests | errors | wall s | req/s | output tok/s | RSS start | RSS after warm-up "
          f"({warmup} req) | RSS end | RSS peak | RSS trend after warm-up |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {stats.requests} | {len(stats.errors)} | {stats.wall_s:.1f} | "
          f"{stats.requests_per_s:.1f} | {stats.tokens_per_s:.1f} | {mib(rss_start)} | "
          f"{mib(rss_warm)} | {mib(rss_end)} | {mib(peak)} | "
          f"{trend / 1024:+.1f} KiB / 1000 req |")
    print("RSS at the end by process: " + ", ".join(f"{k} {mib(v)}"
                                                   for k, v in sorted(by_name_end.items())))
    print(f"CPU: server {server_cpu:.0f} s, client {stats.cpu_s:.0f} s; other programs on the "
          f"machine used {other_cores:.2f} cores on average during the run")
    print(f"unload: {unload.group(0) if unload else 'no unload line'}")
    for what, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAILED'}] {what}")
    for e in stats.errors[:5]:
        print("  error:", e)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
