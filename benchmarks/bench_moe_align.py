"""The MoE sort on a CUDA GPU: `mla_kernels.fused_moe.moe_align_block_size` (three triton
launches) against its torch twin `reference.moe_align_block_size_ref` (a stable sort and about
20 small torch launches, the engine's earlier form).

For each token count T: routes T tokens over E experts with `select_experts` (softmax top-k, as
DeepSeek-V2-Lite's router), takes BLOCK_M from `get_default_config(T, k, E)` (what
`fused_experts` uses), checks that both forms give the same three tensors (exits 1 if not) and
times each captured in a CUDA graph and replayed (what a decode step sees), median of
`triton.testing.do_bench`, in microseconds.

    PYTHONPATH=. python3 benchmarks/bench_moe_align.py [--tokens 256 512 768 4096 8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

from mla_backend.layers.moe import select_experts
from mla_kernels.fused_moe import get_default_config, moe_align_block_size
from mla_kernels.reference import moe_align_block_size_ref

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fused_moe import bench, graph_of  # noqa: E402


def graph_time_us(fn, warmup: int, rep: int) -> float:
    """Median microseconds of one replay of a CUDA graph of fn() (bench_fused_moe's capture and
    timing)."""
    return 1000 * bench(graph_of(fn).replay, warmup, rep)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 768, 4096, 8192])
    ap.add_argument("--experts", type=int, default=64, help="E (routed experts)")
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up (ms)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench measuring time (ms)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    e, k = args.experts, args.top_k
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; E {e}, top-{k}")
    print("| T | T*k rows | BLOCK_M | triton sort us (3 launches) | torch twin us | equal |")
    print("|---|---|---|---|---|---|")
    bad = 0
    for t in args.tokens:
        _, ids = select_experts(torch.randn(t, e, device="cuda"), k)
        bm = get_default_config(t, k, e, "cuda").block_m
        got = moe_align_block_size(ids, e, bm)
        want = moe_align_block_size_ref(ids, e, bm)
        same = all(torch.equal(a, b) for a, b in zip(got, want))
        bad += not same
        ours = graph_time_us(lambda: moe_align_block_size(ids, e, bm), args.warmup, args.rep)
        twin = graph_time_us(lambda: moe_align_block_size_ref(ids, e, bm), args.warmup, args.rep)
        print(f"| {t} | {t * k} | {bm} | {ours:.1f} | {twin:.1f} | {'yes' if same else 'NO'} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
