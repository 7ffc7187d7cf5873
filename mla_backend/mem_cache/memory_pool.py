"""Two-level KV memory: request rows → token slots → per-layer KV storage.

Owns:
- `ReqToTokenPool`: `req_to_token[row, position] -> slot` (int32, on the model's device). Rows are
  handed out by the scheduler, one per running request; slots are written by the scheduler and the
  prefix cache and read by the attention backends.
- `TokenToKVPoolAllocator`: the CPU free list of token slots 1..size. Slot 0 is a reserved sink
  (padded CUDA-graph rows write there) and is never handed out.
- `KVPool` and its two layouts: `MHATokenToKVPool` (per layer K and V per KV head) and
  `MLATokenToKVPool` (per layer one latent `c_KV ‖ k_pe` vector per slot; the value buffer is a
  view of the latent part). Written through `set_kv_buffer` by the attention backends (for
  `RadixAttention` layers), read by the backends.

Sizes come from the model runner (which derives them from `CacheConfig` and device memory).
"""

from __future__ import annotations

import abc

import torch


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
        self._free: list[int] = list(range(size))
        self._is_free = [True] * size

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

    def available_size(self) -> int:
        """Number of free slots."""
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take `n` slots: [n] int64 cpu tensor of slot ids, or None (nothing taken) if short."""
        if n < 0:
            raise ValueError(f"alloc: n must be >= 0, got {n}")
        if n > self._free.numel():
            return None
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
        self._free = torch.cat([self._free, t])


class KVPool(abc.ABC):
    """Per-layer KV storage indexed by token slot (row 0 = sink). Shapes of one layer's buffers:
    key [size + 1, kv_heads, head_dim], value [size + 1, kv_heads, v_head_dim]."""

    size: int
    dtype: torch.dtype
    device: torch.device
    layer_num: int

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
        """Write new tokens' K (and V) at slots `loc` [T] int64 (cast to the pool dtype)."""

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
    """

    def __init__(self, size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 v_head_dim: int, layer_num: int, device: str | torch.device = "cpu"):
        self.size, self.dtype, self.device = size, dtype, torch.device(device)
        self.layer_num, self.head_num = layer_num, head_num
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
        self.k_buffer[layer_id][loc] = cache_k.to(self.dtype)
        self.v_buffer[layer_id][loc] = cache_v.to(self.dtype)

    def cell_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.head_num * (self.head_dim + self.v_head_dim) * elem * self.layer_num


class MLATokenToKVPool(KVPool):
    """DeepSeek MLA latent cache: per layer one [size + 1, 1, kv_lora_rank + qk_rope_head_dim]
    buffer (c_KV ‖ rotated k_pe). The value buffer is the view `[..., :kv_lora_rank]` of it, so
    `set_kv_buffer` writes the key only.
    """

    def __init__(self, size: int, dtype: torch.dtype, kv_lora_rank: int, qk_rope_head_dim: int,
                 layer_num: int, device: str | torch.device = "cpu"):
        self.size, self.dtype, self.device = size, dtype, torch.device(device)
        self.layer_num = layer_num
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
        self.kv_buffer[layer_id][loc.to(self.device)] = cache_k.to(self.dtype)

    def cell_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return (self.kv_lora_rank + self.qk_rope_head_dim) * elem * self.layer_num


__all__ = [
    "KVPool",
    "MHATokenToKVPool",
    "MLATokenToKVPool",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
]
