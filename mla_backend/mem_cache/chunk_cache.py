"""`ChunkCache`: the prefix-cache interface when the radix cache is off.

Never shares anything between requests. It only remembers, per request id, the slots of the
prompt part already prefilled by earlier chunks (set by `cache_unfinished_req`), so the scheduler
can continue a chunked prefill; everything is freed when the request finishes. Slots come from the
request's `req_to_token` row and go back to `TokenToKVPoolAllocator`.

Accounting: the slots remembered per request count as `protected_size()`; nothing is evictable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mla_backend.mem_cache.radix_cache import MatchResult

if TYPE_CHECKING:
    from mla_backend.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
    from mla_backend.request import Req

_EMPTY = torch.empty((0,), dtype=torch.int64)


class ChunkCache:
    """Same interface as `RadixCache`; see the module docstring.

    Args:
        req_to_token_pool: rows of running requests.
        token_to_kv_pool_allocator: where freed slots go.
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool,
                 token_to_kv_pool_allocator: TokenToKVPoolAllocator):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self.entries: dict[str, torch.Tensor] = {}  # rid -> [n] int64 cpu slots of its prefix

    def reset(self) -> None:
        """Forget every entry (slots are NOT freed)."""
        self.entries = {}

    def match_prefix(self, key: list[int]) -> MatchResult:
        """Never matches: returns (empty [0] int64 tensor, None)."""
        return MatchResult(_EMPTY, None)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Stores nothing; returns 0 (no leading token is ever present)."""
        return 0

    def evict(self, num_tokens: int) -> int:
        """Nothing is evictable; returns 0."""
        return 0

    def inc_lock_ref(self, node: object) -> int:
        return 0

    def dec_lock_ref(self, node: object) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        """Slots remembered for in-flight requests."""
        return sum(int(v.numel()) for v in self.entries.values())

    def total_size(self) -> int:
        return self.protected_size()

    def cache_finished_req(self, req: Req, kv_len: int | None = None) -> None:
        """Free the request's first `kv_len` slots (default: seqlen - 1) and its row."""
        if kv_len is None:
            kv_len = req.seqlen - 1
        kv_len = max(0, min(kv_len, req.seqlen))
        row = req.req_pool_idx
        assert row is not None, f"cache_finished_req: request {req.rid} has no row"
        self.entries.pop(req.rid, None)
        self.allocator.free(self.req_to_token_pool.read_row(row, 0, kv_len))
        self.req_to_token_pool.free(row)
        req.req_pool_idx, req.last_node, req.prefix_indices = None, None, None

    def cache_unfinished_req(self, req: Req) -> None:
        """Remember the slots of `req.fill_ids` (all computed now) as the request's prefix."""
        row = req.req_pool_idx
        assert row is not None, f"cache_unfinished_req: request {req.rid} has no row"
        slots = self.req_to_token_pool.read_row(row, 0, len(req.fill_ids))
        self.entries[req.rid] = slots
        req.prefix_indices = slots
        req.last_node = None


__all__ = ["ChunkCache"]
