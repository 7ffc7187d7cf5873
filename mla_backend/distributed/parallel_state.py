"""The tensor-parallel (TP) group: the one piece of process-wide state of the engine.

Owns: this process's TP rank and size, and the `torch.distributed` process group they live in.
Set by `init_tensor_parallel` (called once per rank process, by whoever starts the ranks: a test
harness, a launcher, later the Triton adapter) before any model is built; read by the TP layers
(`layers/linear.py`, `layers/logits.py`, `layers/moe.py`) when they size their weight shards, and by
`model_executor.ModelRunner` to check the config. The collectives below are what those layers call
in their forward.

Not initialized (the default) means rank 0 of size 1: every helper then degrades to the
single-process behaviour (no communication, `divide(n, 1) == n`), so single-process code needs no
changes. The group is the whole world: one TP group per job (no pipeline/data parallelism yet).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

# Module state (written only by init_tensor_parallel / destroy_tensor_parallel).
_TP_RANK: int = 0
_TP_SIZE: int = 1
_INITIALIZED: bool = False
_OWNS_PROCESS_GROUP: bool = False  # we called init_process_group (so destroy tears it down)


def divide(numerator: int, denominator: int, what: str | None = None) -> int:
    """numerator // denominator, when it divides exactly.

    Args:
        numerator, denominator: ints (e.g. a head count and the TP size); denominator >= 1.
        what: optional name of the numerator for the message (e.g. "num_attention_heads").
    Returns:
        numerator // denominator.
    Raises:
        ValueError: denominator < 1, or it does not divide numerator, e.g.
            "tensor parallel size 3 does not divide num_attention_heads=8".
    """
    name = what or "value"
    if denominator < 1:
        raise ValueError(f"cannot split {name}={numerator} into {denominator} parts")
    if numerator % denominator != 0:
        raise ValueError(
            f"tensor parallel size {denominator} does not divide {name}={numerator} "
            f"(remainder {numerator % denominator})")
    return numerator // denominator


def _pick_backend(device: torch.device | str | None) -> str:
    if device is not None:
        return "nccl" if torch.device(device).type == "cuda" else "gloo"
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_tensor_parallel(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str | None = None,
    device: torch.device | str | None = None,
    timeout: timedelta | None = None,
) -> None:
    """Join the TP group as `rank` of `world_size`. Call once in every rank process.

    Args:
        rank: this process's rank, 0 <= rank < world_size.
        world_size: TP degree (number of rank processes).
        init_method: rendezvous URL shared by all ranks, e.g. "tcp://127.0.0.1:<free port>" or
            "file:///<tmp dir>/tp_init" (the file must not exist yet). Ignored when world_size == 1.
        backend: "nccl" or "gloo"; None picks from `device` ("nccl" for a CUDA device, else
            "gloo"), or, with device None too, "nccl" iff CUDA is available.
        device: the device the layers' tensors will live on; a CUDA device with an index is made
            the current device (`torch.cuda.set_device`) before the group is created.
        timeout: collective/rendezvous timeout (torch's default when None).

    world_size == 1 creates no process group (there is nothing to communicate); the state is just
    recorded. Calling again with the same rank and size is a no-op. If torch.distributed was
    already initialized by the caller, that group is adopted when its rank and size match.

    Raises:
        ValueError: world_size < 1 or rank out of range.
        RuntimeError: already initialized with a different rank or size (call
            `destroy_tensor_parallel` first), or an existing torch.distributed group that does not
            match.
    """
    global _TP_RANK, _TP_SIZE, _INITIALIZED, _OWNS_PROCESS_GROUP
    if world_size < 1:
        raise ValueError(f"tensor parallel world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"tensor parallel rank {rank} out of range for world_size {world_size}")
    if _INITIALIZED:
        if (_TP_RANK, _TP_SIZE) == (rank, world_size):
            return
        raise RuntimeError(
            f"tensor parallel already initialized as rank {_TP_RANK} of {_TP_SIZE}; cannot "
            f"re-initialize as rank {rank} of {world_size} (call destroy_tensor_parallel first)")
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is not None:
            torch.cuda.set_device(dev)
    owns = False
    if dist.is_available() and dist.is_initialized():
        have = (dist.get_rank(), dist.get_world_size())
        if have != (rank, world_size):
            raise RuntimeError(
                f"torch.distributed is already initialized as rank {have[0]} of {have[1]}, "
                f"which does not match the requested tensor parallel rank {rank} of {world_size}")
    elif world_size > 1:
        if not dist.is_available():
            raise RuntimeError("torch.distributed is not available in this torch build")
        kwargs = {} if timeout is None else {"timeout": timeout}
        chosen = backend or _pick_backend(device)
        dist.init_process_group(backend=chosen, init_method=init_method,
                                rank=rank, world_size=world_size, **kwargs)
        owns = True
        if chosen == "nccl":
            # NCCL builds its communicator at the first collective. Do that now, outside any
            # CUDA-graph capture (capturing a collective on an unbuilt communicator fails).
            warm = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(warm)
            torch.cuda.synchronize()
    _TP_RANK, _TP_SIZE, _INITIALIZED, _OWNS_PROCESS_GROUP = rank, world_size, True, owns


def destroy_tensor_parallel() -> None:
    """Leave the TP group (destroys the process group if `init_tensor_parallel` created it) and
    return to the uninitialized state (rank 0 of 1). Safe to call when not initialized."""
    global _TP_RANK, _TP_SIZE, _INITIALIZED, _OWNS_PROCESS_GROUP
    if _OWNS_PROCESS_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE, _INITIALIZED, _OWNS_PROCESS_GROUP = 0, 1, False, False


def is_tensor_parallel_initialized() -> bool:
    """True between `init_tensor_parallel` and `destroy_tensor_parallel`."""
    return _INITIALIZED


def get_tp_rank() -> int:
    """This process's TP rank (0 when not initialized)."""
    return _TP_RANK


def get_tp_size() -> int:
    """The TP degree (1 when not initialized)."""
    return _TP_SIZE


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP ranks, in place.

    Args:
        x: any shape/dtype, same on every rank, on the backend's device (CPU for gloo, CUDA for
            nccl).
    Returns:
        `x` itself, now holding the sum (a non-contiguous `x` is reduced through a contiguous
        copy and written back). No-op at TP size 1.
    """
    if _TP_SIZE == 1:
        return x
    if x.is_contiguous():
        dist.all_reduce(x)
        return x
    buf = x.contiguous()
    dist.all_reduce(buf)
    return x.copy_(buf)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order.

    Args:
        x: this rank's part, [..., n, ...]; same shape and dtype on every rank.
        dim: the dimension to concatenate along (negative counts from the end).
    Returns:
        A new tensor [..., tp_size * n, ...] (rank r's part at [r*n, (r+1)*n) of `dim`); `x`
        itself at TP size 1.
    """
    if _TP_SIZE == 1:
        return x
    dim = dim % x.dim()
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
