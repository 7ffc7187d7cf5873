"""Radix-tree prefix cache over token slots (SGLang v0.3 `RadixCache`).

Owns the tree of token runs → slot ids and the slots it holds. Slots come from the scheduler's
requests (`cache_finished_req` / `cache_unfinished_req` move them from a request's
`req_to_token` row into the tree); they go back to `TokenToKVPoolAllocator` when evicted or when a
request's copy duplicates what the tree already holds.

Accounting: every slot in the tree is either evictable (no running request locks its node) or
protected (locked). `evictable_size() + protected_size() == total_size()`.

| who                    | locks                     | unlocks                            |
|------------------------|---------------------------|------------------------------------|
| scheduler at admission | `inc_lock_ref(last_node)` |                                    |
| cache_unfinished_req   | new last_node             | old last_node                      |
| cache_finished_req     |                           | last_node (request done)           |
| scheduler retraction   |                           | last_node                          |
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from mla_backend.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
    from mla_backend.request import Req

_EMPTY = torch.empty((0,), dtype=torch.int64)


class MatchResult(NamedTuple):
    """device_indices: [n] int64 cpu slot ids of the matched prefix; last_node: deepest node."""

    device_indices: torch.Tensor
    last_node: TreeNode | None


_ids = itertools.count()
_clock = itertools.count(1)  # logical access time: strictly increasing, so LRU order is exact


class TreeNode:
    """One run of tokens. `value[i]` is the slot of `key[i]`; `children` keyed by first token."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time", "id")

    def __init__(self, key: list[int] | None = None, value: torch.Tensor | None = None,
                 parent: TreeNode | None = None):
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key: list[int] = key if key is not None else []
        self.value: torch.Tensor = value if value is not None else _EMPTY  # [len(key)] int64 cpu
        self.lock_ref = 0
        self.last_access_time = next(_clock)
        self.id = next(_ids)

    def __lt__(self, other: TreeNode) -> bool:
        return (self.last_access_time, self.id) < (other.last_access_time, other.id)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache:
    """Prefix cache shared by all requests (radix cache on).

    Args:
        req_to_token_pool: rows of running requests (read and rewritten with canonical slots).
        token_to_kv_pool_allocator: where freed slots go.
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool,
                 token_to_kv_pool_allocator: TokenToKVPoolAllocator):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self.reset()

    def reset(self) -> None:
        """Drop the whole tree (its slots are NOT freed: callers clear the allocator too)."""
        self.root = TreeNode()
        self.root.lock_ref = 1
        self._evictable = 0
        self._protected = 0

    # ------------------------------------------------------------------ sizes
    def evictable_size(self) -> int:
        """Slots held by unlocked nodes."""
        return self._evictable

    def protected_size(self) -> int:
        """Slots held by nodes locked by running requests."""
        return self._protected

    def total_size(self) -> int:
        """All slots held by the tree."""
        return self._evictable + self._protected

    # ------------------------------------------------------------------ match / insert
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of `key`; splits the node the match ends inside; refreshes
        access times along the path. Callers pass at most len - 1 tokens of a sequence so that
        at least one token is recomputed (its logits are needed).

        Returns:
            MatchResult(slot ids [n] int64 cpu with n <= len(key), the deepest matched node (the
            root when nothing matched)).
        """
        node, values, pos = self.root, [], 0
        now = next(_clock)
        node.last_access_time = now
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_len(child.key, key[pos:pos + len(child.key)])
            ends_inside = n < len(child.key)
            if ends_inside:
                child = self._split(child, n)
            child.last_access_time = now
            values.append(child.value)
            node, pos = child, pos + n
            if ends_inside:
                break
        indices = torch.cat(values) if values else _EMPTY
        return MatchResult(indices, node)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after its first n tokens; returns the new parent (inherits lock_ref)."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        new = TreeNode(child.key[:n], child.value[:n], parent)
        new.lock_ref = child.lock_ref
        new.last_access_time = child.last_access_time
        child.key, child.value = child.key[n:], child.value[n:]
        child.parent = new
        new.children[child.key[0]] = child
        parent.children[new.key[0]] = new
        return new

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Insert token run `key` with slot ids `value` ([len(key)] int64 cpu).

        Returns:
            How many leading tokens were already present. The caller owns (and must free) its
            duplicate slots `value[:returned]` that differ from the tree's; the rest now belong
            to the tree.
        """
        if len(key) != int(value.numel()):
            raise ValueError(f"insert: {len(key)} tokens but {int(value.numel())} slots")
        node, pos = self.root, 0
        now = next(_clock)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = TreeNode(list(key[pos:]), value[pos:].clone().to(torch.int64), node)
                leaf.last_access_time = now
                node.children[key[pos]] = leaf
                self._evictable += len(leaf.key)
                return pos
            n = _common_len(child.key, key[pos:pos + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            node, pos = child, pos + n
        return pos

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots (if that many are evictable), least recently used
        leaves first; locked nodes are never evicted. Returns the number of slots freed."""
        if num_tokens <= 0:
            return 0
        heap = [n for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)
            self.allocator.free(node.value)
            freed += len(node.key)
            self._evictable -= len(node.key)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            node.parent = None
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def _leaves(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:  # iterative: deep trees must not hit the recursion limit
            node = stack.pop()
            if not node.children and node is not self.root:
                out.append(node)
            stack.extend(node.children.values())
        return out

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: TreeNode | None) -> int:
        """Lock the path root → node. Returns the change of evictable size (<= 0)."""
        delta = 0
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        """Unlock the path root → node. Returns the change of evictable size (>= 0).

        Raises:
            AssertionError: a node on the path was not locked.
        """
        delta = 0
        while node is not None and node is not self.root:
            assert node.lock_ref > 0, f"dec_lock_ref on unlocked {node}"
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            node = node.parent
        return delta

    # ------------------------------------------------------------------ request hand-over
    def cache_finished_req(self, req: Req, kv_len: int | None = None) -> None:
        """Move a finished (or aborted) request's KV into the tree, free its duplicates and its
        row, and unlock its last_node.

        Args:
            req: with req_pool_idx, prefix_indices (slots of its locked prefix) and last_node.
            kv_len: tokens of origin_input_ids + output_ids whose KV is in the row (default: all
                but the last, which was sampled and never ran through the model).
        """
        tokens = req.origin_input_ids + req.output_ids
        if kv_len is None:
            kv_len = len(tokens) - 1
        kv_len = max(0, min(kv_len, len(tokens)))
        row = req.req_pool_idx
        assert row is not None, f"cache_finished_req: request {req.rid} has no row"
        prefix_len = 0 if req.prefix_indices is None else int(req.prefix_indices.numel())
        slots = self.req_to_token_pool.read_row(row, 0, kv_len)
        present = self.insert(tokens[:kv_len], slots)
        if present > prefix_len:
            self.allocator.free(slots[prefix_len:present])
        self.req_to_token_pool.free(row)
        self.dec_lock_ref(req.last_node)
        req.req_pool_idx, req.last_node, req.prefix_indices = None, None, None

    def cache_unfinished_req(self, req: Req) -> None:
        """After an extend (a prefill chunk or a whole prompt): insert `req.fill_ids`' slots,
        free duplicates, write the tree's canonical slot ids into the row, move the lock to the
        new last node and update req.prefix_indices / req.last_node. The row stays allocated."""
        tokens = req.fill_ids
        row = req.req_pool_idx
        assert row is not None, f"cache_unfinished_req: request {req.rid} has no row"
        prefix_len = 0 if req.prefix_indices is None else int(req.prefix_indices.numel())
        slots = self.req_to_token_pool.read_row(row, 0, len(tokens))
        present = self.insert(tokens, slots)
        if present > prefix_len:
            self.allocator.free(slots[prefix_len:present])
        new_indices, new_last = self.match_prefix(tokens)
        assert int(new_indices.numel()) == len(tokens)
        self.req_to_token_pool.write_row(row, prefix_len, new_indices[prefix_len:])
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(new_last)
        req.prefix_indices, req.last_node = new_indices, new_last

    # ------------------------------------------------------------------ debugging
    def pretty(self) -> str:
        """Indented dump of the tree (keys, slots, locks)."""
        lines, stack = [], [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            lines.append(f"{'  ' * depth}{node.key} -> {node.value.tolist()} lock={node.lock_ref}")
            stack.extend((c, depth + 1) for c in node.children.values())
        return "\n".join(lines)


__all__ = ["MatchResult", "RadixCache", "TreeNode"]
