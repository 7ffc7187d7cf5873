"""Host time of one GEMM launch on a CUDA GPU, for a row count cuBLAS has seen and one it has not.

A prefill step's token count M is new nearly every step, and every dense linear of the step
runs with that M. cuBLAS picks its kernel per problem shape and caches the pick, so the first
call with a new (M, N, K) pays for the choice on the host. This script measures that cost for
DeepSeek-V2-Lite's dense shapes (K, N: fused q / kv_a input projection 2048 x 3648, o_proj 2048 x
2048, shared experts gate/up 2048 x 5632 and down 2816 x 2048, kv_b 512 x 4096), bf16
`F.linear` and FP8 rowwise-scaled `torch._scaled_mm` (what `quantization.fp8_per_token_mm` runs):

1. Per shape, microseconds per call on the host (the loop does not synchronize; "total" also
   waits for the GPU at the end) for 60 calls with one repeated M, 60 calls each with a new M,
   and the same 60 Ms again.
2. A prefill-like sequence: 27 layers of the five linears (each layer its own weights), a new M
   per step, 8 steps: host microseconds per call of layer 0 (the step's first call of each
   shape) and of layers 1-26.

    PYTHONPATH=. python3 benchmarks/bench_gemm_host.py
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

K_N = [(2048, 3648), (2048, 2048), (2048, 5632), (2816, 2048), (512, 4096)]
FP8 = torch.float8_e4m3fn


def host_us(fn, ms: list[int]) -> tuple[float, float]:
    """(host µs per call, µs per call until the GPU is done) for fn(m) over ms."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for m in ms:
        fn(m)
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return 1e6 * host / len(ms), 1e6 * (time.perf_counter() - t) / len(ms)


def shapes_table(x: torch.Tensor, xq: torch.Tensor, xs: torch.Tensor) -> None:
    print("| GEMM | K | N | one M: host µs | total µs | new M each call: host µs | total µs "
          "| those Ms again: host µs | total µs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, (k, n) in enumerate(K_N):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wt = w.to(FP8).t()
        ws = torch.ones(1, n, device="cuda")
        xk, xqk = x[:, :k].contiguous(), xq[:, :k].contiguous()
        for name, fn in (
            ("bf16 F.linear", lambda m: F.linear(xk[:m], w)),
            ("FP8 _scaled_mm", lambda m: torch._scaled_mm(xqk[:m], wt, scale_a=xs[:m],
                                                           scale_b=ws,
                                                           out_dtype=torch.bfloat16)),
        ):
            base = 3000 + 1000 * i  # Ms no earlier call of this script used
            host_us(fn, [base] * 4)  # warm: this shape's first call
            same = host_us(fn, [base] * 60)
            fresh = list(range(base + 100, base + 160))
            new = host_us(fn, fresh)
            again = host_us(fn, fresh)
            print(f"| {name} | {k} | {n} | {same[0]:.1f} | {same[1]:.1f} | {new[0]:.1f} | "
                  f"{new[1]:.1f} | {again[0]:.1f} | {again[1]:.1f} |", flush=True)


def prefill_like(x: torch.Tensor, xq: torch.Tensor, xs: torch.Tensor) -> None:
    print("\n| GEMMs | step | M | layer 0 host µs per call | layers 1-26 host µs per call |")
    print("|---|---|---|---|---|")
    for dtype in ("bf16", "FP8"):
        ws = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for k, n in K_N]
              for _ in range(27)]
        if dtype == "FP8":
            ws = [[w.to(FP8).t() for w in layer] for layer in ws]
        scales = [torch.ones(1, n, device="cuda") for _, n in K_N]
        for step in range(8):
            m = 9001 + 37 * step + (0 if dtype == "bf16" else 5)
            src = x if dtype == "bf16" else xq
            ins = [src[:m, :k].contiguous() for k, _ in K_N]
            torch.cuda.synchronize()
            first = rest = 0.0
            for layer in range(27):
                for j in range(len(K_N)):
                    t = time.perf_counter()
                    if dtype == "bf16":
                        F.linear(ins[j], ws[layer][j])
                    else:
                        torch._scaled_mm(ins[j], ws[layer][j], scale_a=xs[:m], scale_b=scales[j],
                                         out_dtype=torch.bfloat16)
                    dt = time.perf_counter() - t
                    if layer == 0:
                        first += dt
                    else:
                        rest += dt
                if layer % 4 == 3:
                    torch.cuda.synchronize()  # keep the launch queue short
            torch.cuda.synchronize()
            print(f"| {dtype} | {step} | {m} | {1e6 * first / len(K_N):.1f} | "
                  f"{1e6 * rest / (26 * len(K_N)):.1f} |", flush=True)


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_gemm_host.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    x = torch.randn(9400, 2816, device="cuda", dtype=torch.bfloat16)
    xq = x.to(FP8)
    xs = torch.ones(x.shape[0], 1, device="cuda")
    print(f"### GEMM host cost, {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    shapes_table(x, xq, xs)
    prefill_like(x, xq, xs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
