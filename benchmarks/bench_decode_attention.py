"""Decode attention kernel benchmark on a CUDA GPU: `mla_kernels.decode_attention` vs torch.

For MLA absorbed (16 heads, Lk 576 / Lv 512 as a view of the key pool, bf16) and GQA (32 query
heads / 8 KV heads, head dim 128, bf16) over batch sizes x context lengths, each config:

1. builds a pool with scattered slots (a random permutation) and uniform context lengths;
2. checks the kernel against an fp32 torch reference on a few requests (max abs error);
3. times the kernel as the engine runs decode — replays of a captured CUDA graph, so host launch
   time is excluded, each call after an L2 flush whose own time is subtracted (`graph_time_ms`,
   median) — and a plain torch reference (gather through req_to_token + einsums;
   triton.testing.do_bench, launches included);
4. reports achieved bandwidth = (KV bytes read + q read + o written + req_to_token read) / time,
   against the device-to-device copy bandwidth measured in the same run (torch copy of a 4 GB
   buffer: 2 x 4 GB moved per copy).

Prints a markdown table. Configs whose pool (plus the reference's gathered copy, when timed) would
exceed --mem-cap-gb are skipped or run without the torch timing.

    PYTHONPATH=. python3 benchmarks/bench_decode_attention.py [--quick] [--max-kv-splits 64]

Imports only torch, triton and the kernels (`mla_kernels`).
"""

from __future__ import annotations

import argparse
import math

import torch
import triton

import mla_kernels.decode_attention as da
from mla_kernels.decode_attention import (
    decode_attention_fwd,
    get_num_kv_splits,
    num_head_programs,
)

GB = 1e9
LAYOUTS = {
    # name: (q heads, kv heads, Lk, Lv, mla)
    "mla": (16, 1, 576, 512, True),
    "gqa": (32, 8, 128, 128, False),
}


def copy_bandwidth(nbytes: int = 4 * 1024 ** 3) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written per second)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").fill_(1.0)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300,
                                 return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / GB  # src/dst are freed on return


def _capture(fns, n: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of n rounds of calling each of fns in order (warmed up once first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            for fn in fns:
                fn()
    return graph


def _replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median wall time of one replay (CUDA events), ms."""
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_time_ms(fn, flush, rounds: int = 10, reps: int = 30) -> float:
    """Device time of one call of fn, ms, as the engine runs decode: replayed from a CUDA graph
    (host launch time excluded), each call after an L2 flush (`flush`, see `make_flush`),
    whose own time — a graph of the flushes alone — is subtracted."""
    both = _replay_ms(_capture([flush, fn], rounds), reps)
    flush_only = _replay_ms(_capture([flush], rounds), reps)
    return max(both - flush_only, 1e-6) / rounds


# L2 flushes over 256 MB (> the H200's L2). "read" (the default): a sum, which leaves the cache
# full of clean lines, as in a decode step, where the kernels before attention mostly read
# weights. "write": a memset, which leaves up to an L2 of dirty lines that the timed kernel then
# has to write back to HBM, so it times the kernel slower than a decode step sees it.
FLUSHES = ("read", "write")


def make_flush(kind: str = "read"):
    """The flush function `graph_time_ms` takes: kind in FLUSHES. Allocates 256 MB on the GPU.

    Raises:
        ValueError: an unknown kind.
    """
    if kind not in FLUSHES:
        raise ValueError(f"flush kind must be one of {FLUSHES}, got {kind!r}")
    buf = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.float32, device="cuda").normal_()
    sink = torch.empty((), dtype=torch.float32, device="cuda")
    if kind == "write":
        return buf.zero_
    return lambda: torch.sum(buf, dim=0, out=sink)


def profile_kernels(fn, flush, rounds: int = 10) -> str:
    """Mean device time per call of each kernel that fn launches, from torch.profiler (CUPTI)
    over one replay of a CUDA graph of `rounds` x [flush, fn], as "name us, ..." (the flush's
    kernels listed too)."""
    graph = _capture([flush, fn], rounds)
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            times[ev.name] = times.get(ev.name, 0.0) + ev.device_time / rounds
    return ", ".join(f"{name[:40]} {us:.1f}" for name, us in sorted(times.items()))


def pool_bytes(layout: str, tokens: int) -> int:
    _, hkv, lk, lv, mla = LAYOUTS[layout]
    per_token = lk * 2 if mla else hkv * (lk + lv) * 2
    return tokens * per_token


class Config:
    """One (layout, bs, ctx) problem on the GPU: pool, metadata, inputs, workspaces."""

    def __init__(self, layout: str, bs: int, ctx: int, max_kv_splits: int, sm_count: int,
                 seed: int = 0, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                 fixed_splits: int | None = None, kv_dtype: torch.dtype | None = None):
        self.layout, self.bs, self.ctx = layout, bs, ctx
        h, hkv, lk, lv, mla = LAYOUTS[layout]
        self.h, self.hkv, self.lk, self.lv, self.mla = h, hkv, lk, lv, mla
        dev, dt = device, dtype
        torch.manual_seed(seed)
        tokens = bs * ctx
        size = tokens + 1  # slot 0 is the padding sink
        kv_dt = kv_dtype or dt  # an FP8 pool holds N(0, 1) values, dequantization scale 1
        self.k_buffer = torch.empty(size, hkv, lk, dtype=dt, device=dev).normal_().to(kv_dt)
        if mla:
            self.v_buffer = self.k_buffer[..., :lv]
        else:
            self.v_buffer = torch.empty(size, hkv, lv, dtype=dt, device=dev).normal_().to(kv_dt)
        slots = (torch.randperm(tokens, device=dev) + 1).to(torch.int32).view(bs, ctx)
        self.req_to_token = torch.zeros(bs, ctx + 8, dtype=torch.int32, device=dev)
        self.req_to_token[:, :ctx] = slots
        self.req_pool_indices = torch.randperm(bs, device=dev)  # rows out of order
        self.seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
        self.q = torch.randn(bs, h, lk, device=dev).to(dt)
        self.o = torch.empty(bs, h, lv, dtype=dt, device=dev)
        self.sm_scale = 0.1147 if mla else lk ** -0.5
        groups = num_head_programs(h, hkv, lv)
        # the engine's workspace split dimension (TritonAttnBackend._split_cap): the grid size
        self.max_kv_splits = max(1, min(max_kv_splits, da.splits_per_request(
            bs, groups, sm_count, lk, self.k_buffer.dtype)))
        if fixed_splits is not None:
            self.max_kv_splits = fixed_splits
        self.num_kv_splits = get_num_kv_splits(self.seq_lens, groups, self.max_kv_splits,
                                               sm_count, head_dim=lk, kv_dtype=self.k_buffer.dtype)
        self.attn_logits = torch.empty(bs, h, self.max_kv_splits, lv, dtype=torch.float32,
                                       device=dev)
        self.attn_lse = torch.empty(bs, h, self.max_kv_splits, dtype=torch.float32, device=dev)

    def run_kernel(self) -> None:
        decode_attention_fwd(self.q, self.k_buffer, self.v_buffer, self.o, self.req_to_token,
                             self.req_pool_indices, self.seq_lens, self.num_kv_splits,
                             self.max_kv_splits, self.attn_logits, self.attn_lse, self.sm_scale)

    def bytes_moved(self) -> int:
        tokens = self.bs * self.ctx
        elem = self.q.element_size()
        return (pool_bytes(self.layout, tokens) // 2 * self.k_buffer.element_size()
                + self.q.numel() * elem + self.o.numel() * elem + tokens * 4)

    def torch_ref(self) -> torch.Tensor:
        """Plain torch decode: gather every request's K/V through req_to_token, then grouped
        einsums (bf16 matmuls, fp32 softmax; KV heads never expanded). [bs, H, Lv] bf16."""
        rows = self.req_to_token[self.req_pool_indices.long(), :self.ctx].long()  # [bs, ctx]
        k = self.k_buffer[rows].to(self.q.dtype)  # [bs, ctx, Hkv, Lk]
        v = k[..., :self.lv] if self.mla else self.v_buffer[rows].to(self.q.dtype)
        q = self.q.view(self.bs, self.hkv, self.h // self.hkv, self.lk)
        s = torch.einsum("bhgd,blhd->bhgl", q, k).float() * self.sm_scale
        p = torch.softmax(s, dim=-1).to(v.dtype)
        return torch.einsum("bhgl,blhd->bhgd", p, v).reshape(self.bs, self.h, self.lv)

    def max_abs_err(self, n_check: int = 4, o: torch.Tensor | None = None) -> float:
        """Kernel vs an fp32 reference on the first n_check requests: `run_kernel`'s output, or
        `o` [bs, H, Lv] computed elsewhere on this config's inputs."""
        if o is None:
            self.run_kernel()
            o = self.o
        err = 0.0
        for i in range(min(n_check, self.bs)):
            row = int(self.req_pool_indices[i])
            slots = self.req_to_token[row, :self.ctx].long()
            k = self.k_buffer[slots].float()  # [ctx, Hkv, Lk]
            v = self.v_buffer[slots].float()
            group = self.h // self.hkv
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            s = torch.einsum("hd,khd->hk", self.q[i].float(), k) * self.sm_scale
            ref = torch.einsum("hk,khd->hd", torch.softmax(s, dim=-1), v)
            err = max(err, (o[i].float() - ref).abs().max().item())
        return err


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few configs, shorter timing")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16, 64, 256])
    ap.add_argument("--contexts", nargs="+", type=int, default=[512, 4096, 32768])
    ap.add_argument("--max-kv-splits", type=int, default=64,
                    help="upper bound of the workspace split dimension (the engine's "
                         "max_kv_splits; per batch size it is capped as the engine caps it)")
    ap.add_argument("--mem-cap-gb", type=float, default=60.0,
                    help="skip configs whose buffers would exceed this many GB")
    ap.add_argument("--num-warps", type=int, default=None,
                    help="override decode_attention.STAGE1_NUM_WARPS (tuning)")
    ap.add_argument("--programs-per-sm", type=int, default=None,
                    help="override decode_attention.PROGRAMS_PER_SM, the split target (tuning)")
    ap.add_argument("--block-n-wide", type=int, default=None,
                    help="override decode_attention.BLOCK_N_WIDE, tokens per tile for MLA (tuning)")
    ap.add_argument("--num-stages", type=int, default=None,
                    help="override decode_attention.STAGE1_NUM_STAGES (tuning)")
    ap.add_argument("--k-reuse", action="store_true",
                    help="MLA: reuse the gathered K tile as the V tile (off by default)")
    ap.add_argument("--no-k-reuse", action="store_true",
                    help="MLA: gather V separately instead of reusing the K tile")
    ap.add_argument("--swap-ab", action="store_true",
                    help="MLA: transposed products (tokens as the MMA's M dimension) at every "
                         "batch size (tuning; default: up to SWAP_AB_MAX_BS)")
    ap.add_argument("--no-ws", action="store_true",
                    help="MLA: time the triton kernel where the engine would hand the batch to "
                         "the warp-specialized kernel (decode_attention.WS_MLA_MIN_BS)")
    ap.add_argument("--splits", type=int, default=None,
                    help="fixed KV splits per request instead of get_num_kv_splits (tuning)")
    ap.add_argument("--variants", nargs="+", default=None, metavar="KEY=V,...",
                    help="sweep in one process: each variant sets some of swap, swapmax, ss "
                         "(transposed path), sbs, sbn, sss (its small-batch tiles), reuse, s "
                         "(untransposed wide path), bn, w, ppsm, "
                         "wppsm, splits, fp8wide (FP8 pools on the wide plan) (e.g. "
                         "swap=1,swapmax=1024,bn=32,ss=5,splits=4) on top of "
                         "the defaults and the other flags; one table row per variant and config")
    ap.add_argument("--no-torch", action="store_true", help="skip timing the torch reference")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"],
                    help="pool dtype (auto: bf16, as the queries); FP8 pools count 1 byte per "
                         "value in GB/s")
    ap.add_argument("--flush", default="read", choices=list(FLUSHES),
                    help="L2 flush before each timed call (FLUSHES)")
    args = ap.parse_args(argv)

    if args.programs_per_sm is not None:
        da.PROGRAMS_PER_SM = args.programs_per_sm
    if args.block_n_wide is not None:
        da.BLOCK_N_WIDE = args.block_n_wide
    if args.num_warps is not None:
        da.STAGE1_NUM_WARPS = args.num_warps
    if args.num_stages is not None:
        da.STAGE1_NUM_STAGES = da.STAGE1_NUM_STAGES_WIDE = args.num_stages
    if args.no_k_reuse:
        da.REUSE_K_TILE_AS_V = False
    if args.k_reuse:
        da.REUSE_K_TILE_AS_V = True
    if args.swap_ab:
        da.SWAP_AB_WIDE, da.SWAP_AB_MAX_BS = True, 1 << 30
    if args.no_ws:
        da.WS_MLA_MIN_BS = None
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_attention: needs a CUDA GPU")
    if args.quick:
        args.batch_sizes, args.contexts = [1, 64], [512, 32768]
    warmup, rep = (10, 50) if args.quick else (25, 200)
    props = torch.cuda.get_device_properties(0)
    sm_count = props.multi_processor_count
    bw_copy = copy_bandwidth()
    torch.cuda.empty_cache()
    print(f"device: {props.name}, {sm_count} SMs; torch {torch.__version__}, "
          f"triton {triton.__version__}; copy bandwidth {bw_copy:.0f} GB/s; "
          f"max_kv_splits {args.max_kv_splits}; stage 1: {da.STAGE1_NUM_WARPS} warps, "
          f"{da.STAGE1_NUM_STAGES} stages ({da.STAGE1_NUM_STAGES_WIDE} for MLA), "
          f"K tile reuse for MLA V {da.REUSE_K_TILE_AS_V}; KV pool {args.kv_dtype}; "
          f"L2 flush {args.flush}\n")
    variants = args.variants or [""]
    base = {name: getattr(da, name) for name in (*_VARIANT_KEYS.values(), "_FP8_DTYPES")}
    label = "| variant " if args.variants else ""
    print(f"{label}| layout | bs | ctx | splits | max abs err | kernel us | GB/s | % copy BW "
          "| torch us | torch GB/s | speedup |")
    print("|---" * (11 + bool(args.variants)) + "|")
    for variant in variants:
        for name, value in base.items():
            setattr(da, name, value)
        fixed_splits = _apply_variant(variant) if variant else None
        if fixed_splits is None:
            fixed_splits = args.splits
        prefix = f"| {variant} " if args.variants else ""
        run_configs(args, sm_count, bw_copy, warmup, rep, prefix, fixed_splits)


_KV_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_VARIANT_KEYS = {"swap": "SWAP_AB_WIDE", "reuse": "REUSE_K_TILE_AS_V", "bn": "BLOCK_N_WIDE",
                 "w": "STAGE1_NUM_WARPS", "s": "STAGE1_NUM_STAGES_WIDE", "ppsm": "PROGRAMS_PER_SM",
                 "wppsm": "WIDE_PROGRAMS_PER_SM", "swapmax": "SWAP_AB_MAX_BS",
                 "ss": "STAGE1_NUM_STAGES_SWAP", "sbn": "SMALL_BS_BLOCK_N_WIDE",
                 "sss": "SMALL_BS_NUM_STAGES", "sbs": "SMALL_BS_MAX"}


def _apply_variant(spec: str) -> int | None:
    """Set the decode_attention module knobs named in `spec` ("key=value,..."); returns the fixed
    split count when the spec has `splits=N`, else None.
    Raises:
        SystemExit: an unknown key."""
    splits = None
    for item in spec.split(","):
        key, _, value = item.partition("=")
        if key == "splits":
            splits = int(value)
        elif key == "fp8wide":  # FP8 pools take the wide plan (and transposed path) too
            da._FP8_DTYPES = () if int(value) else (torch.float8_e4m3fn, torch.float8_e5m2)
        elif key in _VARIANT_KEYS:
            name = _VARIANT_KEYS[key]
            setattr(da, name, bool(int(value)) if key in ("swap", "reuse") else int(value))
        else:
            raise SystemExit(f"--variants: unknown key {key!r} in {spec!r}")
    return splits


def run_configs(args, sm_count: int, bw_copy: float, warmup: int, rep: int, prefix: str,
                fixed_splits: int | None) -> None:
    """Check and time every (layout, bs, ctx) of args with the module's current knobs."""
    flush = make_flush(args.flush)
    for layout in args.layouts:
        for bs in args.batch_sizes:
            for ctx in args.contexts:
                tokens = bs * ctx
                pool = pool_bytes(layout, tokens) // (2 if args.kv_dtype != "auto" else 1)
                h, _, _, lv, _ = LAYOUTS[layout]
                work = bs * h * args.max_kv_splits * lv * 4
                if (pool + work) / GB > args.mem_cap_gb:
                    print(f"{prefix}| {layout} | {bs} | {ctx} | skipped: pool {pool / GB:.1f} GB "
                          f"over the cap | | | | | | | |")
                    continue
                # the torch reference gathers a second copy of K/V (plus SDPA temporaries)
                time_torch = not args.no_torch and (2.2 * pool + work) / GB <= args.mem_cap_gb
                cfg = Config(layout, bs, ctx, args.max_kv_splits, sm_count,
                             fixed_splits=fixed_splits, kv_dtype=_KV_DTYPES[args.kv_dtype])
                err = cfg.max_abs_err()
                splits = cfg.num_kv_splits[0].item()
                ms = graph_time_ms(cfg.run_kernel, flush)
                gbs = cfg.bytes_moved() / (ms * 1e-3) / GB
                if time_torch:
                    ref_err = (cfg.torch_ref().float() - cfg.o.float()).abs().max().item()
                    if not math.isfinite(ref_err) or ref_err > 0.1:
                        print(f"<!-- warning: torch ref vs kernel max err {ref_err:.3g} -->")
                    ms_t = triton.testing.do_bench(cfg.torch_ref, warmup=warmup, rep=rep,
                                                   return_mode="median")
                    torch_cols = (f"{ms_t * 1e3:.1f} | {cfg.bytes_moved() / (ms_t * 1e-3) / GB:.0f}"
                                  f" | {ms_t / ms:.1f}x")
                else:
                    torch_cols = "- | - | -"
                print(f"{prefix}| {layout} | {bs} | {ctx} | {splits} | {err:.2e} | "
                      f"{ms * 1e3:.1f} | "
                      f"{gbs:.0f} | {100 * gbs / bw_copy:.0f}% | {torch_cols} |", flush=True)
                del cfg
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
