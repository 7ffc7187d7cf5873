"""Does an index upload wait for the GPU? Host time of `host_tensors.int64_on` while the stream is
busy, from pageable memory (what the engine does) and staged through pinned memory (GPU only).

The engine uploads each step's index lists with `int64_tensor(values).to(device,
non_blocking=True)` from pageable memory. CUDA documents async copies from pageable memory as
"might be synchronous with respect to the host". If a large one (a prefill's tens of thousands of
ints) waits until the kernels queued before it have run, the overlap schedule loses that step's
host/GPU overlap, and the wait shows up as host time, not as GPU wait. Per size, with the stream
held busy by a `torch.cuda._sleep` kernel of `--busy-ms`: the host time of the upload call
(median of `--repeats`), for the pageable path and for a copy into a pinned tensor from
PyTorch's caching host allocator followed by the same non-blocking upload. A pageable time near
`--busy-ms` means the upload waited for the GPU.

    PYTHONPATH=. python3 benchmarks/bench_h2d_upload.py [--busy-ms 20] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_suite import table  # noqa: E402

from mla_backend.host_tensors import int64_on, int64_tensor  # noqa: E402

# ints per upload (3 per token + 2 per request): decodes at bs 64 and 1,024, prefills of 6,800
# tokens over 20 requests and of 13,300 tokens over 40
SIZES = (320, 5_120, 20_440, 40_000)


def _pinned_upload(values: list[int], device: torch.device) -> torch.Tensor:
    host = int64_tensor(values)
    pinned = torch.empty(host.shape, dtype=torch.int64, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(device, non_blocking=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--busy-ms", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_h2d_upload: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    # cycles of `_sleep` per ms, measured
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles = int(10_000_000 * args.busy_ms / start.elapsed_time(end))
    rows = []
    for n in SIZES:
        values = list(range(n))
        spent: dict[str, list[float]] = {"pageable": [], "pinned": []}
        for _ in range(args.repeats):
            for name, upload in (("pageable", int64_on), ("pinned", _pinned_upload)):
                torch.cuda.synchronize()
                torch.cuda._sleep(cycles)  # the stream is busy for ~busy_ms from here
                t = time.perf_counter()
                out = upload(values, device)
                spent[name].append(time.perf_counter() - t)
                torch.cuda.synchronize()
                assert int(out[-1]) == n - 1
        rows.append([f"{n:,}", f"{8 * n / 1024:.1f}",
                     f"{1e3 * statistics.median(spent['pageable']):.3f}",
                     f"{1e3 * statistics.median(spent['pinned']):.3f}"])
    table(f"Host time of one index upload while the GPU is busy for {args.busy_ms:g} ms (ms)",
          ["ints", "KiB", "pageable (int64_on)", "through pinned memory"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
