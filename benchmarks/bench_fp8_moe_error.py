"""How far the bf16 FP8 fused-MoE kernels land from their float32 twin, against the floor that
FP8 rounding sets (issue 6; the source of the bounds of `test_gpu_fp8_fused_experts_bf16`).

For each weight format (per-tensor, 128 x 128 blocks), `--tokens` and `--seeds`: the random
V2-Lite-shaped problem of `tests/kernels/test_fused_moe_fp8.py` (64 experts, top 6, H 2,048,
I 1,408, bf16 activations), the kernels' output (`fused_experts`, path "auto") and the twin
(`fused_experts_fp8_ref`). Prints, relative to the twin's largest magnitude, the kernels' max
and mean error and the twin's max distance to itself with one more bf16 rounding of its gate_up
product (`round_gate_up`): an intermediate value on an e4m3 rounding boundary moves one step
either way with any change of summation order, so no bound below that floor can hold.

    PYTHONPATH=. python3 benchmarks/bench_fp8_moe_error.py [--tokens 64 300 1024] [--seeds 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO / "tests" / "kernels"))  # the test's problem builder and metrics

from bench_suite import table  # noqa: E402

from mla_kernels.reference import fused_experts_fp8_ref  # noqa: E402
from test_fused_moe_fp8 import _rel_max, _rel_mean, problem, run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 300, 1024])
    ap.add_argument("--seeds", type=int, default=3,
                    help="seeds per size: the size itself (the test's seed), then 1, 2, ...")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fp8_moe_error.py needs a CUDA GPU")
    rows = []
    for block in (None, (128, 128)):
        for t in args.tokens:
            for seed in [t] + list(range(1, args.seeds)):
                x, q13, q2, topw, ids, s13, s2 = problem(
                    t, 64, 6, block, h=2048, inter=1408, seed=seed, dtype=torch.bfloat16,
                    device="cuda")
                out = run(x, q13, q2, topw, ids, s13, s2, block, path="auto")
                ref = fused_experts_fp8_ref(x, q13, q2, topw, ids, s13, s2, block)
                floor = fused_experts_fp8_ref(x, q13, q2, topw, ids, s13, s2, block,
                                              round_gate_up=True)
                rows.append(["per-tensor" if block is None else "128 x 128", t, seed,
                             100 * _rel_max(out, ref), 100 * _rel_mean(out, ref),
                             100 * _rel_max(floor, ref)])
    table("FP8 fused MoE (bf16) against its float32 twin, % of the twin's largest magnitude",
          ["weights", "T", "seed", "kernels max %", "kernels mean %", "floor max %"], rows)


if __name__ == "__main__":
    main()
