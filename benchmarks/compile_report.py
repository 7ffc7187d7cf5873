"""What triton makes of the decode-attention kernel on Hopper, read on any machine (no GPU).

Compiles `mla_kernels.decode_attention._decode_split_kernel` for an sm_90 target ahead of time
(`triton.compile` with the integer / pointer divisibility hints the JIT would give) for MLA's
576/512 bf16 layout and each requested launch setting, runs the ptxas bundled with triton
(`-v`), and prints one table row per setting: registers per thread, shared memory per program,
the shared-memory buffers the software pipeliner allocated (for example `2x32x512xbf16`: two
32-token K buffers), and the count of warpgroup (wgmma) vs warp-level (mma.sync) MMA
instructions in the PTX. It showed, for example, that 3 stages gave the K tile a single buffer.

    python benchmarks/compile_report.py SWAP,BLOCK_N,WARPS,STAGES[,POOL] ...
        (e.g. 1,32,4,5 0,32,4,3 0,32,4,3,e4m3)

SWAP: 1 = the transposed path (always reusing the K tile as V), 0 = the untransposed path with
V gathered separately. POOL: bf16 (default) or e4m3 (an FP8 pool: its tiles are converted to
fp16 before each product, q rounded to fp16 (`decode_attention.mma_operand`); the last column
counts those conversions of e4m3 pairs in the PTX).
Needs triton with its NVIDIA backend (the pip wheel has it); no CUDA device or driver is used.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, even under the test settings

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import mla_kernels.decode_attention as da  # noqa: E402

POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "ReqToToken": "*i32", "ReqPoolIdx": "*i64",
            "SeqLens": "*i32", "NumKvSplits": "*i32", "MidO": "*fp32", "MidLse": "*fp32"}


def jit_signature(fn, pointers: dict, constexprs: dict, floats: tuple, unaligned: tuple):
    """(signature, constants, attrs) for `triton.compile` of a jitted kernel `fn`, as the JIT
    would specialize a launch: the named pointers with their types, the constexprs, fp32
    scalars `floats`, every other argument i32; pointers and integers get the 16-divisibility
    hint except those in `unaligned`."""
    signature, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            consts[(i,)] = constexprs[name]
            continue
        if name in floats:
            signature[name] = "fp32"
            continue
        signature[name] = pointers.get(name, "i32")
        if name not in unaligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, consts, attrs


def compile_setting(swap: bool, block_n: int, warps: int, stages: int, pool: str = "bf16"):
    """The compiled kernel (triton CompiledKernel) for MLA 16 heads, Lk 576 / Lv 512, bf16
    queries over a `pool` ("bf16" or "e4m3") pool, launched with PDL as the engine does on
    Hopper."""
    fn = da._decode_split_kernel
    constexprs = dict(Lk=576, Lv=512, GROUP=16, HEADS_PER_PROG=16, BLOCKS_PER_KV=1,
                      MAX_KV_SPLITS=64, BLOCK_D=512, BLOCK_DPE=64, BLOCK_DV=512, BLOCK_N=block_n,
                      BLOCK_H=16, DOT_PRECISION="tf32", V_IS_K_PREFIX=swap, SWAP_AB=swap,
                      USE_PDL=True)
    pointers = dict(POINTERS, K=f"*{_POOL_TYPES[pool]}", V=f"*{_POOL_TYPES[pool]}")
    signature, consts, attrs = jit_signature(fn, pointers, constexprs, ("sm_scale", "v_scale"),
                                             ("stride_ls",))
    src = ASTSource(fn, signature, consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def ptxas_stats(ptx: str) -> tuple[str, str]:
    """(registers per thread, spill store bytes) from the ptxas bundled with triton ("?" when
    ptxas does not say)."""
    ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__),
                                   "backends/nvidia/bin/ptxas"))[0]
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", out],
                             capture_output=True, text=True, check=True)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spills = re.search(r"(\d+) bytes spill stores", res.stderr)
    return regs.group(1) if regs else "?", spills.group(1) if spills else "?"


def ptxas_report(ptx: str) -> str:
    """'N | S': registers and spill bytes (`ptxas_stats`) as two table cells."""
    return " | ".join(ptxas_stats(ptx))


_POOL_TYPES = {"bf16": "bf16", "e4m3": "fp8e4nv"}


def main(argv: list[str]) -> None:
    settings = argv or ["0,32,4,3", "1,32,4,5", "1,64,4,3"]
    print("| swap | tokens/tile | warps | stages | registers | spill bytes | shared KB "
          "| pipelined buffers | wgmma | mma.sync | pool | fp8 -> 16-bit cvt |")
    print("|---" * 12 + "|")
    for spec in settings:
        fields = spec.split(",")
        swap, block_n, warps, stages = (int(x) for x in fields[:4])
        pool = fields[4] if len(fields) > 4 else "bf16"
        k = compile_setting(bool(swap), block_n, warps, stages, pool)
        bufs = sorted(set(re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<([0-9x]+[a-z0-9]+)",
                                     k.asm["ttgir"])))
        ptx = k.asm["ptx"]
        cvt = len(re.findall(r"cvt\.rn\.(?:bf16|f16)x2\.e4m3x2", ptx))
        print(f"| {swap} | {block_n} | {warps} | {stages} | {ptxas_report(ptx)} | "
              f"{k.metadata.shared / 1024:.1f} | {' '.join(bufs)} | "
              f"{ptx.count('wgmma.mma_async')} | {ptx.count('mma.sync')} | {pool} | {cvt} |",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
