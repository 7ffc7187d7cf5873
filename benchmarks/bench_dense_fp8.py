"""Dense FP8 linears at decode sizes on a CUDA GPU: `torch._scaled_mm` (rowwise scales, what
`layers.quantization._fp8_rowwise_scaled_mm` runs above one row) against a plain triton FP8 GEMM
with the same scales, over a tile sweep. A probe: the engine does not use this kernel.

Shapes are DeepSeek-V2-Lite's dynamic FP8 linears, (N, K): the fused q_proj + kv_a_proj_with_mqa
input projection (3648, 2048), o_proj (2048, 2048), the shared experts' gate/up (5632, 2048) and
down (2048, 2816); M (token rows) 128, 256, 512. A float8_e4m3fn [M, K] with per-row scales
[M, 1], B float8_e4m3fn [N, K] (row-major, = the column-major [K, N] that _scaled_mm takes) with
per-column scales, bf16 out. The triton kernel: one [BLOCK_M, BLOCK_N] tile per program (all row
blocks of a column block in a row; the sweep's runs grouped row blocks 8 at a time, the same
order at these M), fp8 x fp8 `tl.dot` with fp32 accumulation, scales applied once
after the K loop; K must be a multiple of BLOCK_K. Every config is compiled first in 12
processes, checked against _scaled_mm (max error over max |ref| < 1e-2) and timed as a
CUDA-graph replay (median of `triton.testing.do_bench`, µs). Prints, per (M, shape), the
_scaled_mm time and the four fastest triton configs as (BLOCK_M, BLOCK_N, BLOCK_K, warps,
stages), then per M the sum over the four linears.

    PYTHONPATH=. python3 benchmarks/bench_dense_fp8.py [--sections tiles]

`--sections accum` instead times what the engine runs for these linears at token rows `--ms`:
bf16 `F.linear` on the unquantized operands and the rowwise-scaled `torch._scaled_mm` with
`use_fast_accum` False and True (`layers.quantization.FP8_FAST_ACCUM`), each as a CUDA-graph
replay (median, µs), with each FP8 result's error against the float64 product of the same
quantized operands and scales (relative Frobenius norm; largest error over largest |ref|): what
the accumulation mode alone costs in accuracy. Activations are N(0, 1) with every 64th column
x10 (outlier channels), quantized per token; weights N(0, 0.02), per tensor.

    PYTHONPATH=. python3 benchmarks/bench_dense_fp8.py --sections accum --ms 256 945 6144
"""
from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

SHAPES = [(3648, 2048), (2048, 2048), (5632, 2048), (2048, 2816)]
MS = [128, 256, 512]


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_probe_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K, stride_am,
                           stride_bn, stride_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
    # consecutive programs: the row blocks of one column block (its weight tile read once
    # from HBM, then from L2)
    pid = tl.program_id(0)
    nm = tl.cdiv(M, BLOCK_M)
    pid_m = pid % nm
    pid_n = pid // nm
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0)
        b = tl.load(b_ptrs, mask=offs_n[None, :] < N, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    a_s = tl.load(as_ptr + offs_m, mask=offs_m < M, other=0.0)
    b_s = tl.load(bs_ptr + offs_n, mask=offs_n < N, other=0.0)
    acc = acc * a_s[:, None] * b_s[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(tl.bfloat16), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def configs():
    return list(itertools.product([64, 128], [64, 128, 256], [128, 256], [4, 8], [3, 4]))


def prob(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(0)
    a = (torch.randn(m, k, generator=g, device="cuda") * 50).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, generator=g, device="cuda") * 50).to(torch.float8_e4m3fn)
    as_ = torch.rand(m, 1, generator=g, device="cuda") / 100
    bs = torch.rand(1, n, generator=g, device="cuda") / 100
    return a, b, as_, bs


def launch(a, b, as_, bs, c, cfg):
    bm, bn, bk, w, s = cfg
    m, k = a.shape
    n = b.shape[0]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _fp8_gemm_probe_kernel[grid](a, b, c, as_, bs, m, n, k, a.stride(0), b.stride(0),
                                 c.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w,
                                 num_stages=s)


def compile_worker(cfgs):
    ok = 0
    for cfg in cfgs:
        for n, k in SHAPES[:2] + SHAPES[3:]:  # K 2048 and 2816 (strides differ)
            a, b, as_, bs = prob(256, n, k)
            c = torch.empty(256, n, dtype=torch.bfloat16, device="cuda")
            try:
                launch(a, b, as_, bs, c, cfg)
                ok += 1
            except Exception:
                pass
    torch.cuda.synchronize()
    return ok


def accum_problem(m, n, k, seed):
    """(x bf16 [m, k], w bf16 [n, k], q fp8 [m, k], x_scale [m, 1], wq fp8 [n, k], w_scale_row
    [1, n]): x quantized per token and w per tensor by the engine's own quantizers."""
    from mla_backend.layers.quantization import quantize_fp8_per_tensor
    from mla_kernels.fp8_quant import quantize_per_token

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda")
    x[:, ::64] *= 10.0
    w = torch.randn(n, k, generator=g, device="cuda") * 0.02
    q, xs = quantize_per_token(x)
    wq, ws = quantize_fp8_per_tensor(w)
    return x.bfloat16(), w.bfloat16(), q, xs, wq, ws.reshape(1, 1).expand(1, n).contiguous()


def section_accum(ms):
    """bf16 F.linear vs _scaled_mm with and without fast accumulation (module docstring)."""
    from bench_fused_moe import bench, graph_of

    rows = []
    totals = {}
    for m in ms:
        for n, k in SHAPES:
            x, w, q, xs, wq, wsr = accum_problem(m, n, k, m + n + k)
            ref = (q.double() * xs.double()) @ (wq.double() * wsr.double().t()).t()
            wt = wq.t()
            g16 = graph_of(lambda: torch.nn.functional.linear(x, w))
            t16 = 1000 * bench(g16.replay, 5, 25)
            out = [f"M {m} N {n} K {k}", f"{t16:.1f}"]
            totals.setdefault(m, [0.0, 0.0, 0.0])[0] += t16
            for i, fast in enumerate((False, True)):
                def gemm(fast=fast):
                    return torch._scaled_mm(q, wt, scale_a=xs, scale_b=wsr,
                                            out_dtype=torch.bfloat16, use_fast_accum=fast)

                err = gemm().double() - ref
                fro = (err.norm() / ref.norm()).item()
                mx = (err.abs().max() / ref.abs().max()).item()
                t = 1000 * bench(graph_of(gemm).replay, 5, 25)
                totals[m][1 + i] += t
                out += [f"{t:.1f}", f"{fro:.2e}", f"{mx:.2e}"]
            rows.append(out)
            print(" | ".join(out), flush=True)
    print("| shape | bf16 F.linear us | _scaled_mm us | rel. error | max error | "
          "fast accum us | rel. error | max error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    for m, (a, b, c) in totals.items():
        print(f"M {m}: four linears bf16 {a:.1f} us, _scaled_mm {b:.1f} us, fast accum {c:.1f} us")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", nargs="+", choices=("tiles", "accum"), default=["tiles"])
    ap.add_argument("--ms", type=int, nargs="+", default=[256, 945, 6144],
                    help="token rows of the accum section")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_dense_fp8: needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if "accum" in args.sections:
        section_accum(args.ms)
    if "tiles" not in args.sections:
        return 0
    cfgs = configs()
    t0 = time.time()
    with mp.get_context("spawn").Pool(12) as pool:
        ok = sum(pool.map(compile_worker, [cfgs[i::12] for i in range(12)]))
    print(f"# compiled {ok} in {time.time() - t0:.0f} s", flush=True)
    from bench_fused_moe import bench, graph_of
    tot_sm, tot_best = {}, {}
    for m in MS:
        for n, k in SHAPES:
            a, b, as_, bs = prob(m, n, k)
            bt = b.t()
            ref = torch._scaled_mm(a, bt, scale_a=as_, scale_b=bs, out_dtype=torch.bfloat16)
            g = graph_of(lambda: torch._scaled_mm(a, bt, scale_a=as_, scale_b=bs,
                                                  out_dtype=torch.bfloat16))
            t_sm = 1000 * bench(g.replay, 5, 25)
            rows = []
            c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            for cfg in cfgs:
                try:
                    launch(a, b, as_, bs.reshape(-1), c, cfg)
                    err = ((c.float() - ref.float()).abs().max()
                           / ref.float().abs().max()).item()
                    if err > 1e-2:
                        print("bad", cfg, err)
                        continue
                    gr = graph_of(lambda: launch(a, b, as_, bs.reshape(-1), c, cfg))
                    rows.append((1000 * bench(gr.replay, 5, 25), cfg))
                except Exception:
                    continue
            rows.sort()
            print(f"M {m} N {n} K {k}: _scaled_mm {t_sm:.1f} us; triton best "
                  + "; ".join(f"{t:.1f} {c_}" for t, c_ in rows[:4]), flush=True)
            tot_sm[m] = tot_sm.get(m, 0) + t_sm
            tot_best[m] = tot_best.get(m, 0) + rows[0][0]
    for m in MS:
        print(f"M {m}: four linears _scaled_mm {tot_sm[m]:.1f} us, triton best each "
              f"{tot_best[m]:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
