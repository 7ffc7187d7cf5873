"""Two-level KV memory: request rows → token slots → per-layer KV storage.

Owns:
- `ReqToTokenPool`: `req_to_token[row, position] -> slot` (int32, model device) plus the host copy
  `req_to_token_host`; rows are one per running request. Writes (`write_row`, `write_positions`)
  update both copies; `read_row` reads the host copy, so the host never waits on the device.
  With `track_writes()` (a tensor-parallel rank 0) the pool also records which cells every write
  touched, and `take_writes()` hands them over with their current values, for the workers' tables.
- `TokenToKVPoolAllocator`: CPU free list of slots 1..size. Slot 0 is a reserved sink (padded
  CUDA-graph rows write there) and is never handed out.
- `MHATokenToKVPool` (per layer K and V per KV head) and `MLATokenToKVPool` (per layer one latent
  `c_KV ‖ k_pe` vector per slot; the value buffer is a view of the latent part), written through
  `set_kv_buffer` and read by the attention backends.
Sizes come from the model runner (`CacheConfig` and device memory).

FP8 KV cache (`kv_cache_dtype` "fp8_e4m3" / "fp8_e5m2") is a pool property only: the scheduler and
prefix cache see slot indices. Storage is float8_e4m3fn / float8_e5m2 with one per-tensor scale
per layer for K and one for V (MLA: one for the whole latent ‖ rope row); vLLM/SGLang convention:
write fp8(clamp(x / scale, -max, max)), max 448 (e4m3) / 57344 (e5m2), saturating (no inf/NaN);
read fp8 * scale (`gather_kv`), or the triton kernels fold `k_scale` / `v_scale` into q·k and p·v.
A non-FP8 pool has no scales (1.0 everywhere); checkpoint scales never reach it.
"""

from __future__ import annotations

import abc
import math
import struct
from collections.abc import Sequence

import torch

from mla_backend.host_tensors import int64_tensor, segment_aranges

# `CacheConfig.kv_cache_dtype` → storage dtype (None: the model's dtype).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the FP8 KV storage dtypes (float8_e4m3fn, float8_e5m2)."""
    return dtype in FP8_DTYPES


def fp8_reciprocal(scale: float) -> float:
    """1 / scale as float32 division rounds it (a Python float float32 holds exactly): the
    factor of an FP8 pool's write. The same formula as `mla_kernels.store_kv.fp8_reciprocal`
    (kernels import no mla_backend code); the two writes are compared byte for byte on the GPU
    (tests/kernels/test_store_kv.py). A float32 division done in double and rounded once is the
    correctly rounded float32 quotient (double has over twice float32's precision)."""
    f32 = struct.Struct("f")
    return f32.unpack(f32.pack(1.0 / f32.unpack(f32.pack(float(scale)))[0]))[0]


def quantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x · (1 / scale) (`fp8_reciprocal`: float32 arithmetic, as the CUDA quantizing store
    `mla_kernels.store_kv` computes it, which writes the same bytes) saturated to the format's
    largest finite value (448 for e4m3, 57344 for e5m2) and cast (round to nearest even): huge
    and infinite inputs become ±max, never inf/NaN.

    Args:
        x: any float tensor; scale: > 0; dtype: float8_e4m3fn or float8_e5m2.
    Returns:
        tensor of x's shape in `dtype`.
    """
    fmax = torch.finfo(dtype).max
    return (x.float() * fp8_reciprocal(scale)).clamp_(-fmax, fmax).to(dtype)


def dequantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x.float() * scale: fp32 tensor of x's shape."""
    return x.float() * scale


def _check_scales(name: str, scales: Sequence[float] | None, layer_num: int,
                  dtype: torch.dtype) -> list[float]:
    if scales is None:
        return [1.0] * layer_num
    scales = [float(s) for s in scales]
    if not is_fp8(dtype):
        raise ValueError(f"{name}: KV scales apply only to an FP8 pool, this pool stores {dtype}")
    if len(scales) != layer_num or not all(math.isfinite(s) and s > 0 for s in scales):
        raise ValueError(f"{name}: need {layer_num} finite positive scales, got {scales}")
    return scales


_NO_RUNS = torch.empty((0, 3), dtype=torch.int32)  # take_writes with nothing of a kind
_NO_SLOTS = torch.empty(0, dtype=torch.int32)
_NO_POINTS = torch.empty((3, 0), dtype=torch.int32)


class ReqToTokenPool:
    """Maps (request row, token position) to a token slot.

    Args:
        size: number of rows (concurrent requests).
        max_context_len: columns per row (the longest sequence a request may reach).
        device: where `req_to_token` lives (the attention kernels read it).
    """

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu"):
        if size < 1 or max_context_len < 1:
            raise ValueError(f"ReqToTokenPool needs size >= 1 and max_context_len >= 1, "
                             f"got {size}, {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        # [size, max_context_len] int32, device: slot id of token j of the request in row i
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32,
                                        device=self.device)
        # The same table on the host (the very tensor on a CPU device; on a GPU as many host
        # bytes as the device table: size * max_context_len * 4).
        self.req_to_token_host = self.req_to_token if self.device.type == "cpu" else \
            torch.zeros((size, max_context_len), dtype=torch.int32)
        self._free: list[int] = list(range(size))
        self._is_free = [True] * size
        # Cells written since the last `take_writes` (None: not tracked): (row, start, n) runs
        # and [2, n] int64 (rows, cols) points.
        self._written: tuple[list[tuple[int, int, int]], list[torch.Tensor]] | None = None

    def available_size(self) -> int:
        """Number of free rows."""
        return len(self._free)

    def alloc(self, n: int = 1) -> list[int] | None:
        """Take `n` rows; returns their indices, or None (nothing taken) if fewer are free."""
        if n < 0:
            raise ValueError(f"alloc: n must be >= 0, got {n}")
        if n > len(self._free):
            return None
        rows, self._free = self._free[:n], self._free[n:]
        for r in rows:
            self._is_free[r] = False
        return rows

    def free(self, idx: int | list[int]) -> None:
        """Return row(s) to the free list.

        Raises:
            ValueError: a row out of range or already free (double free).
        """
        rows = [idx] if isinstance(idx, int) else list(idx)
        for r in rows:
            if not 0 <= r < self.size or self._is_free[r]:
                raise ValueError(f"ReqToTokenPool.free: row {r} is out of range or already free")
            self._is_free[r] = True
            self._free.append(r)

    def clear(self) -> None:
        """Free every row."""
        self._free = list(range(self.size))
        self._is_free = [True] * self.size

    def track_writes(self) -> None:
        """From now on record the cells every write touches (see `take_writes`)."""
        self._written = ([], [])

    def take_writes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The cells written since the last call (or since `track_writes`), with the values the
        host table holds now, and clears the record: (runs int32 [k, 3] of (row, start, n) from
        `write_row`, their slots int32 [sum n] in order, points int32 [3, m] of (row, column,
        slot) from `write_positions`). A cell written twice appears twice with its latest value,
        so the writes can be applied in any order (`expand_writes`).

        Raises:
            RuntimeError: writes are not tracked.
        """
        if self._written is None:
            raise RuntimeError("ReqToTokenPool.take_writes: call track_writes() first")
        runs, points = self._written
        self._written = ([], [])
        host = self.req_to_token_host
        run_t, run_slots, point_t = _NO_RUNS, _NO_SLOTS, _NO_POINTS
        if runs:
            runs64 = int64_tensor(v for run in runs for v in run).view(-1, 3)
            rows, starts, lengths = runs64.T
            run_slots = host.view(-1)[segment_aranges(rows * host.shape[1] + starts, lengths)]
            run_t = runs64.to(torch.int32)
        if points:  # (few torch calls: a decode step's writes are all points)
            cells = points[0] if len(points) == 1 else torch.cat(points, dim=1)
            point_t = torch.empty((3, cells.shape[1]), dtype=torch.int32)
            point_t[:2] = cells
            point_t[2] = host[cells[0], cells[1]]
        return run_t, run_slots, point_t

    def write_row(self, row: int, start: int, slots: torch.Tensor) -> None:
        """req_to_token[row, start:start + n] = slots ([n] integer tensor, CPU), both copies."""
        n = int(slots.numel())
        if self._written is not None:
            self._written[0].append((row, start, n))
        host = slots.to(torch.int32)
        self.req_to_token_host[row, start:start + n] = host
        if self.req_to_token is not self.req_to_token_host:
            self.req_to_token[row, start:start + n] = host.to(self.device, non_blocking=True)

    def write_positions(self, rows: list[int], cols: list[int], slots: torch.Tensor) -> None:
        """req_to_token[rows[i], cols[i]] = slots[i] for every i (slots: [n] integer tensor,
        CPU), both copies; on a device as one scatter."""
        n = len(rows)
        packed = torch.empty(3 * n, dtype=torch.int64)
        packed[:2 * n] = int64_tensor(rows + cols)  # (one list: one conversion)
        packed[2 * n:] = slots
        r, c = packed[:n], packed[n:2 * n]
        self.req_to_token_host[r, c] = slots.to(torch.int32)
        if self._written is not None:
            self._written[1].append(packed[:2 * n].view(2, n))
        if self.req_to_token is not self.req_to_token_host:
            dev = packed.to(self.device, non_blocking=True)
            self.req_to_token[dev[:n], dev[n:2 * n]] = dev[2 * n:].to(torch.int32)

    def read_row(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slots of positions start..end-1 of `row` from the host copy: [end - start] int64
        CPU tensor (a copy)."""
        return self.req_to_token_host[row, start:end].to(torch.int64)


def expand_writes(runs: torch.Tensor, run_slots: torch.Tensor,
                  points: torch.Tensor) -> torch.Tensor:
    """The cells of `ReqToTokenPool.take_writes`'s (runs, run_slots, points) as one [3, N]
    tensor of (rows, columns, slots), ready for one scatter: int32 when there are no runs (a
    decode step's writes), else int64."""
    if not runs.shape[0]:
        return points
    rows, starts, lengths = runs.to(torch.int64).T
    cells = torch.stack([torch.repeat_interleave(rows, lengths),
                         segment_aranges(starts, lengths), run_slots.to(torch.int64)])
    return torch.cat([cells, points.to(torch.int64)], dim=1)


class TokenToKVPoolAllocator:
    """Free list of token slots 1..size (slot 0 is the sink and never allocated).

    Args:
        size: number of real slots.
        device: device of the KV pool these slots index (the free list itself stays on CPU).
    """

    def __init__(self, size: int, device: str | torch.device = "cpu"):
        if size < 1:
            raise ValueError(f"TokenToKVPoolAllocator needs size >= 1, got {size}")
        self.size = size
        self.device = torch.device(device)
        self.clear()

    def clear(self) -> None:
        """Free every slot."""
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64)  # [n_free] int64 cpu
        self._freed: list[torch.Tensor] = []  # freed since the last merge, in order
        self._n_freed = 0

    def available_size(self) -> int:
        """Number of free slots."""
        return int(self._free.numel()) + self._n_freed

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take `n` slots: [n] int64 cpu tensor of slot ids, or None (nothing taken) if short."""
        if n < 0:
            raise ValueError(f"alloc: n must be >= 0, got {n}")
        if n > self._free.numel():
            if n > self._free.numel() + self._n_freed:
                return None
            self._free = torch.cat([self._free, *self._freed])  # free order kept
            self._freed, self._n_freed = [], 0
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, t: torch.Tensor) -> None:
        """Return slots ([n] integer tensor, any device) to the free list.

        Raises:
            ValueError: a slot outside 1..size (the sink included).
        """
        if t.numel() == 0:
            return
        t = t.reshape(-1).to(device="cpu", dtype=torch.int64)
        if int(t.min()) < 1 or int(t.max()) > self.size:
            raise ValueError(f"TokenToKVPoolAllocator.free: slot outside 1..{self.size}")
        # Appended lazily (merged when `alloc` needs them): one cat of the whole free list per
        # free cost ~1-3 ms per decode step at millions of slots.
        self._freed.append(t)
        self._n_freed += int(t.numel())


class KVPool(abc.ABC):
    """Per-layer KV storage indexed by token slot (row 0 = sink). Shapes of one layer's buffers:
    key [size + 1, kv_heads, head_dim], value [size + 1, kv_heads, v_head_dim]."""

    size: int
    dtype: torch.dtype  # storage dtype (float8_e4m3fn / float8_e5m2 for an FP8 cache)
    device: torch.device
    layer_num: int
    k_scales: list[float]  # per layer; 1.0 unless FP8 with checkpoint scales
    v_scales: list[float]

    @property
    def is_fp8(self) -> bool:
        """True when the pool stores FP8 (writes quantize, reads must dequantize)."""
        return is_fp8(self.dtype)

    def get_kv_scales(self, layer_id: int) -> tuple[float, float]:
        """(k_scale, v_scale) of layer `layer_id`: stored = x / scale, value = stored * scale.
        Both 1.0 for a non-FP8 pool; equal for the MLA pool (one scale per latent row)."""
        return self.k_scales[layer_id], self.v_scales[layer_id]

    def gather_kv(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given slots, dequantized.

        Args:
            slots: int64 slot ids of any shape [*S] (on the pool's device).
        Returns:
            key [*S, kv_heads, head_dim], value [*S, kv_heads, v_head_dim]: fp32 (x * scale)
            for an FP8 pool, else in the pool dtype.
        """
        k_buf, v_buf = self.get_kv_buffer(layer_id)
        k, v = k_buf[slots], v_buf[slots]
        if self.is_fp8:
            k_scale, v_scale = self.get_kv_scales(layer_id)
            return dequantize_fp8(k, k_scale), dequantize_fp8(v, v_scale)
        return k, v

    def _write(self, buf: torch.Tensor, loc: torch.Tensor, x: torch.Tensor,
               scale: float) -> None:
        """buf[loc] = x in the pool dtype (FP8: quantized with `scale`, scattered as bytes)."""
        if self.is_fp8:
            # NOTE: scattered through uint8 views (index_put on fp8 is not on every device).
            buf.view(torch.uint8)[loc] = quantize_fp8(x, scale, self.dtype).view(torch.uint8)
        else:
            buf[loc] = x.to(self.dtype)

    @abc.abstractmethod
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """[size + 1, kv_heads, head_dim] of layer `layer_id`."""

    @abc.abstractmethod
    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """[size + 1, kv_heads, v_head_dim] of layer `layer_id`."""

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key buffer, value buffer) of layer `layer_id`."""
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    @abc.abstractmethod
    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor,
                      cache_v: torch.Tensor | None) -> None:
        """Write new tokens' K (and V) at slots `loc` [T] int64 (cast to the pool dtype; FP8:
        quantized with the layer's scales, saturating)."""

    @abc.abstractmethod
    def cell_bytes(self) -> int:
        """Bytes one slot occupies over all layers."""


class MHATokenToKVPool(KVPool):
    """Separate K and V per KV head, per layer.

    Args:
        size: real slots (buffers have size + 1 rows; row 0 is the sink).
        dtype: storage dtype.
        head_num: KV heads (per TP rank).
        head_dim, v_head_dim: K and V head sizes.
        layer_num: number of attention layers.
        device: where the buffers live.
        k_scales, v_scales: per-layer FP8 scales (None: 1.0); only for an FP8 dtype.
    Raises:
        ValueError: scales for a non-FP8 pool, or not `layer_num` finite positive values.
    """

    def __init__(self, size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 v_head_dim: int, layer_num: int, device: str | torch.device = "cpu",
                 k_scales: Sequence[float] | None = None,
                 v_scales: Sequence[float] | None = None):
        self.size, self.dtype, self.device = size, dtype, torch.device(device)
        self.layer_num, self.head_num = layer_num, head_num
        self.k_scales = _check_scales("k_scales", k_scales, layer_num, dtype)
        self.v_scales = _check_scales("v_scales", v_scales, layer_num, dtype)
        self.head_dim, self.v_head_dim = head_dim, v_head_dim
        # per layer [size + 1, head_num, head_dim] / [size + 1, head_num, v_head_dim], device
        self.k_buffer = [torch.zeros((size + 1, head_num, head_dim), dtype=dtype,
                                     device=self.device) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros((size + 1, head_num, v_head_dim), dtype=dtype,
                                     device=self.device) for _ in range(layer_num)]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor,
                      cache_v: torch.Tensor | None) -> None:
        """Raises ValueError if `cache_v` is None (an MHA pool needs both)."""
        if cache_v is None:
            raise ValueError("MHATokenToKVPool.set_kv_buffer needs cache_v")
        loc = loc.to(self.device)
        self._write(self.k_buffer[layer_id], loc, cache_k, self.k_scales[layer_id])
        self._write(self.v_buffer[layer_id], loc, cache_v, self.v_scales[layer_id])

    def cell_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.head_num * (self.head_dim + self.v_head_dim) * elem * self.layer_num


class MLATokenToKVPool(KVPool):
    """DeepSeek MLA latent cache: per layer one [size + 1, 1, kv_lora_rank + qk_rope_head_dim]
    buffer (c_KV ‖ rotated k_pe). The value buffer is the view `[..., :kv_lora_rank]` of it, so
    `set_kv_buffer` writes the key only.

    Args: as `MHATokenToKVPool`, with `kv_scales`: per-layer FP8 scales of the whole row (None:
        1.0; checkpoints' `k_scale`); only for an FP8 dtype.
    Raises:
        ValueError: scales for a non-FP8 pool, or not `layer_num` finite positive values.
    """

    def __init__(self, size: int, dtype: torch.dtype, kv_lora_rank: int, qk_rope_head_dim: int,
                 layer_num: int, device: str | torch.device = "cpu",
                 kv_scales: Sequence[float] | None = None):
        self.size, self.dtype, self.device = size, dtype, torch.device(device)
        self.layer_num = layer_num
        self.k_scales = _check_scales("kv_scales", kv_scales, layer_num, dtype)
        self.v_scales = self.k_scales  # the value is a view of the key row: one scale
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        # per layer [size + 1, 1, kv_lora_rank + qk_rope_head_dim], device
        self.kv_buffer = [torch.zeros((size + 1, 1, kv_lora_rank + qk_rope_head_dim),
                                      dtype=dtype, device=self.device) for _ in range(layer_num)]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id][..., : self.kv_lora_rank]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor,
                      cache_v: torch.Tensor | None = None) -> None:
        """cache_k: [T, 1, kv_lora_rank + qk_rope_head_dim]; cache_v is ignored."""
        self._write(self.kv_buffer[layer_id], loc.to(self.device), cache_k,
                    self.k_scales[layer_id])

    def cell_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return (self.kv_lora_rank + self.qk_rope_head_dim) * elem * self.layer_num


__all__ = [
    "FP8_DTYPES",
    "KV_CACHE_DTYPES",
    "KVPool",
    "MHATokenToKVPool",
    "MLATokenToKVPool",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "dequantize_fp8",
    "is_fp8",
    "quantize_fp8",
]
