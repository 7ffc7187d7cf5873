"""MLA decode on an H200: the Gluon warp-specialized kernel vs the triton kernel, and its sweep.

For MLA absorbed (16 heads, 576 / 512 with V a view of the key pool, bf16 or with --kv-dtype an
FP8 pool, scattered slots: a random permutation) over batch sizes x context lengths, each config
(`bench_decode_attention.Config`): checks `decode_attention_ws.mla_decode_ws_fwd` and the triton
`decode_attention_fwd` against an fp32 reference on the first requests (max abs error), times both
as the engine runs them (`bench_decode_attention.graph_time_ms`: CUDA-graph replays after an L2
flush, flush time subtracted) and prints a markdown table with µs, GB/s (KV rows + q + o +
req_to_token bytes) and % of the device-to-device copy bandwidth measured in the same run. The
triton kernel runs with its engine plan (`splits_per_request`); the ws kernel with its own plan
(`ws_splits_per_request`, --per-sm programs per SM) or --ws-splits N.

Sweep: --bufs / --load-warps / --load-regs / --maxnreg / --per-sm take several values; every
combination is one table row per config (the triton row is timed once per config).

    PYTHONPATH=. python3 benchmarks/bench_decode_ws.py
    PYTHONPATH=. python3 benchmarks/bench_decode_ws.py --batch-sizes 64 256 --contexts 4096 \\
        --bufs 1 2 --load-warps 1 2 4 --no-triton
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_decode_attention as bda  # noqa: E402

import mla_kernels.decode_attention as da  # noqa: E402
import mla_kernels.decode_attention_ws as ws  # noqa: E402

GB = 1e9


class WsRun:
    """The ws kernel's plan, workspaces and output for one config and launch setting."""

    def __init__(self, cfg: bda.Config, sm_count: int, max_kv_splits: int, per_sm: int | None,
                 fixed_splits: int | None, launch: dict):
        self.cfg, self.launch = cfg, launch
        if fixed_splits is not None:
            self.max_splits = fixed_splits
            self.nks = torch.full((cfg.bs,), fixed_splits, dtype=torch.int32, device="cuda")
        else:
            self.max_splits = max(1, min(max_kv_splits,
                                         ws.ws_splits_per_request(cfg.bs, sm_count, per_sm)))
            self.nks = ws.ws_num_kv_splits(cfg.seq_lens, self.max_splits, sm_count, per_sm)
        self.o = torch.empty_like(cfg.o)
        self.logits = torch.empty(cfg.bs, cfg.h, self.max_splits, cfg.lv, device="cuda")
        self.lse = torch.empty(cfg.bs, cfg.h, self.max_splits, device="cuda")

    def __call__(self) -> None:
        c = self.cfg
        ws.mla_decode_ws_fwd(c.q, c.k_buffer, self.o, c.req_to_token, c.req_pool_indices,
                             c.seq_lens, self.nks, self.max_splits, self.logits, self.lse,
                             c.sm_scale, **self.launch)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16, 64, 128, 256])
    ap.add_argument("--contexts", nargs="+", type=int, default=[512, 4096, 32768])
    ap.add_argument("--max-kv-splits", type=int, default=64,
                    help="upper bound of both kernels' split dimension (the engine's cap)")
    ap.add_argument("--mem-cap-gb", type=float, default=60.0)
    ap.add_argument("--bufs", nargs="+", type=int, default=[0],
                    help="ws: 64-token tiles in the shared-memory ring (0 = default_bufs)")
    ap.add_argument("--load-warps", nargs="+", type=int, default=[ws.LOAD_WARPS],
                    help="ws: producer warps")
    ap.add_argument("--load-regs", nargs="+", type=int, default=[0],
                    help="ws: registers per producer thread (setmaxnreg; 0 = load_regs_for the "
                         "pool dtype: LOAD_REGS, LOAD_REGS_FP8)")
    ap.add_argument("--maxnreg", nargs="+", type=int, default=[0],
                    help="ws: launch register cap (0 = default_maxnreg: none for 2 buffers, "
                         "128 for 1)")
    ap.add_argument("--per-sm", nargs="+", type=int, default=[0],
                    help="ws split plan: programs per SM (0 = programs_per_sm(bufs))")
    ap.add_argument("--ws-splits", type=int, default=None,
                    help="ws: fixed splits per request instead of its plan")
    ap.add_argument("--reg-a", nargs="+", type=int, default=[-1], choices=[-1, 0, 1],
                    help="ws, FP8 pool: 1 = FP8 tiles converted into register operands by the "
                    "consumer, 0 = the converting producer, -1 = the default (FP8_REG_A)")
    ap.add_argument("--async-mma", nargs="+", type=int, default=[-1], choices=[-1, 0, 1],
                    help="ws, register-operand path: 1 = chunk MMAs in flight across the next "
                    "chunk's loads, 0 = waited for at once, -1 = the default (REG_A_ASYNC)")
    ap.add_argument("--no-triton", action="store_true", help="skip the triton kernel")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"],
                    help="pool dtype (auto = bf16; an FP8 pool holds N(0, 1) values, scale 1: "
                         "the ws kernel's converting producer, the triton kernel's FP8 path)")
    ap.add_argument("--n-check", type=int, default=4, help="requests checked against fp32")
    ap.add_argument("--flush", default="read", choices=list(bda.FLUSHES),
                    help="L2 flush before each timed call (bench_decode_attention.FLUSHES)")
    ap.add_argument("--profile", action="store_true",
                    help="also print each kernel's mean device time (torch.profiler) per row")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_ws: needs a CUDA GPU")
    da.WS_MLA_MIN_BS = None  # the "triton" columns time the triton kernel, not the dispatch
    kv_dtype = bda._KV_DTYPES[args.kv_dtype]
    props = torch.cuda.get_device_properties(0)
    sm_count = props.multi_processor_count
    bw_copy = bda.copy_bandwidth()
    torch.cuda.empty_cache()
    print(f"device: {props.name}, {sm_count} SMs; torch {torch.__version__}, triton "
          f"{triton.__version__}; copy bandwidth {bw_copy:.0f} GB/s; max_kv_splits "
          f"{args.max_kv_splits}; ws defaults: bufs {ws.NUM_BUFS}, load warps {ws.LOAD_WARPS}, "
          f"load regs {ws.LOAD_REGS} (FP8 pool {ws.LOAD_REGS_FP8}); KV pool {args.kv_dtype}\n")
    variants = list(itertools.product(args.bufs, args.load_warps, args.load_regs, args.maxnreg,
                                      args.per_sm, args.reg_a, args.async_mma))
    print(f"L2 flush: {args.flush}")
    print("| bufs,lw,lr,maxnreg,per_sm,reg_a(a: async) | bs | ctx | triton splits | triton err "
          "| triton us "
          "| triton % | ws splits | ws err | ws us | ws GB/s | ws % copy BW | speedup |")
    print("|---" * 13 + "|")
    flush = bda.make_flush(args.flush)
    profiles: list[str] = []

    for bs in args.batch_sizes:
        for ctx in args.contexts:
            pool = bda.pool_bytes("mla", bs * ctx) // (1 if kv_dtype is None else 2)
            if (pool + 2 * bs * 16 * args.max_kv_splits * 512 * 4) / GB > args.mem_cap_gb:
                print(f"| | {bs} | {ctx} | skipped: pool {pool / GB:.1f} GB over the cap "
                      + "| " * 10 + "|")
                continue
            cfg = bda.Config("mla", bs, ctx, args.max_kv_splits, sm_count, kv_dtype=kv_dtype)
            bytes_moved = cfg.bytes_moved()
            if args.no_triton:
                t_cols, t_us = "- | - | - | -", None
            else:
                t_err = cfg.max_abs_err(args.n_check)
                t_ms = bda.graph_time_ms(cfg.run_kernel, flush)
                t_us = t_ms * 1e3
                t_cols = (f"{cfg.num_kv_splits[0].item()} | {t_err:.2e} | {t_us:.1f} | "
                          f"{bytes_moved / (t_ms * 1e-3) / GB / bw_copy:.0%}")
            for nb, lw, lr, mnr, pps, ra, am in variants:
                reg_a = ws.FP8_REG_A if ra < 0 else bool(ra)
                fp8_tiles = cfg.k_buffer.dtype != torch.bfloat16 and reg_a
                nb = nb or ws.default_bufs(cfg.k_buffer.dtype, reg_a)
                launch = dict(num_bufs=nb, load_warps=lw,
                              load_regs=lr or ws.load_regs_for(cfg.k_buffer.dtype, reg_a),
                              maxnreg=mnr or None, reg_a=reg_a,
                              async_mma=ws.REG_A_ASYNC if am < 0 else bool(am))
                run = WsRun(cfg, sm_count, args.max_kv_splits,
                            pps or ws.programs_per_sm(nb, fp8_tiles), args.ws_splits, launch)
                label = (f"{nb},{lw},{launch['load_regs']},"
                         f"{mnr or ws.default_maxnreg(nb, fp8_tiles) or '-'},{pps or '-'},"
                         f"{int(fp8_tiles)}{'a' if fp8_tiles and launch['async_mma'] else ''}")
                try:
                    run()
                    torch.cuda.synchronize()
                except Exception as exc:  # a setting that does not compile / launch: one row
                    print(f"| {label} | {bs} | {ctx} | {t_cols} | failed: "
                          f"{type(exc).__name__}: {str(exc)[:80]} | | | | | |", flush=True)
                    continue
                err = cfg.max_abs_err(args.n_check, o=run.o)
                ms = bda.graph_time_ms(run, flush)
                if args.profile:
                    profiles.append(f"{label} bs {bs} ctx {ctx}: "
                                    + bda.profile_kernels(run, flush))
                gbs = bytes_moved / (ms * 1e-3) / GB
                speed = f"{t_us / (ms * 1e3):.2f}x" if t_us else "-"
                print(f"| {label} | {bs} | {ctx} | {t_cols} | {run.nks[0].item()} | {err:.2e} "
                      f"| {ms * 1e3:.1f} | {gbs:.0f} | {gbs / bw_copy:.0%} | {speed} |",
                      flush=True)
            del cfg
            torch.cuda.empty_cache()
    for line in profiles:
        print(line)


if __name__ == "__main__":
    main()
