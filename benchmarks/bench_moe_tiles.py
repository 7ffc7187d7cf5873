"""Tile sweep of the sorted MoE path's two GEMMs on a CUDA GPU, each GEMM timed alone.

`bench_fused_moe.py --sorted-*` times the whole `fused_experts` call with one config for both
GEMMs (`--down-tiles default`: the down GEMM's own default tiles); this script times
`mla_kernels.fused_moe.grouped_gemm` for the first GEMM (gate/up with the fused SiLU-and-mul,
A = x) and the second (down, weighted by the routing weight, A = the
intermediate) separately, over the cartesian product of BLOCK_M, BLOCK_N, BLOCK_K, warps and
stages, for bf16 and for FP8 experts (per-expert scales, activations quantized per token as
`fused_experts` does). DeepSeek-V2-Lite's routed experts by default (H 2048, I 1408, E 64,
top-6), routing from `select_experts` on random logits.

Every config is compiled first in `--workers` processes (triton's disk cache; row counts are not
specialized, so one token count per BLOCK_M range compiles it), then each GEMM is captured in a
CUDA graph and its replay timed (median of `triton.testing.do_bench`, µs) in this process. Per
(dtype, T) it prints the six fastest configs of each GEMM, the times of `get_default_config`'s
picks (gate/up, and down with `down=True`), and the best single config for both. Configs that
do not fit (shared memory) are skipped.
MoEConfig fields are printed as (block_m, block_n, block_k, group_m, num_warps, num_stages,
b_desc). `--b-desc on|both` also times (or only times) each config with the weight tiles loaded
through a tensor descriptor (`MoEConfig.b_desc`, TMA on Hopper).

    PYTHONPATH=. python3 benchmarks/bench_moe_tiles.py [--tokens 256 512 3072] [--dtypes fp8 bf16]
        [--b-desc off|on|both] [--block-ms 64 128] [--stages 2 3]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fused_moe import bench, graph_of, make_problem, quantize_experts  # noqa: E402
from mla_kernels.fp8_quant import quantize_per_token  # noqa: E402
from mla_kernels.fused_moe import (MoEConfig, get_default_config, grouped_gemm,  # noqa: E402
                                   moe_align_block_size)

H, I, E, K = 2048, 1408, 64, 6


def space(dtype: str, t: int, b_desc: str = "off", block_ms: list[int] | None = None,
          stages: list[int] | None = None) -> list[MoEConfig]:
    """The configs timed at T tokens: decode sizes (T*k/E <= 96) BLOCK_M 16/32/64, prefill
    64/128, or the given block_ms; BLOCK_N 64/128/256; BLOCK_K 128/256 for FP8 (one byte per
    element), 64/128 for bf16; 4 or 8 warps; 3-5 stages or the given ones; weight tiles by
    pointer loads (b_desc "off"), through a tensor descriptor ("on") or both ("both")."""
    bms = block_ms or ([16, 32, 64] if t * K / E <= 96 else [64, 128])
    bks = [128, 256] if dtype == "fp8" else [64, 128]
    descs = {"off": [False], "on": [True], "both": [False, True]}[b_desc]
    return [MoEConfig(block_m=bm, block_n=bn, block_k=bk, group_m=8 if bm >= 32 else 1,
                      num_warps=w, num_stages=s, b_desc=d)
            for d, bm, bn, bk, w, s in itertools.product(descs, bms, [64, 128, 256], bks, [4, 8],
                                                         stages or [3, 4, 5])]


def problem(dtype: str, t: int, seed: int = 0) -> dict:
    """`bench_fused_moe.make_problem`'s bf16 x, w13, w2 and routing, the weights quantized to FP8
    with [E] scales when dtype is "fp8"."""
    x, w13, w2, tw, ids = make_problem(t, H, I, E, K, torch.bfloat16, "cuda", seed)
    p = dict(x=x, tw=tw.reshape(-1).float().contiguous(), ids=ids)
    if dtype == "fp8":
        p["w13"], p["s13"] = quantize_experts(w13)
        p["w2"], p["s2"] = quantize_experts(w2)
    else:
        p["w13"], p["w2"], p["s13"], p["s2"] = w13, w2, None, None
    return p


def gemms(p: dict, t: int, cfg: MoEConfig):
    """(first GEMM, second GEMM) as closures over buffers sorted with cfg.block_m."""
    sorted_ids, expert_ids, used = moe_align_block_size(p["ids"], E, cfg.block_m)
    n = t * K
    h_act = torch.empty(n, I, dtype=torch.bfloat16, device="cuda")
    y = torch.empty(n, H, dtype=torch.bfloat16, device="cuda")
    if p["s13"] is not None:
        a1, a1s = quantize_per_token(p["x"])
        a2, a2s = quantize_per_token(h_act.normal_())
    else:
        a1, a1s, a2, a2s = p["x"], None, h_act, None

    def first():
        grouped_gemm(a1, p["w13"], h_act, sorted_ids, expert_ids, used, n, K, cfg,
                     fuse_silu_mul=True, a_scale=a1s, w_scale=p["s13"])

    def second():
        grouped_gemm(a2, p["w2"], y, sorted_ids, expert_ids, used, n, 1, cfg,
                     topk_weights=p["tw"], a_scale=a2s, w_scale=p["s2"])
    return first, second


def _compile(jobs: list[tuple[str, int, tuple]]) -> int:
    """Run every (dtype, T, config) once (fills triton's cache); the number that ran."""
    probs, ok = {}, 0
    for dtype, t, cfg in jobs:
        if (dtype, t) not in probs:
            probs[(dtype, t)] = problem(dtype, t)
        try:
            for f in gemms(probs[(dtype, t)], t, MoEConfig(*cfg)):
                f()
            ok += 1
        except Exception:  # noqa: BLE001  (a config that does not fit)
            pass
    torch.cuda.synchronize()
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 3072])
    ap.add_argument("--dtypes", nargs="+", choices=["fp8", "bf16"], default=["fp8", "bf16"])
    ap.add_argument("--workers", type=int, default=12, help="compile processes")
    ap.add_argument("--b-desc", choices=["off", "on", "both"], default="off",
                    help="weight tiles by pointer loads, a tensor descriptor (TMA), or both")
    ap.add_argument("--block-ms", type=int, nargs="+", default=None,
                    help="BLOCK_M values to sweep instead of the rule by rows per expert")
    ap.add_argument("--stages", type=int, nargs="+", default=None,
                    help="pipeline stages to sweep instead of 3 4 5")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_moe_tiles: needs a CUDA GPU", file=sys.stderr)
        return 2
    seen, jobs = set(), []
    for d in args.dtypes:
        for t in args.tokens:
            for c in space(d, t, args.b_desc, args.block_ms, args.stages):
                if (d, tuple(c)) not in seen:
                    seen.add((d, tuple(c)))
                    jobs.append((d, t, tuple(c)))
    t0 = time.time()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        ok = sum(pool.map(_compile, [jobs[i::args.workers] for i in range(args.workers)]))
    print(f"# {torch.cuda.get_device_name()}: compiled {ok}/{len(jobs)} configs in "
          f"{time.time() - t0:.0f} s; H {H}, I {I}, E {E}, top-{K}; us per GEMM (graph replay)")
    for d in args.dtypes:
        for t in args.tokens:
            p = problem(d, t)
            default = tuple(get_default_config(t, K, E, "cuda", fp8=(d == "fp8")))
            default_down = tuple(get_default_config(t, K, E, "cuda", fp8=(d == "fp8"),
                                                    down=True))
            rows = []
            for cfg in space(d, t, args.b_desc, args.block_ms, args.stages):
                try:
                    times = [1000 * bench(graph_of(f).replay, 5, 25) for f in gemms(p, t, cfg)]
                except Exception:  # noqa: BLE001  (does not fit)
                    continue
                rows.append((tuple(cfg), times[0], times[1]))
            if not rows:
                print(f"\n## {d} T {t}: no config ran")
                continue
            up = [r[1] for r in rows if r[0] == default]
            down = [r[2] for r in rows if r[0] == default_down]
            print(f"\n## {d} T {t}: {len(rows)} configs; defaults: gate/up {default} "
                  + (f"{up[0]:.1f} us" if up else "not in the sweep")
                  + f", down {default_down} "
                  + (f"{down[0]:.1f} us" if down else "not in the sweep"))
            for which, col in (("first GEMM (gate/up + SiLU)", 1), ("second GEMM (down)", 2)):
                print(which + ":")
                for r in sorted(rows, key=lambda r: r[col])[:6]:
                    print(f"  {r[0]} {r[col]:.1f} us (other GEMM {r[3 - col]:.1f})")
            best = min(rows, key=lambda r: r[1] + r[2])
            print(f"best single config {best[0]}: {best[1]:.1f} + {best[2]:.1f} = "
                  f"{best[1] + best[2]:.1f} us", flush=True)
            del p
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
