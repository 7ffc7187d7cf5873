"""What the Gluon warp-specialized MLA decode kernel compiles to on Hopper, read on any machine.

Compiles `mla_kernels.decode_attention_ws._mla_decode_ws_kernel` for an sm_90 target ahead of
time (`triton.compile` of a `GluonASTSource` with the integer / pointer divisibility hints the
JIT would give), runs the ptxas bundled with triton (`-v`) and prints one table row per launch
setting: registers per thread (ptxas; with warp specialization the per-partition budgets are the
`setmaxnreg` values in the PTX), spill bytes, shared memory per program, the shared-memory
allocations, and instruction counts in the PTX: wgmma.mma_async, cp.async (16-byte), mbarrier
operations, cp.async.mbarrier.arrive, bar.sync / bar.arrive (named barriers), setmaxnreg.

    python benchmarks/compile_ws_report.py [NUM_BUFS,LOAD_WARPS,LOAD_REGS[,MAXNREG] ...]
    python benchmarks/compile_ws_report.py --dump DIR 2,1,80   (also writes ttgir / ptx there)
    python benchmarks/compile_ws_report.py --pool e4m3 1,4,112 (an FP8 pool: the converting
                                                                producer; e5m2 likewise)
    python benchmarks/compile_ws_report.py --reg-a --pool e4m3 2,4,64 (an FP8 pool on the
                                                register-operand path: FP8 tiles, cp.async)

e.g. `2,1,80` (two buffers, one producer warp with 80 registers; MAXNREG omitted = what
`mla_decode_ws_fwd` launches with, `decode_attention_ws.default_maxnreg`: none (255, one program
per SM) for two buffers, 128 for one buffer so that two programs fit on an SM) or `1,4,64,128`.

Needs triton with Gluon and its NVIDIA backend (the pip wheel has both); no CUDA device or driver
is used.
"""

from __future__ import annotations

import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, even under the test settings

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

import mla_kernels.decode_attention_ws as ws  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_report import jit_signature, ptxas_stats  # noqa: E402  (benchmarks/compile_report.py)

POINTERS = {"Q": "*bf16", "K": "*bf16", "O": "*bf16", "ReqToToken": "*i32", "ReqPoolIdx": "*i64",
            "SeqLens": "*i32", "NumKvSplits": "*i32", "MidO": "*fp32", "MidLse": "*fp32"}


POOLS = {"bf16": "*bf16", "e4m3": "*fp8e4nv", "e5m2": "*fp8e5"}


def compile_setting(num_bufs: int, load_warps: int, load_regs: int, maxnreg: int | None = None,
                    max_kv_splits: int = 64, pool: str = "bf16", reg_a: bool = False,
                    async_mma: bool | None = None):
    """The compiled kernel (triton CompiledKernel) for MLA 16 heads, 576/512, bf16 q, a `pool`
    (bf16, e4m3 or e5m2) cache."""
    fn = ws._mla_decode_ws_kernel
    constexprs = dict(MAX_KV_SPLITS=max_kv_splits, BLOCK_N=ws.BLOCK_N, NUM_BUFS=num_bufs,
                      LOAD_WARPS=load_warps, LOAD_REGS=load_regs, HB=ws.HEADS_PER_PROG,
                      D_MAIN=ws.D_MAIN, D_ROPE=ws.D_ROPE, REG_A=reg_a,
                      ASYNC_MMA=reg_a and (ws.REG_A_ASYNC if async_mma is None else async_mma))
    signature, consts, attrs = jit_signature(fn, dict(POINTERS, K=POOLS[pool]), constexprs,
                                             ("qk_scale", "v_scale"),
                                             ("stride_ls", "num_heads"))
    src = GluonASTSource(fn, signature, consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=maxnreg))


COUNTS = {
    "wgmma": r"wgmma\.mma_async",
    "cp.async": r"cp\.async\.c[ag]\.shared\.global",
    "cp.async.mbarrier.arrive": r"cp\.async\.mbarrier\.arrive",
    "mbarrier": r"mbarrier\.",
    "bar.sync": r"\bbar\.sync|barrier\.sync",
    "setmaxnreg": r"setmaxnreg",
}


def main(argv: list[str]) -> None:
    dump, pool, reg_a = None, "bf16", False
    while argv[:1] in (["--dump"], ["--pool"], ["--reg-a"]):
        if argv[0] == "--reg-a":
            reg_a = True
            argv = argv[1:]
            continue
        if argv[0] == "--dump":
            dump = argv[1]
            os.makedirs(dump, exist_ok=True)
        else:
            pool = argv[1]
        argv = argv[2:]
    fp8_tiles = reg_a and pool != "bf16"
    regs_default = (ws.LOAD_REGS if pool == "bf16" else ws.LOAD_REGS_REG_A if fp8_tiles
                    else ws.LOAD_REGS_FP8)
    settings = argv or [f"{ws.NUM_BUFS},{ws.LOAD_WARPS},{regs_default}"]
    print("| bufs | load warps | load regs | maxnreg | registers | spill bytes | shared KB | "
          + " | ".join(COUNTS) + " | setmaxnreg values |")
    print("|---" * (8 + len(COUNTS)) + "|")
    for spec in settings:
        vals = [int(x) for x in spec.split(",")]
        num_bufs, load_warps, load_regs = vals[:3]
        maxnreg = vals[3] if len(vals) > 3 else ws.default_maxnreg(num_bufs, fp8_tiles)
        k = compile_setting(num_bufs, load_warps, load_regs, maxnreg, pool=pool, reg_a=reg_a)
        ptx = k.asm["ptx"]
        if dump:
            for ext in ("ttgir", "llir", "ptx"):
                with open(os.path.join(dump, f"ws_{pool}_{spec.replace(',', '_')}.{ext}"),
                          "w") as f:
                    f.write(k.asm[ext])
        regs, spills = ptxas_stats(ptx)
        counts = [str(len(re.findall(p, ptx))) for p in COUNTS.values()]
        nregs = sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)))
        print(f"| {num_bufs} | {load_warps} | {load_regs} | {maxnreg or '-'} | {regs} | {spills} | "
              f"{k.metadata.shared / 1024:.1f} | " + " | ".join(counts)
              + f" | {' '.join(nregs) or '-'} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
