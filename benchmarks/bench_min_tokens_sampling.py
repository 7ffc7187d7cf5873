"""Greedy rows under `min_tokens` on a CUDA GPU: the host and device cost of excluding their EOS
and stop ids from the argmax, two ways, per batch size.

Every request of a genai-perf-style load (and of `bench_profile.py --min-tokens`) sets
`min_tokens` = `max_tokens`, so at a throughput peak every decode step samples every row under
a ban (`mla_backend.model_executor.sampler.min_tokens_bans`). This script times, on random bf16
logits [bs, `--vocab`] (DeepSeek-V2's 102,400 by default) with every row banned from the EOS
id:
- `write back`: `_greedy_with_bans` (-inf written at the banned ids, the one-pass greedy
  kernel, the saved logits written back, each row's logsumexp combined with theirs), the
  sampler's path while rows also carry grammar masks;
- `bitmask`: `Sampler._ban_masks` and the kernel's own mask (one upload, one launch), the path
  of rows without grammar masks.
Per call: the host's time to queue the work (mean µs, no wait) and the time between CUDA
events recorded before and after the call (mean µs: the device's work, or the queueing where
that is longer), over `--iters` calls after a warm-up; both ways must give the same tokens.

    PYTHONPATH=. python3 benchmarks/bench_min_tokens_sampling.py [--bs 64 512 1024]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_suite import table  # noqa: E402
from mla_backend.model_executor.sampler import (  # noqa: E402
    Sampler, _greedy_with_bans, min_tokens_bans)
from mla_backend.request import Req, SamplingParams  # noqa: E402
from mla_kernels.sampling import greedy_with_logprob  # noqa: E402


def timed(fn, iters: int) -> tuple[float, float, tuple]:
    """(host µs per call, µs between the events around it, the last call's result)."""
    for _ in range(5):
        out = fn()
    torch.cuda.synchronize()
    host = 0.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    device = 0.0
    for _ in range(iters):
        start.record()
        t0 = time.perf_counter()
        out = fn()
        host += time.perf_counter() - t0
        end.record()
        end.synchronize()
        device += start.elapsed_time(end) * 1e3
    return host / iters * 1e6, device / iters, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bs", type=int, nargs="+", default=[64, 512, 1024])
    ap.add_argument("--vocab", type=int, default=102400)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_min_tokens_sampling: needs a CUDA GPU", file=sys.stderr)
        return 2
    eos = 1
    sampler = Sampler({eos}, args.vocab, "cuda")
    rows = []
    for bs in args.bs:
        reqs = [Req(rid=str(i), origin_input_ids=[2], sampling_params=SamplingParams(
            temperature=0.0, max_new_tokens=64, min_new_tokens=64)) for i in range(bs)]
        logits = torch.randn(bs, args.vocab, device="cuda").to(torch.bfloat16)
        logits[:, eos] = 30.0  # the banned id is every row's raw argmax

        def write_back():
            bans = min_tokens_bans(reqs, sampler.eos_token_ids, args.vocab)
            return _greedy_with_bans(logits, bans, greedy_with_logprob)

        def bitmask():
            bans = min_tokens_bans(reqs, sampler.eos_token_ids, args.vocab)
            mask, mask_rows = sampler._ban_masks(bans, bs)
            return greedy_with_logprob(logits, bitmask=mask, mask_rows=mask_rows)

        h_old, d_old, out_old = timed(write_back, args.iters)
        h_new, d_new, out_new = timed(bitmask, args.iters)
        same = torch.equal(out_old[0], out_new[0]) and not bool((out_new[0] == eos).any())
        lp = (out_old[1] - out_new[1]).abs().max().item()
        rows.append([bs, f"{h_old:.0f}", f"{d_old:.0f}", f"{h_new:.0f}", f"{d_new:.0f}",
                     "yes" if same else "NO", f"{lp:.1e}"])
    table(f"Greedy under min_tokens, {torch.cuda.get_device_name()}, vocab {args.vocab:,}, "
          f"bf16 logits, {args.iters} calls",
          ["bs", "write back host µs", "write back events µs", "bitmask host µs",
           "bitmask events µs", "same tokens", "max |logprob diff|"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
