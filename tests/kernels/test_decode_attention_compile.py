"""The decode-attention launch defaults compile to what the H200 tuning relied on (CPU only).

`benchmarks/compile_report.py` compiles the kernel for sm_90 ahead of time (no GPU needed; run in
a subprocess because the test session's kernels are interpreted): the default transposed setting
must get two pipelined 32-token K buffers (triton gives indirect loads floor((stages - 1) / 2)
buffers), P·V on warpgroup MMAs, no register spills, and fit two programs per SM (<= 113 KB of
shared memory each); the untransposed default must compile without spills too, and the
small-batch transposed setting (64-token tiles, `SMALL_BS_*`) without spills, all its MMAs
warpgroup MMAs, within the 227 KB of shared memory one program may use.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mla_kernels.decode_attention as da

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_compile_as_tuned():
    swap = f"1,{da.BLOCK_N_WIDE},{da.STAGE1_NUM_WARPS},{da.STAGE1_NUM_STAGES_SWAP}"
    plain = f"0,{da.BLOCK_N_WIDE},{da.STAGE1_NUM_WARPS},{da.STAGE1_NUM_STAGES_WIDE}"
    small = f"1,{da.SMALL_BS_BLOCK_N_WIDE},{da.STAGE1_NUM_WARPS},{da.SMALL_BS_NUM_STAGES}"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/compile_report.py"), swap, plain,
                          small],
                         capture_output=True, text=True, env=env, timeout=300, check=True).stdout
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| 0") or line.startswith("| 1")]
    assert len(rows) == 3, out
    # columns: swap, tokens/tile, warps, stages, registers, spill bytes, shared KB, buffers,
    # wgmma, mma.sync
    t, u, v = rows
    assert t[0] == "1" and f"2x{da.BLOCK_N_WIDE}x512xbf16" in t[7].split(), t
    assert int(t[8]) > 0 and int(t[5]) == 0 and float(t[6]) <= 113, t
    assert u[0] == "0" and int(u[5]) == 0 and int(u[9]) > 0, u
    assert v[1] == str(da.SMALL_BS_BLOCK_N_WIDE) and int(v[5]) == 0, v
    assert int(v[8]) > 0 and int(v[9]) == 0 and float(v[6]) <= 227, v
