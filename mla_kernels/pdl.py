"""Programmatic dependent launch (PDL) for the decode-path kernels: when to use it and how.

Owns the switch (`ENABLED`, environment variable `MLA_PDL`, default on), the per-device check
`use_pdl` and the in-kernel helpers `pdl_trigger` / `pdl_wait`. Nothing here touches data.

PDL (CUDA programming guide, "Programmatic Dependent Launch and Synchronization"; PTX
`griddepcontrol`; sm_90 and later): a kernel launched with triton's `launch_pdl=True` may start
before the kernel in front of it has finished, once every program of that kernel has run
`griddepcontrol.launch_dependents` (`pdl_trigger`) or exited. Its `griddepcontrol.wait`
(`pdl_wait`) returns once the kernel in front has completed and its memory is visible. CUDA
graphs keep these edges. At batch size 1 a decode step is hundreds of short dependent kernels,
so overlapping each kernel's start (and a static weight's read) with its predecessor's tail pays.

The contract every kernel here follows when launched with PDL: `pdl_trigger` first, then only
reads of buffers no kernel writes during a forward (weights), then `pdl_wait` on *every* path
through the program (early returns too: a kernel that never waits lets its successor run ahead
of its predecessor), and only then other loads and any store. Kernels launched without PDL skip
both helpers (USE_PDL=False), as do the interpreter (TRITON_INTERPRET) and pre-Hopper devices.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# `MLA_PDL=0` turns PDL off for every kernel (A/B runs, debugging).
ENABLED = os.environ.get("MLA_PDL", "1").strip().lower() not in ("0", "false", "no", "off")
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_CAPABLE: dict[int, bool] = {}


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels launched on t's device use PDL: `ENABLED`, a CUDA tensor, compute
    capability >= 9.0 and not the triton interpreter. Cached per device index."""
    if not ENABLED or _INTERPRET or t.device.type != "cuda":
        return False
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    ok = _CAPABLE.get(idx)
    if ok is None:
        ok = _CAPABLE[idx] = torch.cuda.get_device_capability(idx) >= (9, 0)
    return ok


@contextmanager
def override(on: bool):
    """Within the block PDL is on only if `on` and `ENABLED` was (A/B runs: benchmarks turn it
    off for kernels launched and graphs captured inside); `ENABLED` is restored after."""
    global ENABLED
    before = ENABLED
    ENABLED = before and on
    try:
        yield
    finally:
        ENABLED = before


def launch_options(enabled: bool) -> dict:
    """The keyword arguments of a launch with (or without) PDL: the kernel's `USE_PDL`
    constexpr and, when enabled, triton's `launch_pdl` launch option."""
    return {"USE_PDL": True, "launch_pdl": True} if enabled else {"USE_PDL": False}


@triton.jit
def pdl_trigger(USE_PDL: tl.constexpr):
    """Let the next kernel on the stream launch (no effect when USE_PDL is False)."""
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """`pdl_trigger` then `pdl_wait`: the start of a kernel that reads nothing before the wait."""
    pdl_trigger(USE_PDL)
    pdl_wait(USE_PDL)


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the kernel in front has completed and its writes are visible (no effect when
    USE_PDL is False)."""
    if USE_PDL:
        gdc_wait()


__all__ = ["ENABLED", "launch_options", "override", "pdl_enter", "pdl_trigger", "pdl_wait",
           "use_pdl"]
