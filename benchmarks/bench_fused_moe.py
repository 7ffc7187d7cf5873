"""Fused MoE benchmark on a CUDA GPU: `mla_kernels.fused_moe.fused_experts`, both paths, vs a loop.

DeepSeek-V2-Lite routed experts by default (H 2048, I 1408, E 64, top-6, bf16). For each token
count T it

1. draws router logits and routes with `select_experts` (softmax top-k, like the model);
2. runs each path of `fused_experts` (path="sorted": sort + grouped GEMM; path="gemv": the
   sort-free small-batch kernels, once per GEMV tile config of the sweep) and checks it vs the
   loop `layers.moe.experts_forward` (max abs difference; exits 1 when it exceeds --tol);
3. times, with triton.testing.do_bench (median): the call, the same call captured in a CUDA
   graph and replayed (what decode sees: no launch overhead), and (once per T) the loop;
4. reports the weight bytes the call must read (experts that received a token x 3·H·I elements)
   over the graph-replay time, in GB/s: for small T (a few experts, weight-bound) the number to
   hold against the HBM bandwidth (the device's copy rate).

Prints a markdown table, one row per (T, path, config); `auto` marks the path that
`fused_experts(path="auto")` takes at that T (GEMV iff T*k <= GEMV_MAX_ROWS). The GEMV path is
timed only up to T*k <= --gemv-max-rows (it reads an expert once per row, so it is slow and
pointless at prefill sizes).

    PYTHONPATH=. python3 benchmarks/bench_fused_moe.py [--tokens 1 8 64] [--no-loop]
    # sweep GEMV tiles (cartesian product of the values given; others stay at their defaults):
    PYTHONPATH=. python3 benchmarks/bench_fused_moe.py --tokens 1 8 --paths gemv --no-loop \\
        --gemv-block-n 16 32 64 --gemv-block-k 128 256 --gemv-warps 4 8
    # FP8 experts (per expert per tensor scales, dynamic activations), sorted-path tile sweep:
    PYTHONPATH=. python3 benchmarks/bench_fused_moe.py --fp8 --tokens 64 512 --paths sorted \\
        --no-loop --tol 0.25 --sorted-block-n 64 128 --sorted-block-k 64 128 --sorted-warps 4 8
    # the down GEMM's tiles (its own default, or the first GEMM's):
    PYTHONPATH=. python3 benchmarks/bench_fused_moe.py --fp8 --tokens 512 1024 --paths sorted \\
        --no-loop --tol 0.25 --down-tiles same default

With --fp8 the loop reference runs on the dequantized weights, so "max abs diff" is the FP8
activation-quantization error (random O(1) outputs), not a kernel error.

The model's batch-size-1 decode form (GEMV path only): `--shared S` folds S shared experts of
width I into the launches (`fused_experts(shared_w13=, shared_w2=)`), `--route kernel` launches
the routing kernel `softmax_topk` before each call (as the model does; `none`: precomputed),
and `--cold` times what a decode step sees: a CUDA graph of one call per disjoint group of k
experts (and per copy of the shared weights), so no call finds its weights in L2; the time is
per call and "weight GB/s" counts the routed and shared bytes of one call.

    PYTHONPATH=. python3 benchmarks/bench_fused_moe.py --tokens 1 --paths gemv --no-loop \
        --shared 2 --route kernel --cold --gemv-block-n 8 16 --gemv-block-k 256 512

Needs a CUDA device (exits with a message otherwise). Imports torch, triton, mla_backend.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton

from mla_backend.layers.moe import experts_forward, select_experts
from mla_backend.layers.quantization import quantize_fp8_per_tensor
from mla_kernels.fused_moe import (
    GemvConfig,
    MoEConfig,
    fused_experts,
    get_default_config,
    get_default_gemv_config,
    use_gemv_path,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_problem(t: int, h: int, inter: int, e: int, k: int, dtype: torch.dtype, device: str,
                 seed: int = 0) -> tuple[torch.Tensor, ...]:
    """x [t, h], w13 [e, 2I, h], w2 [e, h, I] (scaled to O(1) activations), routing [t, k]."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(t, h, generator=g, device=device).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=g, device=device) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g, device=device) / inter ** 0.5).to(dtype)
    weights, ids = select_experts(torch.randn(t, e, generator=g, device=device), k)
    return x, w13, w2, weights, ids


def weight_bytes(topk_ids: torch.Tensor, h: int, inter: int, itemsize: int) -> int:
    """Bytes of expert weights a call reads at least once: used experts x (2I·H + H·I)."""
    used = int(torch.unique(topk_ids).numel())
    return used * 3 * h * inter * itemsize


def graph_of(fn) -> torch.cuda.CUDAGraph:
    """Capture fn() (after a warm-up on a side stream) into a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def bench(fn, warmup: int, rep: int) -> float:
    """Median milliseconds per call."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def gemv_configs(args: argparse.Namespace, top_k: int) -> list[GemvConfig]:
    """The GEMV tile configs to time: the cartesian product of the --gemv-* values given, each
    field not given at `get_default_gemv_config`'s value (for k + --shared slots)."""
    base = get_default_gemv_config(top_k + args.shared, "cuda")
    choices = {name: getattr(args, "gemv_" + name) or [getattr(base, name)]
               for name in GemvConfig._fields}
    return [GemvConfig(*vals) for vals in itertools.product(*choices.values())]


def sorted_configs(args: argparse.Namespace, t: int, k: int, e: int) -> list[MoEConfig]:
    """The sorted-path tile configs to time: the cartesian product of the --sorted-* values
    given, each field not given at `get_default_config`'s value for this T."""
    base = get_default_config(t, k, e, "cuda", fp8=args.fp8)
    fields = {"block_m": "block_m", "block_n": "block_n", "block_k": "block_k",
              "num_warps": "warps", "num_stages": "stages"}
    choices = {f: getattr(args, "sorted_" + a) or [getattr(base, f)] for f, a in fields.items()}
    choices["b_desc"] = [bool(v) for v in args.sorted_b_desc] if args.sorted_b_desc else \
        [base.b_desc]
    return [base._replace(**dict(zip(choices, vals)))
            for vals in itertools.product(*choices.values())]


def sorted_runs(args: argparse.Namespace, t: int, k: int, e: int) -> list[tuple]:
    """(config, down_config) pairs of the sorted path: each first-GEMM config with each
    --down-tiles choice ("same": its own tiles; "default": `get_default_config(down=True)`,
    when its block_m matches)."""
    down_default = get_default_config(t, k, e, "cuda", fp8=args.fp8, down=True)
    swept = any(getattr(args, "sorted_" + a) for a in ("block_m", "block_n", "block_k", "warps",
                                                       "stages", "b_desc"))
    choice = args.down_tiles or (["same"] if swept else ["default"])
    out = []
    for cfg in sorted_configs(args, t, k, e):
        if "default" in choice and down_default.block_m != cfg.block_m:
            print(f"(T {t}: the default down tiles need BM{down_default.block_m}; "
                  f"BM{cfg.block_m} times its own tiles for both GEMMs)", flush=True)
        downs = {cfg if d == "same" or down_default.block_m != cfg.block_m else down_default
                 for d in choice}
        for down in sorted(downs, key=lambda c: c != cfg):
            out.append((cfg, down))
    return out


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (float8_e4m3fn [E, N, K], float32 [E] per-expert scales)."""
    qs = [quantize_fp8_per_tensor(w[i]) for i in range(w.shape[0])]
    return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])


def describe(path: str, cfg, down=None) -> str:
    if path == "sorted":
        def tiles(c) -> str:
            return (f"BM{c.block_m} BN{c.block_n} BK{c.block_k} w{c.num_warps} "
                    f"s{c.num_stages}{' desc' if c.b_desc else ''}")
        text = tiles(cfg)
        if down is not None and down != cfg:
            text += " / down " + tiles(down)
        return text
    return (f"up BN{cfg.block_n} BK{cfg.block_k} w{cfg.num_warps} / down BN{cfg.down_block_n} "
            f"BK{cfg.down_block_k} w{cfg.down_num_warps} / s{cfg.num_stages}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--tokens", type=int, nargs="+",
                    default=[1, 2, 4, 8, 12, 16, 24, 32, 64, 256, 1024], help="token counts T")
    ap.add_argument("--hidden", type=int, default=2048, help="H")
    ap.add_argument("--inter", type=int, default=1408, help="I (moe_intermediate_size)")
    ap.add_argument("--experts", type=int, default=64, help="E (routed experts)")
    ap.add_argument("--top-k", type=int, default=6, help="experts per token")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--paths", nargs="+", choices=["gemv", "sorted"], default=["gemv", "sorted"],
                    help="fused_experts paths to time")
    ap.add_argument("--gemv-max-rows", type=int, default=256,
                    help="time the GEMV path only where T*k <= this")
    sweep = ap.add_argument_group("GEMV tile sweep (each takes one or more values)")
    for flag, field, what in [
            ("--gemv-block-n", "block_n", "gate/up outputs per program (first kernel)"),
            ("--gemv-block-k", "block_k", "H step of the first kernel"),
            ("--gemv-warps", "num_warps", "warps of the first kernel"),
            ("--gemv-down-block-n", "down_block_n", "outputs per program (second kernel)"),
            ("--gemv-down-block-k", "down_block_k", "I step of the second kernel"),
            ("--gemv-down-warps", "down_num_warps", "warps of the second kernel"),
            ("--gemv-stages", "num_stages", "num_stages of both kernels")]:
        sweep.add_argument(flag, dest="gemv_" + field, type=int, nargs="+", default=None,
                           help=what)
    ssweep = ap.add_argument_group("sorted-path tile sweep (each takes one or more values)")
    for a in ("block_m", "block_n", "block_k", "warps", "stages", "b_desc"):
        ssweep.add_argument("--sorted-" + a.replace("_", "-"), dest="sorted_" + a, type=int,
                            nargs="+", default=None)
    ssweep.add_argument("--down-tiles", nargs="+", choices=["same", "default"], default=None,
                        help="the down GEMM's tiles: the first GEMM's (same) or "
                             "get_default_config(down=True) (default); without this option "
                             "'same' when a --sorted-* sweep is given, else 'default'")

    ap.add_argument("--fp8", action="store_true",
                    help="FP8 experts, per-expert per-tensor scales (dynamic activations)")
    ap.add_argument("--no-loop", action="store_true", help="skip timing the per-expert loop")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay timing")
    ap.add_argument("--shared", type=int, default=0,
                    help="GEMV path: fold this many shared experts of width I into the calls")
    ap.add_argument("--route", choices=["none", "kernel"], default="none",
                    help="GEMV path: routing in each call: none (precomputed) or kernel (the "
                         "softmax_topk launch before the call)")
    ap.add_argument("--cold", action="store_true",
                    help="GEMV path: time a graph of calls over disjoint experts (no L2 reuse)")
    ap.add_argument("--tol", type=float, default=5e-2,
                    help="max abs difference fused vs loop before failing (bf16 outputs ~0.3)")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up (ms)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench measuring time (ms)")
    args = ap.parse_args(argv)
    if any(t < 1 for t in args.tokens) or min(args.hidden, args.inter, args.experts) < 1 \
            or not 1 <= args.top_k <= args.experts:
        ap.error("token counts, sizes must be >= 1 and 1 <= top-k <= experts")
    for field in GemvConfig._fields:
        vals = getattr(args, "gemv_" + field) or []
        if field not in ("num_warps", "down_num_warps", "num_stages") \
                and any(v < 1 or v & (v - 1) for v in vals):
            ap.error(f"--gemv-{field.replace('_', '-')} values must be powers of two")
    if not torch.cuda.is_available():
        print("bench_fused_moe: needs a CUDA GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2

    dtype = DTYPES[args.dtype]
    h, inter, e, k = args.hidden, args.inter, args.experts, args.top_k
    print(f"# fused MoE, {torch.cuda.get_device_name()}: H {h}, I {inter}, E {e}, top-{k}, "
          f"{args.dtype}{', FP8 experts (per-expert scales)' if args.fp8 else ''}")
    print("| T | path | config | experts used | max abs diff | fused us | fused graph us "
          "| loop us | speed-up vs loop | weight GB/s (graph) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    failed = False
    for t in args.tokens:
        x, w13, w2, weights, ids = make_problem(t, h, inter, e, k, dtype, "cuda", seed=t)
        out = torch.empty_like(x)
        fp8_kw: dict = {}
        if args.fp8:
            (w13, s13), (w2, s2) = quantize_experts(w13), quantize_experts(w2)
            fp8_kw = {"w13_scale": s13, "w2_scale": s2}
            loop_out = experts_forward(x, (w13.float() * s13[:, None, None]).to(dtype),
                                       (w2.float() * s2[:, None, None]).to(dtype), weights, ids)
        else:
            loop_out = experts_forward(x, w13, w2, weights, ids)
        loop_ms = float("nan")
        if not args.no_loop and not args.fp8:  # the loop takes model-dtype weights
            loop_ms = bench(lambda x=x, w13=w13, w2=w2, weights=weights, ids=ids:
                            experts_forward(x, w13, w2, weights, ids), args.warmup, args.rep)
        nbytes = weight_bytes(ids, h, inter, w13.element_size())
        n_used = int(torch.unique(ids).numel())
        auto = "gemv" if use_gemv_path(t, k) else "sorted"
        runs: list[tuple[str, object]] = []
        if "sorted" in args.paths:
            runs += [("sorted", run) for run in sorted_runs(args, t, k, e)]
        if "gemv" in args.paths and t * k <= args.gemv_max_rows:
            runs += [("gemv", cfg) for cfg in gemv_configs(args, k)]
        decode_form = args.shared or args.route != "none" or args.cold
        if decode_form:
            if args.paths != ["gemv"] or args.fp8 or t != 1:
                ap.error("--shared / --route / --cold: --paths gemv, T = 1, bf16 only")
            for _, cfg in runs:
                failed |= not _bench_decode_form(args, cfg, x, w13, w2, k)
            continue
        for path, cfg in runs:
            down = None
            if path == "sorted":
                cfg, down = cfg
                kw = {"config": cfg, "down_config": down}
            else:
                kw = {"gemv_config": cfg}
            kw.update(fp8_kw)

            def call(x=x, w13=w13, w2=w2, weights=weights, ids=ids, out=out, path=path, kw=kw
                     ) -> torch.Tensor:
                return fused_experts(x, w13, w2, weights, ids, out=out, path=path, **kw)

            call()
            diff = (out.float() - loop_out.float()).abs().max().item()
            failed |= not diff <= args.tol
            fused_ms = bench(call, args.warmup, args.rep)
            graph_ms = float("nan")
            if not args.no_graph:
                graph = graph_of(call)
                graph_ms = bench(graph.replay, args.warmup, args.rep)
                del graph
            best_ms = fused_ms if args.no_graph else graph_ms
            label = f"{path} (auto)" if path == auto else path
            print(f"| {t} | {label} | {describe(path, cfg, down)} | {n_used} "
                  f"| {diff:.2e} "
                  f"| {fused_ms * 1e3:.1f} | {graph_ms * 1e3:.1f} | {loop_ms * 1e3:.1f} "
                  f"| {loop_ms / best_ms:.1f}x | {nbytes / (best_ms * 1e-3) / 1e9:.0f} |",
                  flush=True)
    if failed:
        print(f"FAILED: fused vs loop differ by more than --tol {args.tol}", file=sys.stderr)
        return 1
    return 0


def _bench_decode_form(args: argparse.Namespace, cfg: GemvConfig, x: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor, k: int) -> None:
    """One table row for the batch-size-1 decode form (--shared / --route / --cold): checks the
    call against fused_experts without them plus the shared MLP, then times it. Returns whether
    the check is within --tol."""
    from mla_kernels.moe_routing import softmax_topk

    e, inter, h = w13.shape[0], w2.shape[2], x.shape[1]
    n_calls = max(1, e // k) if args.cold else 1
    g = torch.Generator(device="cuda").manual_seed(1)
    shared = []
    for _ in range(n_calls if args.shared else 0):
        sw13 = (torch.randn(2 * args.shared * inter, h, generator=g, device="cuda")
                / h ** 0.5).to(x.dtype)
        sw2 = (torch.randn(h, args.shared * inter, generator=g, device="cuda")
               / (args.shared * inter) ** 0.5).to(x.dtype)
        shared.append({"shared_w13": sw13, "shared_w2": sw2})
    # call i uses experts [i*k, (i+1)*k): disjoint groups, so consecutive calls share nothing
    logits, call_ids = [], []
    for i in range(n_calls):
        lg = torch.randn(1, e, generator=g, device="cuda")
        group = torch.arange(i * k, (i + 1) * k, device="cuda") % e
        lg[0, group] += 50.0  # these k experts win the softmax top-k
        logits.append(lg)
        call_ids.append(select_experts(lg, k))
    outs = [torch.empty_like(x) for _ in range(n_calls)]

    def calls() -> None:
        for i in range(n_calls):
            kw = dict(shared[i]) if shared else {}
            if args.route == "kernel":
                wts, idx = softmax_topk(logits[i], k)
            else:
                wts, idx = call_ids[i]
            fused_experts(x, w13, w2, wts, idx, out=outs[i], path="gemv", gemv_config=cfg, **kw)

    calls()
    want_w, want_ids = call_ids[0]
    want = fused_experts(x, w13, w2, want_w, want_ids, path="gemv", gemv_config=cfg)
    if shared:
        sw13, sw2 = shared[0]["shared_w13"], shared[0]["shared_w2"]
        gate, up = (x.float() @ sw13.float().T).chunk(2, dim=-1)
        want = want.float() + (torch.nn.functional.silu(gate) * up) @ sw2.float().T
    diff = (outs[0].float() - want.float()).abs().max().item()
    graph = graph_of(calls)
    ms = bench(graph.replay, args.warmup, args.rep) / n_calls
    nbytes = (3 * h * inter * k + (3 * h * inter * args.shared)) * x.element_size()
    form = f"S{args.shared} route {args.route}{' cold' if args.cold else ''}"
    print(f"| 1 | gemv {form} | {describe('gemv', cfg)} | {k} | {diff:.2e} | | {ms * 1e3:.1f} "
          f"| | | {nbytes / (ms * 1e-3) / 1e9:.0f} |", flush=True)
    return diff <= args.tol


if __name__ == "__main__":
    sys.exit(main())
