"""Batch-size-1 linear layers on a CUDA GPU: `mla_kernels.gemv` vs cuBLAS (`F.linear`).

For the weight shapes a decode step of DeepSeek-V2-Lite and Llama-3.1-8B reads (bf16), and
token rows 1 and 2: time per call of cuBLAS and of `gemv` with its default settings
(`gemv_config`) and, with `--sweep`, every setting of a small grid (BLOCK_N x BLOCK_K x stages x
warps), the best of which is printed. Each timing replays a CUDA graph of `--calls` launches
that cycle through enough copies of the weight (>= 256 MB) that none is read from L2, as in a
real step (whose 27 layers' weights never fit in L2); median of `--repeats` replays. Achieved
bandwidth = weight bytes / time, against the device-to-device copy bandwidth measured in the
same run. Also checks each kernel against fp32 `F.linear` (max abs error).

    PYTHONPATH=. python3 benchmarks/bench_gemv.py [--sweep] [--rows 1 2] [--static-weight]

`--static-weight` launches gemv as the model's linears do (`static_weight=True`: programmatic
dependent launch on Hopper, the first part of the weight read before the wait; mla_kernels/pdl.py).
The calls of one graph are independent (the same x), so with PDL neighbouring calls overlap
more than a model's dependent chain of kernels would: read those times as a lower bound.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
import torch.nn.functional as F

from mla_kernels.gemv import gemv, gemv_config

# (name, N, K): output features, input features
SHAPES = [
    ("V2-Lite q_proj", 3072, 2048), ("V2-Lite kv_a_proj", 576, 2048),
    ("V2-Lite o_proj", 2048, 2048), ("V2-Lite shared gate_up", 5632, 2048),
    ("V2-Lite shared down", 2048, 2816), ("V2-Lite dense gate_up", 21888, 2048),
    ("V2-Lite dense down", 2048, 10944), ("V2-Lite lm_head", 102400, 2048),
    ("Llama-8B qkv", 6144, 4096), ("Llama-8B o_proj", 4096, 4096),
    ("Llama-8B gate_up", 28672, 4096), ("Llama-8B down", 4096, 14336),
]


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth, bytes/s (2 x 2 GB moved per copy)."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    return 2 * (2 << 30) / min(times)


def graph_us(fn_for, n_calls: int, repeats: int) -> float:
    """Median µs per call of `fn_for(i)` for i in 0..n_calls-1, replayed from one CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(min(n_calls, 3)):  # compile / warm up outside the capture
            fn_for(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(n_calls):
            fn_for(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n_calls)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--static-weight", action="store_true",
                    help="gemv(..., static_weight=True): PDL launch and weight prefetch")
    args = ap.parse_args()
    bw = copy_bandwidth()
    sw = args.static_weight
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e9:,.0f} GB/s")
    grid = [dict(BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=st, num_warps=nw)
            for bn, bk, st, nw in itertools.product((4, 8, 16, 32), (128, 256, 512), (2, 4),
                                                    (2, 4, 8))]
    print("\n| weight | N | K | rows | cuBLAS µs | GB/s | gemv µs (default) | GB/s | % of copy "
          "| max abs err | best setting | best µs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, n, k in SHAPES:
        nbytes = n * k * 2
        copies = max(2, -(-(256 << 20) // nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
              for _ in range(copies)]
        for t in args.rows:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            outs = [torch.empty(t, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            want = F.linear(x.float(), ws[0].float())
            err = (gemv(x, ws[0]).float() - want).abs().max().item()
            cublas = graph_us(lambda i: F.linear(x, ws[i % copies]), args.calls, args.repeats)
            ours = graph_us(lambda i: gemv(x, ws[i % copies], out=outs[i % 2],
                                          static_weight=sw), args.calls,
                            args.repeats)
            best_cfg, best = gemv_config(n, k), ours
            if args.sweep:
                for cfg in grid:
                    if cfg["BLOCK_K"] > max(128, k):
                        continue
                    us = graph_us(lambda i, c=cfg: gemv(x, ws[i % copies], out=outs[i % 2],
                                                        config=c, static_weight=sw),
                                    args.calls, args.repeats)
                    if us < best:
                        best_cfg, best = cfg, us
            cfg_s = "/".join(str(best_cfg[key]) for key in ("BLOCK_N", "BLOCK_K", "NUM_STAGES",
                                                           "num_warps"))
            share = nbytes / (ours * 1e-6) / bw  # achieved / copy bandwidth
            print(f"| {name} | {n} | {k} | {t} | {cublas:.2f} | {nbytes / cublas / 1e3:,.0f} | "
                  f"{ours:.2f} | {nbytes / ours / 1e3:,.0f} | {100 * share:.0f}% | "
                  f"{err:.2e} | {cfg_s} | {best:.2f} |", flush=True)
        del ws
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
