"""RadixCache and ChunkCache: matching with splits, insert's cached length, LRU eviction, locks,
and the request hand-over (cache_finished_req / cache_unfinished_req)."""

from __future__ import annotations

import torch

from mla_backend.mem_cache.chunk_cache import ChunkCache
from mla_backend.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from mla_backend.mem_cache.radix_cache import RadixCache
from mla_backend.request import Req, SamplingParams


def make(size: int = 32):
    r2t = ReqToTokenPool(4, 64)
    alloc = TokenToKVPoolAllocator(size)
    return r2t, alloc, RadixCache(r2t, alloc)


def put(tree: RadixCache, alloc: TokenToKVPoolAllocator, key: list[int]) -> torch.Tensor:
    slots = alloc.alloc(len(key))
    present = tree.insert(key, slots)
    alloc.free(slots[:present])
    return slots


def test_match_splits_node_and_returns_slots():
    _, alloc, tree = make()
    slots = put(tree, alloc, [1, 2, 3, 4, 5])
    assert len(tree.root.children) == 1
    m = tree.match_prefix([1, 2, 3, 9])
    assert m.device_indices.tolist() == slots[:3].tolist()
    assert m.last_node.key == [1, 2, 3]
    assert list(m.last_node.children.values())[0].key == [4, 5]  # split
    assert tree.total_size() == 5 and tree.evictable_size() == 5
    full = tree.match_prefix([1, 2, 3, 4, 5, 6])
    assert full.device_indices.tolist() == slots.tolist() and full.last_node.key == [4, 5]
    none = tree.match_prefix([7, 1])
    assert none.device_indices.numel() == 0 and none.last_node is tree.root


def test_split_inherits_lock_ref():
    _, alloc, tree = make()
    put(tree, alloc, [1, 2, 3, 4])
    node = tree.match_prefix([1, 2, 3, 4]).last_node
    assert tree.inc_lock_ref(node) == -4
    assert tree.protected_size() == 4 and tree.evictable_size() == 0
    parent = tree.match_prefix([1, 2]).last_node
    assert parent.lock_ref == 1 and node.lock_ref == 1 and node.parent is parent
    assert tree.dec_lock_ref(node) == 4  # walks both halves back to evictable
    assert tree.evictable_size() == 4 and parent.lock_ref == 0


def test_insert_returns_already_present_length():
    _, alloc, tree = make()
    a = put(tree, alloc, [1, 2, 3])
    b = alloc.alloc(5)
    assert tree.insert([1, 2, 3, 7, 8], b) == 3
    alloc.free(b[:3])
    assert tree.match_prefix([1, 2, 3, 7, 8]).device_indices.tolist() == a.tolist() + b[3:].tolist()
    c = alloc.alloc(2)
    assert tree.insert([1, 2], c) == 2  # fully present: nothing new stored
    alloc.free(c)
    assert tree.total_size() == 5 and alloc.available_size() == 32 - 5


def test_eviction_is_lru_over_leaves_and_skips_locked():
    _, alloc, tree = make()
    put(tree, alloc, [1, 2, 3])        # oldest
    put(tree, alloc, [4, 5])
    put(tree, alloc, [6, 7, 8, 9])
    tree.match_prefix([1, 2, 3])        # refresh: [4, 5] is now the least recent
    locked = tree.match_prefix([6, 7, 8, 9]).last_node
    tree.inc_lock_ref(locked)
    assert tree.evict(1) == 2           # whole leaf [4, 5]
    assert tree.match_prefix([4, 5]).device_indices.numel() == 0
    assert tree.evict(100) == 3         # [1, 2, 3]; the locked leaf survives
    assert tree.match_prefix([6, 7, 8, 9]).device_indices.numel() == 4
    assert tree.evictable_size() == 0 and tree.protected_size() == 4
    assert alloc.available_size() == 32 - 4
    tree.dec_lock_ref(locked)
    assert tree.evict(1) == 4 and alloc.available_size() == 32 and tree.total_size() == 0


def test_eviction_frees_parents_that_become_leaves():
    _, alloc, tree = make()
    put(tree, alloc, [1, 2, 3, 4])
    put(tree, alloc, [1, 2, 9])
    assert tree.evict(5) == 5 and tree.total_size() == 0 and not tree.root.children


def test_deep_tree_eviction_is_iterative():
    _, alloc, tree = make(size=4000)
    key: list[int] = []
    for i in range(1200):  # a chain 1200 nodes deep: deeper than the recursion limit
        key = key + [i + 1]
        put(tree, alloc, key + [0])
    held = 4000 - alloc.available_size()
    assert held == tree.total_size() == 2400
    assert tree.evict(10**6) == held and alloc.available_size() == 4000


def new_req(rid: str, prompt: list[int]) -> Req:
    return Req(rid=rid, origin_input_ids=prompt, sampling_params=SamplingParams())


def admit(r2t: ReqToTokenPool, alloc, tree, req: Req) -> None:
    """What the scheduler does at admission: match, lock, row, slots for the new tokens."""
    req.fill_ids = req.origin_input_ids + req.output_ids
    m = tree.match_prefix(req.fill_ids[:-1])
    req.prefix_indices, req.last_node = m.device_indices, m.last_node
    tree.inc_lock_ref(req.last_node)
    req.req_pool_idx = r2t.alloc(1)[0]
    n = len(req.prefix_indices)
    new = alloc.alloc(len(req.fill_ids) - n)
    r2t.req_to_token[req.req_pool_idx, :n] = req.prefix_indices.int()
    r2t.req_to_token[req.req_pool_idx, n:len(req.fill_ids)] = new.int()


def test_full_hit_leaves_one_token_to_compute():
    r2t, alloc, tree = make()
    a = new_req("a", [5, 6, 7, 8])
    admit(r2t, alloc, tree, a)
    a.output_ids = [9]
    tree.cache_finished_req(a)  # caches [5, 6, 7, 8]; token 9 has no KV
    assert tree.total_size() == 4 and a.req_pool_idx is None and r2t.available_size() == 4
    b = new_req("b", [5, 6, 7, 8])
    admit(r2t, alloc, tree, b)
    assert len(b.prefix_indices) == 3  # at most len - 1 matched


def test_cache_unfinished_then_finished_dedups_and_unlocks():
    r2t, alloc, tree = make()
    a, b = new_req("a", [1, 2, 3, 4, 5]), new_req("b", [1, 2, 3, 4, 6])
    admit(r2t, alloc, tree, a)
    admit(r2t, alloc, tree, b)          # same batch: no sharing yet, 10 slots used
    assert alloc.available_size() == 22
    tree.cache_unfinished_req(a)
    tree.cache_unfinished_req(b)        # b's [1, 2, 3, 4] duplicates are freed
    assert alloc.available_size() == 32 - 6 and tree.total_size() == 6
    row_a = r2t.req_to_token[a.req_pool_idx, :5].tolist()
    row_b = r2t.req_to_token[b.req_pool_idx, :5].tolist()
    assert row_a[:4] == row_b[:4] and row_a[4] != row_b[4]
    assert b.prefix_indices.tolist() == row_b and tree.protected_size() == 6
    assert tree.evictable_size() == 0
    # decode one token for a, then finish both
    a.output_ids = [7, 8]
    slot = alloc.alloc(1)
    r2t.req_to_token[a.req_pool_idx, 5] = int(slot)
    tree.cache_finished_req(a)          # inserts [1..5, 7]
    b.output_ids = [9]
    tree.cache_finished_req(b)
    assert tree.protected_size() == 0 and tree.evictable_size() == 7
    assert alloc.available_size() + tree.evictable_size() == 32 and r2t.available_size() == 4
    assert tree.match_prefix([1, 2, 3, 4, 5, 7, 8]).device_indices.numel() == 6


def test_chunk_cache_never_shares_and_frees_everything():
    r2t = ReqToTokenPool(2, 16)
    alloc = TokenToKVPoolAllocator(16)
    cache = ChunkCache(r2t, alloc)
    assert cache.match_prefix([1, 2, 3]).device_indices.numel() == 0
    assert cache.insert([1, 2], torch.tensor([1, 2])) == 0 and cache.evict(5) == 0
    req = new_req("a", [1, 2, 3, 4, 5, 6])
    req.req_pool_idx = r2t.alloc(1)[0]
    s = alloc.alloc(4)
    r2t.req_to_token[req.req_pool_idx, :4] = s.int()
    req.fill_ids = req.origin_input_ids[:4]
    cache.cache_unfinished_req(req)
    assert req.prefix_indices.tolist() == s.tolist() and cache.protected_size() == 4
    s2 = alloc.alloc(2)
    r2t.req_to_token[req.req_pool_idx, 4:6] = s2.int()
    req.output_ids = [7]
    cache.cache_finished_req(req)
    assert alloc.available_size() == 16 and r2t.available_size() == 2
    assert cache.protected_size() == 0 and cache.total_size() == 0
