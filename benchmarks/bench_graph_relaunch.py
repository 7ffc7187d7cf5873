"""Whether the host waits when it launches a CUDA graph whose previous launch is still running
on the GPU (the overlap schedule replays the same batch-size bucket's graph every decode step).

Captures a graph of `--matmuls` bf16 [n, n] matmuls (about `--ms` of GPU work, sized on the
machine), then times on the host: one replay on an idle GPU; a second replay of the same graph
right after the first (the first still running); a replay of a second capture of the same work
right after the first graph's replay; and a plain kernel launch behind a running replay. Each
case runs `--reps` times, the GPU drained between them; prints the median host µs per call. A
launch that returns in a few µs queued its work; one that takes about the GPU time waited.

    PYTHONPATH=. python3 benchmarks/bench_graph_relaunch.py [--ms 10] [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def _graph(work) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        work()  # warm-up outside the capture (cuBLAS workspace, handles)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        work()
    torch.cuda.synchronize()
    return g


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", type=float, default=10.0, help="GPU time of one replay (about)")
    ap.add_argument("--n", type=int, default=4096, help="matmul size")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 1
    a = torch.randn(args.n, args.n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.n, args.n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    one_ms = (time.perf_counter() - t) * 100  # ms per matmul
    count = max(1, round(args.ms / one_ms))

    def work() -> None:
        for _ in range(count):
            torch.matmul(a, b, out=out)

    g1, g2 = _graph(work), _graph(work)
    x = torch.zeros(1, device="cuda")

    def host_us(calls) -> list[float]:
        """Median host µs of each call in `calls`, run back to back, over the repetitions."""
        times: list[list[float]] = [[] for _ in calls]
        for _ in range(args.reps):
            torch.cuda.synchronize()
            for i, call in enumerate(calls):
                t0 = time.perf_counter()
                call()
                times[i].append(1e6 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
        return [statistics.median(ts) for ts in times]

    t0 = time.perf_counter()
    g1.replay()
    torch.cuda.synchronize()
    gpu_ms = 1e3 * (time.perf_counter() - t0)
    rows = [
        ("replay on an idle GPU", host_us([g1.replay])[0]),
        ("replay of the same graph behind its running replay", host_us([g1.replay, g1.replay])[1]),
        ("replay of a second capture behind the first's", host_us([g1.replay, g2.replay])[1]),
        ("a kernel launch behind a running replay", host_us([g1.replay, lambda: x.add_(1)])[1]),
        ("third replay of the same graph (two queued)",
         host_us([g1.replay, g1.replay, g1.replay])[2]),
    ]
    print(f"graph: {count} matmuls [{args.n}]^2 bf16, {gpu_ms:.2f} ms of GPU per replay "
          f"({torch.cuda.get_device_name()})")
    print("| case | host µs per call (median) |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:,.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
