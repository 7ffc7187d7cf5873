"""Admission policy for extend batches: waiting-queue order (`SchedulePolicy`) and the token
budget that decides which waiting requests join the next extend batch (`PrefillAdder`).

Data comes from the `Scheduler` (its waiting/running requests, the pools' free sizes, the prefix
cache); the result (`PrefillAdder.can_run_list`, `new_chunked_req`) goes back to it.

Budget (SGLang v0.3, REFERENCE §2.4):
    rem_total = available + evictable - sum_running min(max_new - generated, 4096) * new_token_ratio
    rem_input = max_prefill_tokens;  rem_chunk = chunked_prefill_size (None: no chunking)
A request needs extend + min(remaining max_new, 4096) < rem_total; admitting it locks its prefix
node (moves tokens out of evictable, so rem_total shrinks by the lock's delta).

One departure from SGLang v0.3: a request is cut to what is left of rem_chunk only when a
chunk could not hold it whole anyway (or it would be the batch's first request). Otherwise it
waits for the next batch, which it then leads. A request split across two batches makes the
second one an extend over a cached prefix, and for DeepSeek's MLA a batch with any cached
prefix runs absorbed for all of its tokens, slower than the decompressed prefill of
prefix-free tokens.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from mla_backend.request import Req

if TYPE_CHECKING:
    from mla_backend.mem_cache.radix_cache import RadixCache

CLIP_MAX_NEW_TOKENS = 4096  # cap on the output tokens reserved per request
LPM_MAX_QUEUE = 128  # lpm falls back to fcfs beyond this many waiting requests (cost)


def remaining_new_tokens(req: Req) -> int:
    """Output tokens the request may still produce, clipped to [0, CLIP_MAX_NEW_TOKENS] for
    budgeting. (Comparisons, not min/max calls: `PrefillAdder` sums it over every running
    request in each step that has waiting requests.)"""
    left = req.sampling_params.max_new_tokens - len(req.output_ids)
    return CLIP_MAX_NEW_TOKENS if left > CLIP_MAX_NEW_TOKENS else (left if left > 0 else 0)


class SchedulePolicy:
    """Orders the waiting queue before admission.

    Args:
        policy: "lpm" (longest cached prefix first; stable) or "fcfs" (arrival order).
        cache_enabled: lpm needs the radix cache; without it the policy is fcfs.
    Raises:
        ValueError: unknown policy.
    """

    def __init__(self, policy: str, cache_enabled: bool):
        if policy not in ("lpm", "fcfs"):
            raise ValueError(f"schedule_policy must be lpm or fcfs, got {policy!r}")
        self.policy = policy if cache_enabled else "fcfs"

    def effective(self, num_waiting: int) -> str:
        if self.policy == "lpm" and num_waiting > LPM_MAX_QUEUE:
            return "fcfs"
        return self.policy

    def sort(self, waiting: list[Req]) -> list[Req]:
        """A new list in admission order; expects `prefix_indices` already matched for lpm."""
        if self.effective(len(waiting)) == "lpm":
            return sorted(waiting, key=lambda r: -_prefix_len(r))
        return list(waiting)


def _prefix_len(req: Req) -> int:
    return 0 if req.prefix_indices is None else int(req.prefix_indices.numel())


class AddResult(enum.Enum):
    ADDED = 1
    NO_TOKEN = 2  # the token budget is exhausted: stop admitting
    OTHER = 3  # this request does not fit the per-batch input budget: stop admitting


class PrefillAdder:
    """Greedy admission of requests into one extend batch under the token budgets.

    Args:
        tree_cache: RadixCache or ChunkCache (locks change rem_total).
        running_reqs: requests already decoding (their future outputs are reserved).
        new_token_ratio: fraction of each running request's remaining outputs to reserve.
        available_plus_evictable: allocator.available_size() + tree_cache.evictable_size().
        max_prefill_tokens: new tokens per extend batch.
        chunked_prefill_size: tokens per prefill chunk; <= 0 disables chunking.
    """

    def __init__(self, tree_cache: RadixCache | Any, running_reqs: list[Req],
                 new_token_ratio: float, available_plus_evictable: int, max_prefill_tokens: int,
                 chunked_prefill_size: int):
        self.tree_cache = tree_cache
        reserved = sum(map(remaining_new_tokens, running_reqs)) * new_token_ratio
        self.rem_total_tokens: float = available_plus_evictable - reserved
        self.capacity = available_plus_evictable  # real slots obtainable (no reservation)
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens: int | None = (chunked_prefill_size if chunked_prefill_size > 0
                                             else None)
        self.chunk_size = self.rem_chunk_tokens  # the whole chunk (tokens), None: no chunking
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Req | None = None  # admitted truncated: its chunk is not its last

    def budget_exhausted(self) -> bool:
        return (self.rem_total_tokens <= 0 or self.rem_input_tokens <= 0
                or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0))

    def _take(self, extend: int, reserve_out: int) -> None:
        self.rem_total_tokens -= extend + reserve_out
        self.capacity -= extend
        self.rem_input_tokens -= extend
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend

    def add_chunked_req(self, req: Req) -> bool:
        """Continue the in-flight chunked request (its prefix and lock are already held).

        Sets `req.fill_ids`/`req.extend_input_len` to its next chunk (bounded by rem_chunk and
        by the slots really obtainable). Returns False if not even one token fits.
        """
        tokens = req.origin_input_ids + req.output_ids
        prefix_len = _prefix_len(req)
        left = len(tokens) - prefix_len
        limit = min(left, int(self.capacity))
        if self.rem_chunk_tokens is not None:
            limit = min(limit, self.rem_chunk_tokens)
        if limit <= 0:
            return False
        truncated = limit < left
        req.extend_input_len = limit
        req.fill_ids = tokens[:prefix_len + limit]
        self.can_run_list.append(req)
        if truncated:
            self.new_chunked_req = req
        self._take(limit, 0 if truncated else remaining_new_tokens(req))
        return True

    def add_one_req(self, req: Req, ignore_reservation: bool = False) -> AddResult:
        """Try to admit a waiting request whose fill_ids/prefix_indices/last_node were just
        matched. On success its last_node is locked (kept until it finishes) and, if it had to
        be truncated to the chunk budget, it becomes `new_chunked_req`. Truncated only when
        the batch is empty or a whole chunk could not hold it: otherwise OTHER (module doc).

        Args:
            ignore_reservation: admit even if the output reservation does not fit (used only
                when nothing else runs, so the queue cannot stall); the extend must still fit.
        """
        extend = req.extend_input_len
        reserve = remaining_new_tokens(req)
        need = extend + (0 if ignore_reservation else reserve)
        if not ignore_reservation and need >= self.rem_total_tokens:
            return AddResult.NO_TOKEN
        if extend > self.rem_input_tokens and self.can_run_list:
            return AddResult.OTHER
        if (self.can_run_list and self.rem_chunk_tokens is not None
                and self.rem_chunk_tokens < extend <= self.chunk_size):
            return AddResult.OTHER  # whole in the next batch rather than split (module doc)
        # Lock tentatively: locking the prefix takes its tokens out of the evictable budget.
        delta = self.tree_cache.inc_lock_ref(req.last_node)
        self.rem_total_tokens += delta
        self.capacity += delta
        chunk = self.rem_chunk_tokens
        fits_total = ignore_reservation or need <= self.rem_total_tokens
        if chunk is None or extend <= chunk:
            ok = fits_total and extend <= self.capacity
            trunc = extend
        else:
            trunc = min(chunk, int(self.capacity))
            ok = trunc > 0 and (ignore_reservation or trunc < self.rem_total_tokens)
        if not ok:
            delta = self.tree_cache.dec_lock_ref(req.last_node)
            self.rem_total_tokens += delta
            self.capacity += delta
            return AddResult.NO_TOKEN
        self.can_run_list.append(req)
        if trunc < extend:
            req.extend_input_len = trunc
            req.fill_ids = req.fill_ids[:_prefix_len(req) + trunc]
            self.new_chunked_req = req
            self._take(trunc, 0)
        else:
            self._take(extend, reserve)
        return AddResult.ADDED


__all__ = ["AddResult", "CLIP_MAX_NEW_TOKENS", "PrefillAdder", "SchedulePolicy",
           "remaining_new_tokens"]
