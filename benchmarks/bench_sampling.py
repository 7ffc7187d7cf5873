"""Greedy sampling on a CUDA GPU: torch's passes against the one-pass triton kernel, per batch size.

What the sampler (`mla_backend.model_executor.sampler.Sampler.launch`) queues for an all-greedy
batch of unprocessed fp32 logits [bs, V]: either torch's argmax, logsumexp and a gather (about
six passes over the logits), or `mla_kernels.sampling.greedy_with_logprob` (one pass: one
program per row, or below `SPLIT_MAX_ROWS` rows several programs per row and a combine), the
latter on CUDA. This script times torch, the kernel with one program per row, its default plan
and (`--splits`) given numbers of programs per row, as CUDA graph replays (median of
`triton.testing.do_bench`, µs) at each `--bs`, on random normal logits of `--vocab` columns
(DeepSeek-V2's 102,400 by default), checks that torch and the kernel pick the same tokens, and
prints the table the thresholds are chosen from.

    PYTHONPATH=. python3 benchmarks/bench_sampling.py [--bs 1 8 32 64 128 256 512] [--vocab 102400]
        [--splits 2 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fused_moe import bench, graph_of  # noqa: E402
from bench_suite import table  # noqa: E402
from mla_kernels.sampling import greedy_with_logprob, num_splits  # noqa: E402


def torch_greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's torch branch for all-greedy rows: (argmax int64 [bs], its logprob fp32)."""
    next_ids = logits.argmax(dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    return next_ids, logits.gather(1, next_ids.unsqueeze(1)).squeeze(1) - lse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 8, 32, 64, 96, 128, 192, 256, 512])
    ap.add_argument("--vocab", type=int, default=102400)
    ap.add_argument("--rep", type=int, default=200, help="do_bench milliseconds per timing")
    ap.add_argument("--splits", type=int, nargs="*", default=[],
                    help="also time the kernel with these programs per row (powers of two)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_sampling.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for bs in args.bs:
        logits = torch.randn(bs, args.vocab, device="cuda", generator=torch.Generator(
            "cuda").manual_seed(bs))
        ids_t, lp_t = torch_greedy(logits)
        ids_f, lp_f, _ = greedy_with_logprob(logits)
        same = bool(torch.equal(ids_t, ids_f))
        lp_err = float((lp_t - lp_f).abs().max())
        splits = num_splits(bs, args.vocab)
        us_t, us_1, us_f, *us_s = [
            1000 * bench(graph_of(fn).replay, 25, args.rep)
            for fn in [lambda: torch_greedy(logits), lambda: greedy_with_logprob(logits, 1),
                       lambda: greedy_with_logprob(logits)]
            + [lambda n=n: greedy_with_logprob(logits, n) for n in args.splits]]
        gbs = logits.numel() * 4 / (us_f * 1e3)
        rows.append([bs, us_t, us_1, splits, us_f, *us_s, us_t / us_f, gbs,
                     "yes" if same else "NO", lp_err])
    table(f"Greedy sampling, V {args.vocab:,} fp32, graph replay µs",
          ["bs", "torch argmax+logsumexp µs", "kernel, one program per row µs",
           "splits per row (default plan)", "kernel, default plan µs"]
          + [f"kernel, {n} splits µs" for n in args.splits]
          + ["torch / kernel", "kernel GB/s", "same tokens", "max |logprob diff|"], rows)
    return 0 if all(r[-2] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
