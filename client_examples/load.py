"""Concurrent gRPC streaming load: N requests at concurrency C; reports throughput and errors.

Usage:
    python client_examples/load.py --model deepseek-v2-tiny --requests 64 --concurrency 8 \
        --max-tokens 32 --url localhost:8001

Each of C worker threads owns one gRPC stream and sends its share of the N requests one after
another (so C requests are in flight). Every request asks for exactly `--max-tokens` tokens
(min_tokens = max_tokens, ignore_eos) and `return_num_output_tokens`, so throughput counts the
tokens the server reports. Prints requests/s, output tokens/s, time to first token and latency
percentiles (ms) and the error count; exit code 1 when any request failed. Ctrl-C cancels the
requests in flight and exits with code 130.
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient

_POLL_S = 0.2  # how often a waiting thread checks for Ctrl-C (s)

@dataclass
class LoadResult:
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    output_tokens: int = 0
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        def pct(xs: list[float], q: float) -> float:
            return 1000 * float(np.percentile(xs, q)) if xs else float("nan")

        return {
            "requests": self.requests,
            "errors": len(self.errors),
            "wall_s": round(self.wall_s, 3),
            "requests_per_s": round(self.requests / self.wall_s, 3) if self.wall_s else 0.0,
            "output_tokens_per_s":
                round(self.output_tokens / self.wall_s, 1) if self.wall_s else 0.0,
            "ttft_ms_p50": round(pct(self.ttft_s, 50), 1),
            "ttft_ms_p99": round(pct(self.ttft_s, 99), 1),
            "latency_ms_mean": round(1000 * statistics.fmean(self.latency_s), 1)
            if self.latency_s else float("nan"),
            "latency_ms_p99": round(pct(self.latency_s, 99), 1),
        }


def _inputs(prompt: str, max_tokens: int) -> list[grpcclient.InferInput]:
    sampling = {"max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0}
    values = [
        ("text_input", np.array([prompt.encode("utf-8", "surrogateescape")],
                                dtype=np.object_), "BYTES"),
        ("stream", np.array([True]), "BOOL"),
        ("exclude_input_in_output", np.array([True]), "BOOL"),
        ("return_num_output_tokens", np.array([True]), "BOOL"),
        ("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_),
         "BYTES"),
    ]
    out = []
    for name, arr, dtype in values:
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def run_load(url: str, model: str, num_requests: int, concurrency: int, max_tokens: int = 32,
             prompts: list[str] | None = None, timeout_s: float = 600.0) -> LoadResult:
    """Send `num_requests` streaming requests with `concurrency` in flight; returns the stats."""
    prompts = prompts or ["Tell me about the history of the transformer architecture."]
    tickets = itertools.count()
    result = LoadResult()
    lock = threading.Lock()
    stop = threading.Event()  # Ctrl-C: each thread cancels its request and ends

    def worker() -> None:
        responses: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(url)
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        try:
            while not stop.is_set() and (i := next(tickets)) < num_requests:
                t0 = time.perf_counter()
                first = None
                tokens = 0
                error = None
                client.async_stream_infer(model, _inputs(prompts[i % len(prompts)], max_tokens),
                                          request_id=str(i), enable_empty_final_response=True)
                heard = t0  # the request's last response (or its start)
                while True:
                    if stop.is_set():
                        return
                    try:
                        r, e = responses.get(timeout=_POLL_S)
                    except queue.Empty:
                        if time.perf_counter() - heard > timeout_s:
                            error = f"request {i}: no response within {timeout_s} s"
                            break
                        continue
                    heard = time.perf_counter()
                    if e is not None:
                        error = f"request {i}: {e}"
                        break
                    n = r.as_numpy("num_output_tokens")
                    if n is not None and int(n[0]) > 0:
                        first = first or time.perf_counter()
                        tokens += int(n[0])
                    if r.get_response().parameters["triton_final_response"].bool_param:
                        break
                done = time.perf_counter()
                with lock:
                    result.requests += 1
                    if error is not None:
                        result.errors.append(error)
                        continue
                    result.output_tokens += tokens
                    result.latency_s.append(done - t0)
                    if first is not None:
                        result.ttft_s.append(first - t0)
        finally:
            client.stop_stream(cancel_requests=stop.is_set())
            client.close()

    t_start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(_POLL_S)
    except KeyboardInterrupt:
        stop.set()
        for t in threads:
            if t.is_alive():
                t.join()
        raise
    result.wall_s = time.perf_counter() - t_start
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="localhost:8001")
    ap.add_argument("--model", default="deepseek-v2-tiny")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt", action="append", help="prompt (repeatable; cycled)")
    args = ap.parse_args(argv)
    res = run_load(args.url, args.model, args.requests, args.concurrency, args.max_tokens,
                   args.prompt)
    print(json.dumps(res.summary(), indent=2))
    for e in res.errors[:10]:
        print("error:", e, file=sys.stderr)
    return 1 if res.errors else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted: the requests in flight were cancelled", file=sys.stderr)
        sys.exit(130)
