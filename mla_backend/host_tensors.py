"""Host-side int64 tensors from Python int lists, fast: the per-step index lists the scheduler
builds (token ids, positions, slots, rows, lengths: one entry per request or token) become CPU
tensors here before their one copy to the device (`int64_on`).

`torch.tensor(list)` parses a list element by element through its generic sequence path;
packing the list with `array.array` and wrapping its buffer (`torch.frombuffer`, no copy) was
~3.5x faster in a one-off timing on the CPU machine (not kept as a benchmark; its share shows
in `benchmarks/bench_host_step.py`'s "forward batch" column). Used by
`ModelRunner.make_forward_batch`, `ReqToTokenPool.write_positions`, `ForwardBatch` and the
engine's step. `neg_inf_like` is the device-side value of the masking writes of the sampler and
the grammar masks, for the same reason.
"""

from __future__ import annotations

import array
from typing import Iterable

import torch


def int64_tensor(values: Iterable[int]) -> torch.Tensor:
    """A 1-D CPU int64 tensor of `values` (Python ints or objects with `__index__`), owning
    its memory (the array it wraps stays alive with the tensor).

    Raises:
        OverflowError: a value outside the int64 range.
        TypeError: a value that is not an integer.
    """
    buf = array.array("q", values)
    if not buf:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(buf, dtype=torch.int64)


def int64_on(values: Iterable[int], device: torch.device | str) -> torch.Tensor:
    """`int64_tensor(values)` on `device`, copied without waiting for the work queued there: a
    pageable source is staged at once, so the host can go on queueing while the device runs
    (the engine's overlap schedule). `torch.tensor(values, device=)` and list indexing of a
    device tensor instead block until the device has run everything queued before them.

    Raises:
        as `int64_tensor`.
    """
    return int64_tensor(values).to(device, non_blocking=True)


def neg_inf_like(t: torch.Tensor) -> torch.Tensor:
    """-inf as a 0-d tensor on `t`'s device and dtype: the value of an indexed write into `t`
    (`t[rows, cols] = neg_inf_like(t)`). A Python float there becomes a CPU tensor that the
    write copies to the device, waiting for the work queued there."""
    return torch.full((), float("-inf"), dtype=t.dtype, device=t.device)


def segment_aranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[sum(lengths)] int64: starts[i], starts[i] + 1, ..., starts[i] + lengths[i] - 1, for each
    i in order (`starts`, `lengths`: [k] int64 CPU tensors, lengths >= 0)."""
    total = int(lengths.sum())
    first = torch.cumsum(lengths, 0) - lengths  # each segment's offset in the output
    return torch.arange(total) + torch.repeat_interleave(starts - first, lengths, output_size=total)
