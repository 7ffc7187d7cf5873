"""The dynamic per-tensor amax pass of `mla_kernels.bmm_fp8` on the absorbed-MLA inputs.

`bmm_fp8` (q_nope · w_kc and o · w_vc of every layer) starts with `fp8_quant.fp8_amax_partials`
over its activation. In the engine both activations are views: q_nope [H, T, 128] of the
[T, H, 192] query (strided), o [H, T, 512] of the contiguous [T, H, 512] attention output (a
permutation, which the pass reads in memory order). For DeepSeek-V2-Lite's 16 heads and each
`--tokens` T: time per call (`triton.testing.do_bench`, median, no CUDA graph) and the bytes read
per second; each result is checked against torch's amax.

    PYTHONPATH=. python3 benchmarks/bench_fp8_amax.py [--tokens 1 64 768]
"""

from __future__ import annotations

import argparse

import torch
import triton

from mla_kernels.fp8_quant import fp8_amax_partials

HEADS, NOPE, ROPE, LORA = 16, 128, 64, 512  # DeepSeek-V2-Lite


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 768])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_amax: needs a CUDA GPU")
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}, "
          f"triton {triton.__version__}\n")
    print("| input | tokens | us per call | GB/s |")
    print("|---|---|---|---|")
    for t in args.tokens:
        q = torch.randn(t, HEADS, NOPE + ROPE, device="cuda", dtype=torch.bfloat16)
        o = torch.randn(t, HEADS, LORA, device="cuda", dtype=torch.bfloat16)
        for name, x in ((f"q_nope [{HEADS}, T, {NOPE}] of [T, {HEADS}, {NOPE + ROPE}]",
                         q[..., :NOPE].transpose(0, 1)),
                        (f"o [{HEADS}, T, {LORA}] of [T, {HEADS}, {LORA}]", o.transpose(0, 1))):
            if fp8_amax_partials(x).max() != x.float().abs().max():
                raise SystemExit(f"bench_fp8_amax: wrong amax for {name}, T {t}")
            us = triton.testing.do_bench(lambda: fp8_amax_partials(x), warmup=25, rep=200,
                                         return_mode="median") * 1e3
            print(f"| {name} | {t} | {us:.1f} | {x.numel() * 2 / us / 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()
