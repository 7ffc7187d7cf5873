"""What triton makes of the fused-MoE grouped GEMM on Hopper, read on any machine (no GPU).

Compiles `mla_kernels.fused_moe._grouped_gemm_kernel` for an sm_90 target ahead of time, as the
JIT specializes a decode launch of the first GEMM (FP8 experts with per-expert scales, FP8
activations with per-row scales, the fused gate/up with SiLU, bf16 output; unit strides as
constants, the other integers and pointers 16-divisible, row counts unspecialized), with the
weight tiles by pointer loads and through a tensor descriptor (`MoEConfig.b_desc`). Per tile
setting it prints registers and spill bytes (ptxas `-v`, `compile_report.ptxas_stats`), shared
memory, and the PTX's TMA tensor copies (`cp.async.bulk.tensor`), `cp.async` copies and
warpgroup MMAs.

    python benchmarks/compile_moe_report.py BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES ...
        (default: 64,64,128,4,3 128,128,128,8,3, the FP8 decode and prefill tiles)

Needs triton with its NVIDIA backend (the pip wheel has it); no CUDA device or driver is used.
"""

from __future__ import annotations

import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, even under the test settings

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from compile_report import jit_signature, ptxas_stats  # noqa: E402

import mla_kernels.fused_moe as fm  # noqa: E402

POINTERS = {"A": "*fp8e4nv", "B": "*fp8e4nv", "C": "*bf16", "TopkWeights": "*fp32",
            "SortedTokenIds": "*i32", "ExpertIds": "*i32", "NumTokensPostPadded": "*i32",
            "AScale": "*fp32", "BScale": "*fp32"}


def compile_tile(bm: int, bn: int, bk: int, warps: int, stages: int, desc: bool):
    """The CompiledKernel of the first GEMM's FP8 decode launch at this tile."""
    constexprs = dict(FUSE_SILU_MUL=True, MUL_ROUTING_WEIGHT=False, BLOCK_M=bm, BLOCK_N=bn,
                      BLOCK_K=bk, GROUP_M=8, DOT_PRECISION="tf32", QUANT=1, FP8_DOT=True,
                      B_DESC=desc, stride_ak=1, stride_bk=1, stride_cn=1, stride_ask=0,
                      stride_bsn=0, stride_bsk=0)
    pointers = dict(POINTERS, BDesc=f"tensordesc<fp8e4nv[1, {bn}, {bk}]>" if desc
                    else "*fp8e4nv")
    signature, consts, attrs = jit_signature(fm._grouped_gemm_kernel, pointers, constexprs, (),
                                             ("num_rows", "num_blocks_m", "BDesc"))
    return triton.compile(ASTSource(fm._grouped_gemm_kernel, signature, consts, attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def main(argv: list[str]) -> None:
    print("| tile (BM, BN, BK, warps, stages) | weight tiles | registers | spill bytes "
          "| shared KB | TMA copies | cp.async | wgmma |")
    print("|---" * 8 + "|")
    for spec in argv or ["64,64,128,4,3", "128,128,128,8,3"]:
        tile = tuple(int(v) for v in spec.split(","))
        for desc in (False, True):
            k = compile_tile(*tile, desc)
            ptx = k.asm["ptx"]
            regs, spills = ptxas_stats(ptx)
            print(f"| {spec} | {'descriptor' if desc else 'pointers'} | {regs} | {spills} | "
                  f"{k.metadata.shared / 1024:.1f} | {len(re.findall('cp.async.bulk.tensor', ptx))}"
                  f" | {len(re.findall(r'cp.async.c[ag]', ptx))} | "
                  f"{len(re.findall('wgmma.mma_async', ptx))} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
