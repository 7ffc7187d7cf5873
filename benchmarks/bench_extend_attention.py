"""Extend (prefill) attention throughput on a CUDA GPU: our triton kernel vs torch SDPA, bf16.

For each layout (MHA Llama-8B-like 32/8 heads × 128; MLA decompressed 16 heads, qk 192 / v 128,
no prefix; MLA absorbed 16 heads, qk 576 / v 512 = view of the key, one KV head) and each shape
(bs 1 × 2048 and bs 1 × 8192 new tokens without prefix; bs 4 × 2048 new tokens over a 2048-token
cached prefix) it first checks the kernel against an fp32 torch reference on the first 128 and
last 256 query rows of every request (exits 1 on a mismatch), then times it.

FLOPs count only the causal (visible) query-key pairs: per request and head,
pairs = extend · prefix + extend · (extend + 1) / 2, FLOPs = 2 · pairs · (Lq + Lv).
SDPA gets the same data with K/V already gathered into contiguous [bs, H, prefix + extend, D]
tensors (KV heads pre-expanded for GQA/MQA; gather time not counted — an advantage to SDPA) and a
lower-right causal mask; its backend is torch's choice.

    PYTHONPATH=. python3 benchmarks/bench_extend_attention.py [--quick] [--iters N]
    PYTHONPATH=. python3 benchmarks/bench_extend_attention.py --kv-dtype fp8_e4m3 \
        [--fp8-block-m 16]

`--kv-dtype fp8_e4m3 / fp8_e5m2`: the cached prefix is read from an FP8 pool (the bf16 values
cast, scale 1; the reference and SDPA get those values rounded through FP8, the new tokens
unrounded, as the kernel sees them); `--fp8-block-m` sets `extend_attention.
FP8_POOL_WIDE_BLOCK_M` (the absorbed layout's query block over an FP8 pool).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

DEVICE = "cuda"  # module-level so the set-up / check / SDPA code can be smoke-tested elsewhere


@dataclass(frozen=True)
class Layout:
    name: str
    heads: int
    kv_heads: int
    lq: int
    lv: int
    mla_absorbed: bool = False  # v = first lv columns of the key rows
    prefix_ok: bool = True  # decompressed MLA prefill only runs without a cached prefix
    sm_scale: float = 0.0

    def scale(self) -> float:
        return self.sm_scale or self.lq ** -0.5


LAYOUTS = [
    Layout("mha-llama8b 32/8x128", 32, 8, 128, 128),
    Layout("mla-decompressed 16x192/128", 16, 16, 192, 128, prefix_ok=False, sm_scale=0.1147),
    Layout("mla-absorbed 16x576/512", 16, 1, 576, 512, mla_absorbed=True, sm_scale=0.1147),
]
SHAPES = [(1, 0, 2048), (1, 0, 8192), (4, 2048, 2048)]  # (bs, prefix, extend)
QUICK_SHAPES = [(1, 0, 2048), (2, 1024, 1024)]


def causal_flops(bs: int, prefix: int, extend: int, lay: Layout) -> float:
    pairs = extend * prefix + extend * (extend + 1) / 2
    return 2.0 * bs * lay.heads * pairs * (lay.lq + lay.lv)


def make_batch(lay: Layout, bs: int, prefix: int, extend: int, seed: int = 0) -> dict:
    """bf16 CUDA batch; the new tokens' KV written to the pool (random permuted slots)."""
    dev, dt = DEVICE, torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed)
    total = bs * (prefix + extend)
    t = bs * extend
    k_buffer = torch.randn(total + 1, lay.kv_heads, lay.lq, device=dev, dtype=dt, generator=g)
    v_buffer = (k_buffer[..., :lay.lv] if lay.mla_absorbed else
                torch.randn(total + 1, lay.kv_heads, lay.lv, device=dev, dtype=dt, generator=g))
    slots = torch.randperm(total, device=dev, generator=g) + 1
    req_to_token = slots.view(bs, prefix + extend).to(torch.int32).contiguous()
    q = torch.randn(t, lay.heads, lay.lq, device=dev, dtype=dt, generator=g)
    k = torch.randn(t, lay.kv_heads, lay.lq, device=dev, dtype=dt, generator=g)
    v = (k[..., :lay.lv] if lay.mla_absorbed else
         torch.randn(t, lay.kv_heads, lay.lv, device=dev, dtype=dt, generator=g))
    new_slots = req_to_token[:, prefix:].reshape(-1).long()
    k_buffer[new_slots] = k
    if not lay.mla_absorbed:
        v_buffer[new_slots] = v
    ar = torch.arange(bs, device=dev)
    return dict(q=q, k=k, v=v, k_buffer=k_buffer, v_buffer=v_buffer, req_to_token=req_to_token,
                rows=ar.to(torch.int64), prefix=torch.full((bs,), prefix, device=dev),
                extend=torch.full((bs,), extend, device=dev), starts=ar * extend,
                o=torch.empty(t, lay.heads, lay.lv, device=dev, dtype=dt),
                bs=bs, prefix_len=prefix, extend_len=extend)


def to_fp8_pool(b: dict, lay: Layout, dtype: torch.dtype) -> None:
    """Replace the batch's pool by an FP8 one (`dtype`, scale 1); `k_ref` / `v_ref` keep the
    values the kernel sees (prefix rows rounded through FP8, the new tokens' rows as given) for
    the reference and SDPA."""
    new_slots = b["req_to_token"][:, b["prefix_len"]:].reshape(-1).long()
    k8 = b["k_buffer"].to(dtype)
    b["k_ref"] = k8.to(torch.bfloat16)
    b["k_ref"][new_slots] = b["k"]
    if lay.mla_absorbed:
        v8, b["v_ref"] = k8[..., :lay.lv], b["k_ref"][..., :lay.lv]
    else:
        v8 = b["v_buffer"].to(dtype)
        b["v_ref"] = v8.to(torch.bfloat16)
        b["v_ref"][new_slots] = b["v"]
    b["k_buffer"], b["v_buffer"] = k8, v8


def run_kernel(b: dict, lay: Layout) -> None:
    from mla_kernels.extend_attention import extend_attention_fwd

    pool_free = b["prefix_len"] == 0 and not lay.prefix_ok
    extend_attention_fwd(b["q"], b["k"], b["v"], b["o"],
                         None if pool_free else b["k_buffer"], None if pool_free else b["v_buffer"],
                         b["req_to_token"], b["rows"], b["prefix"], b["extend"], b["starts"],
                         b["extend_len"], lay.scale())


def gathered_kv(b: dict, lay: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """[bs, Hkv, prefix + extend, D] keys / values of every request, in position order."""
    idx = b["req_to_token"].long()
    k_pool, v_pool = b.get("k_ref", b["k_buffer"]), b.get("v_ref", b["v_buffer"])
    return (k_pool[idx].transpose(1, 2).contiguous(), v_pool[idx].transpose(1, 2).contiguous())


def check(b: dict, lay: Layout) -> float:
    """Max abs error of the kernel vs an fp32 reference on the first 128 / last 256 rows."""
    run_kernel(b, lay)
    k_all, v_all = gathered_kv(b, lay)
    group = lay.heads // lay.kv_heads
    p, e = b["prefix_len"], b["extend_len"]
    worst = 0.0
    for i in range(b["bs"]):
        kf = k_all[i].float().repeat_interleave(group, 0)  # [H, n, Dk]
        vf = v_all[i].float().repeat_interleave(group, 0)
        for lo, hi in ((0, min(128, e)), (max(0, e - 256), e)):
            qf = b["q"][i * e + lo:i * e + hi].float().transpose(0, 1)  # [H, m, Dk]
            s = torch.einsum("hmd,hnd->hmn", qf, kf) * lay.scale()
            q_pos = torch.arange(lo, hi, device=DEVICE)[:, None] + p
            s = s.masked_fill(torch.arange(p + e, device=DEVICE)[None, :] > q_pos, float("-inf"))
            ref = torch.einsum("hmn,hnd->mhd", torch.softmax(s, -1), vf)
            out = b["o"][i * e + lo:i * e + hi].float()
            err = (out - ref).abs().max().item()
            if not torch.allclose(out, ref, atol=2e-2, rtol=2e-2):
                raise AssertionError(f"{lay.name} bs{b['bs']} p{p} e{e} request {i} rows "
                                     f"{lo}:{hi}: max abs error {err:.3g}")
            worst = max(worst, err)
    return worst


def sdpa_fn(b: dict, lay: Layout):
    """A closure running SDPA on pre-gathered [bs, H, n, D] data, plus its output [T, H, Lv]."""
    from torch.nn.attention.bias import causal_lower_right

    k_all, v_all = gathered_kv(b, lay)
    group = lay.heads // lay.kv_heads
    k_all = k_all.repeat_interleave(group, 1)
    v_all = v_all.repeat_interleave(group, 1)
    bs, e, h = b["bs"], b["extend_len"], lay.heads
    q = b["q"].view(bs, e, h, lay.lq).transpose(1, 2).contiguous()
    n = b["prefix_len"] + e
    mask = causal_lower_right(e, n) if b["prefix_len"] else None

    def fn() -> torch.Tensor:
        if mask is None:
            return torch.nn.functional.scaled_dot_product_attention(
                q, k_all, v_all, is_causal=True, scale=lay.scale())
        return torch.nn.functional.scaled_dot_product_attention(
            q, k_all, v_all, attn_mask=mask, scale=lay.scale())

    return fn


def time_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("--quick", action="store_true",
                    help="short shapes only (bs 1 × 2048; bs 2 × 1024 over a 1024 prefix)")
    ap.add_argument("--iters", type=int, default=20, help="timed iterations per measurement")
    ap.add_argument("--no-sdpa", action="store_true", help="skip the torch SDPA comparison")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"],
                    help="pool dtype of the cached prefix (shapes with a prefix only)")
    ap.add_argument("--fp8-block-m", type=int, default=None,
                    help="extend_attention.FP8_POOL_WIDE_BLOCK_M for this run")
    args = ap.parse_args(argv)
    kv_dtype = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2}[args.kv_dtype]
    if args.fp8_block_m is not None:
        import mla_kernels.extend_attention as ea

        ea.FP8_POOL_WIDE_BLOCK_M = args.fp8_block_m
    if not torch.cuda.is_available():
        print("bench_extend_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = QUICK_SHAPES if args.quick else SHAPES
    iters = max(1, args.iters // 4) if args.quick else args.iters
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {__import__('triton').__version__}  bf16, {iters} iters; prefix pool "
          f"{args.kv_dtype}, FP8 wide BLOCK_M {args.fp8_block_m or 'default'}")
    hdr = (f"{'layout':30s} {'bs':>3s} {'prefix':>6s} {'extend':>6s} {'err':>8s} "
           f"{'ours ms':>9s} {'TFLOP/s':>8s} {'sdpa ms':>9s} {'TFLOP/s':>8s} {'|ours-sdpa|':>11s}")
    print(hdr)
    print("-" * len(hdr))
    for lay in LAYOUTS:
        for bs, prefix, extend in shapes:
            if (prefix and not lay.prefix_ok) or (kv_dtype is not None and not prefix):
                continue
            b = make_batch(lay, bs, prefix, extend)
            if kv_dtype is not None:
                to_fp8_pool(b, lay, kv_dtype)
            try:
                err = check(b, lay)
            except AssertionError as exc:
                print(f"CORRECTNESS FAILURE: {exc}", file=sys.stderr)
                return 1
            flops = causal_flops(bs, prefix, extend, lay)
            ms = time_ms(lambda: run_kernel(b, lay), iters)
            line = (f"{lay.name:30s} {bs:3d} {prefix:6d} {extend:6d} {err:8.2e} "
                    f"{ms:9.3f} {flops / ms / 1e9:8.1f}")
            if not args.no_sdpa:
                try:
                    fn = sdpa_fn(b, lay)
                    sms = time_ms(fn, iters)
                    ref = fn().transpose(1, 2).reshape(b["o"].shape)
                    diff = (ref.float() - b["o"].float()).abs().max().item()
                    line += f" {sms:9.3f} {flops / sms / 1e9:8.1f} {diff:11.2e}"
                except Exception as exc:  # a backend may reject a shape: report, keep going
                    line += f"  sdpa n/a ({type(exc).__name__}: {str(exc)[:60]})"
            print(line, flush=True)
            del b
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
