"""The small kernels around the FP8 GEMMs on a CUDA GPU: per-token quantization, SiLU-and-mul
with its FP8 output, fused add + RMSNorm with its FP8 output, and the MoE top-k combine, at
DeepSeek-V2-Lite's decode and prefill sizes. A probe for the launch configs and for what a
variant of each would cost; the engine's kernels are those of `mla_kernels/` (timed as "engine").

Each timing is a CUDA graph of 20 back-to-back launches, replayed (median of
`triton.testing.do_bench`), divided by 20: µs per launch without the host. Every probe variant is
checked against the engine kernel first (FP8 values and scales: equal, or with `rcp` at most one
e4m3 step apart in a few elements, counted in the table).

Probe variants (`_quant_probe_kernel`, `_silu_probe_kernel`): ROWS rows per program (a
[ROWS, BLOCK] tile, each row's amax over axis 1), num_warps, and the division: `rn` (the
engine's `tl.math.div_rn(x, scale)`, IEEE, what torch's x / scale computes) or `rcp` (x times
the row's 1 / scale); for SiLU also whether the 16-bit output row is stored at all (a dynamic
FP8 down projection reads only the FP8 copy).

Shapes: per-token quantization of the MoE intermediate [T*6, 1408] and of o_proj's input
[T, 2048]; SiLU-and-mul of the shared experts' [T, 2*2816]; add + RMSNorm [T, 2048]; the combine
[T, 6, 2048] (+ the shared output [T, 2048]) against torch.sum then an addition.

    PYTHONPATH=. python3 benchmarks/bench_fp8_epilogue.py [--tokens 512 1024 6144] [--no-probes]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fused_moe import bench, graph_of  # noqa: E402
from bench_suite import table  # noqa: E402
from mla_kernels.activation import silu_and_mul  # noqa: E402
from mla_kernels.fp8_quant import _to_e4m3, quantize_fp8_per_token  # noqa: E402
from mla_kernels.moe_sum import moe_sum  # noqa: E402
from mla_kernels.rmsnorm import _add_rmsnorm_kernel, fused_add_rmsnorm  # noqa: E402

REPS = 20  # launches per graph


@triton.jit
def _scale_and_q(x, RCP: tl.constexpr, EXACT: tl.constexpr):
    """x [ROWS, BLOCK] float32 -> (e4m3 [ROWS, BLOCK], scale [ROWS])."""
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), 448.0), 1e-12)
    if RCP:
        q = _to_e4m3(x * (1.0 / scale)[:, None], EXACT)
    else:
        q = _to_e4m3(tl.math.div_rn(x, scale[:, None]), EXACT)
    return q, scale


@triton.jit(do_not_specialize=["M"])
def _quant_probe_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, ROWS: tl.constexpr,
                        BLOCK: tl.constexpr, RCP: tl.constexpr, EXACT: tl.constexpr = False):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    rmask = rows < M
    mask = rmask[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    q, scale = _scale_and_q(x.to(tl.float32), RCP, EXACT)
    tl.store(q_ptr + r64[:, None] * stride_q + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows, scale, mask=rmask)


@triton.jit(do_not_specialize=["M"])
def _silu_probe_kernel(x_ptr, out_ptr, q_ptr, s_ptr, M, N, stride_x, stride_out, stride_q,
                       ROWS: tl.constexpr, BLOCK: tl.constexpr, RCP: tl.constexpr,
                       STORE_OUT: tl.constexpr, EXACT: tl.constexpr = False):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    rmask = rows < M
    mask = rmask[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)
    base = x_ptr + r64[:, None] * stride_x + cols[None, :]
    gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + N, mask=mask, other=0.0).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty)
    if STORE_OUT:
        tl.store(out_ptr + r64[:, None] * stride_out + cols[None, :], y, mask=mask)
    q, scale = _scale_and_q(y.to(tl.float32), RCP, EXACT)
    tl.store(q_ptr + r64[:, None] * stride_q + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows, scale, mask=rmask)


def per_launch_us(fn, rep: int) -> float:
    g = graph_of(lambda: [fn() for _ in range(REPS)])
    return 1000 * bench(g.replay, warmup=25, rep=rep) / REPS


def fp8_diff(q: torch.Tensor, s: torch.Tensor, q0: torch.Tensor, s0: torch.Tensor) -> str:
    """'=' when equal, else how many FP8 values differ and the largest difference in e4m3
    steps ('!' when a scale differs)."""
    if not torch.equal(s, s0):
        return "! scales differ"
    a, b = q.view(torch.uint8).int(), q0.view(torch.uint8).int()
    n = int((a != b).sum())
    return "=" if n == 0 else f"{n} differ (max {int((a - b).abs().max())} step)"


def quant_rows(t: int, k: int, rep: int, probes: bool = True) -> list[list]:
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16) * 3
    q0, s0 = quantize_fp8_per_token(x)
    out = [[f"quant [{t}, {k}]", "engine", "", per_launch_us(lambda: quantize_fp8_per_token(x),
                                                             rep), "="]]
    block = triton.next_power_of_2(k)
    q = torch.empty_like(q0)
    s = torch.empty_like(s0)
    for rows, warps, rcp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (False, True)):
        if not probes or rows * block // (32 * warps) > 128 or rows * block < 32 * warps:
            continue

        def go(rows=rows, warps=warps, rcp=rcp):
            _quant_probe_kernel[(triton.cdiv(t, rows),)](x, q, s, t, k, x.stride(0), q.stride(0),
                                                         ROWS=rows, BLOCK=block, RCP=rcp,
                                                         num_warps=warps)
        go()
        out.append([f"quant [{t}, {k}]", f"probe R{rows} w{warps} {'rcp' if rcp else 'rn'}", "",
                    per_launch_us(go, rep), fp8_diff(q, s, q0, s0)])
    return out


def silu_rows(t: int, n: int, rep: int, probes: bool = True) -> list[list]:
    x = torch.randn(t, 2 * n, device="cuda", dtype=torch.bfloat16) * 2
    o0 = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
    q0 = torch.empty(t, n, device="cuda", dtype=torch.float8_e4m3fn)
    s0 = torch.empty(t, 1, device="cuda", dtype=torch.float32)
    silu_and_mul(x, out=o0, fp8_out=(q0, s0))
    out = [[f"silu [{t}, 2x{n}]", "engine, no FP8 output", "",
            per_launch_us(lambda: silu_and_mul(x, out=o0), rep), ""],
           [f"silu [{t}, 2x{n}]", "engine, FP8 output", "",
            per_launch_us(lambda: silu_and_mul(x, out=o0, fp8_out=(q0, s0)), rep), "="]]
    block = triton.next_power_of_2(n)
    o = torch.empty_like(o0)
    q = torch.empty_like(q0)
    s = torch.empty_like(s0)
    for rows, warps, rcp, store in itertools.product((1, 2), (4, 8, 16), (False, True),
                                                     (True, False)):
        if not probes or rows * block // (32 * warps) > 128:
            continue

        def go(rows=rows, warps=warps, rcp=rcp, store=store):
            _silu_probe_kernel[(triton.cdiv(t, rows),)](
                x, o, q, s, t, n, x.stride(0), o.stride(0), q.stride(0), ROWS=rows, BLOCK=block,
                RCP=rcp, STORE_OUT=store, num_warps=warps)
        go()
        out.append([f"silu [{t}, 2x{n}]",
                    f"probe R{rows} w{warps} {'rcp' if rcp else 'rn'}{'' if store else ' no-out'}",
                    "", per_launch_us(go, rep), fp8_diff(q, s, q0, s0)])
    return out


def rmsnorm_rows(t: int, d: int, rep: int, probes: bool = True) -> list[list]:
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(d, device="cuda", dtype=torch.bfloat16)
    o = torch.empty_like(x)
    ro = torch.empty_like(x)
    q = torch.empty(t, d, device="cuda", dtype=torch.float8_e4m3fn)
    s = torch.empty(t, 1, device="cuda", dtype=torch.float32)
    out = [[f"add+rmsnorm [{t}, {d}]", "engine, no FP8 output", "",
            per_launch_us(lambda: fused_add_rmsnorm(x, r, w, 1e-6, out=o, residual_out=ro), rep),
            ""],
           [f"add+rmsnorm [{t}, {d}]", "engine, FP8 output", "",
            per_launch_us(lambda: fused_add_rmsnorm(x, r, w, 1e-6, out=o, residual_out=ro,
                                                    fp8_out=(q, s)), rep), "="]]
    block = triton.next_power_of_2(d)
    for warps in (2, 4, 8, 16) if probes else ():
        def go(warps=warps):
            _add_rmsnorm_kernel[(t,)](x, r, w, o, ro, q, s, x.stride(0), r.stride(0),
                                      o.stride(0), ro.stride(0), q.stride(0), d, 1e-6,
                                      BLOCK_D=block, QUANT=True, EXACT=False, USE_PDL=False,
                                      num_warps=warps)
        out.append([f"add+rmsnorm [{t}, {d}]", f"engine kernel, FP8 output, w{warps}", "",
                    per_launch_us(go, rep), ""])
    return out


def moe_sum_rows(t: int, k: int, h: int, rep: int) -> list[list]:
    y = torch.randn(t, k, h, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    o = torch.empty(t, h, device="cuda", dtype=torch.bfloat16)
    moe_sum(y, o, a)
    err = float((o.float() - (y.float().sum(1) + a.float())).abs().max())
    mb = (t * k * h + 2 * t * h) * 2 / 1e6

    def old():
        torch.sum(y, dim=1, out=o)
        return o + a
    return [[f"combine [{t}, {k}, {h}] + shared", "torch.sum, then +", f"{mb:.1f}",
             per_launch_us(old, rep), ""],
            [f"combine [{t}, {k}, {h}] + shared", "moe_sum(add=)", f"{mb:.1f}",
             per_launch_us(lambda: moe_sum(y, o, a), rep), f"max err {err:.3g}"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 6144])
    ap.add_argument("--rep", type=int, default=100, help="do_bench milliseconds per timing")
    ap.add_argument("--only", nargs="+", default=["quant", "silu", "rmsnorm", "combine"],
                    choices=["quant", "silu", "rmsnorm", "combine"])
    ap.add_argument("--no-probes", action="store_true", help="time the engine's kernels only")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8_epilogue.py needs a CUDA GPU", file=sys.stderr)
        return 2
    for t in args.tokens:
        rows: list[list] = []
        if "quant" in args.only:
            rows += (quant_rows(6 * t, 1408, args.rep, not args.no_probes)
                     + quant_rows(t, 2048, args.rep, not args.no_probes))
        if "silu" in args.only:
            rows += silu_rows(t, 2816, args.rep, not args.no_probes)
        if "rmsnorm" in args.only:
            rows += rmsnorm_rows(t, 2048, args.rep, not args.no_probes)
        if "combine" in args.only:
            rows += moe_sum_rows(t, 6, 2048, args.rep)
        table(f"T = {t} tokens ({torch.cuda.get_device_name()}): µs per launch, graph replay",
              ["op", "kernel", "MB", "µs", "vs engine's FP8 values"],
              [[a, b, c, f"{d:.2f}", e] for a, b, c, d, e in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
