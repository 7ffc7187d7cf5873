"""`Scheduler`: continuous batching over the request pools (SGLang v0.3 loop, prefill first).

Owns the waiting queue, the running (decoding) requests and the in-flight chunked prefill, and
decides each step's `ScheduleBatch`. Requests come from the engine (`add_request`,
`abort_request`); batches go to the engine, which runs the model, appends sampled tokens and hands
the batch back through `process_batch_result`. Memory: rows from `ReqToTokenPool`, slots from
`TokenToKVPoolAllocator`, shared prefixes from the prefix cache (`RadixCache` or `ChunkCache`).

Where a request's slots are, between batches:

| state                 | row | slots row[0:prefix]     | slots row[prefix:kv_len] | lock      |
|-----------------------|-----|-------------------------|--------------------------|-----------|
| waiting / retracted   | no  | -                       | -                        | no        |
| running / chunked     | yes | prefix cache (locked)   | the request              | last_node |
| jumping               | yes | prefix cache (locked)   | the request              | last_node |
| finished / aborted    | no  | handed to the cache by `cache_finished_req`          | released  |

`kv_len` (tokens whose slot is in the row) is tracked here per request id. A running request
lags its KV by one token (the last sampled one); a *jumping* one (`start_jump`: the engine
appended tokens its grammar forces) lags by more, and its next batch is an EXTEND of the lagging
tokens on top of its own row, which samples its next token (jump-forward, SGLang v0.3).
"""

from __future__ import annotations

from typing import Any

import torch

from mla_backend.config import SchedulerConfig
from mla_backend.forward_batch import ForwardMode
from mla_backend.mem_cache.chunk_cache import ChunkCache
from mla_backend.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from mla_backend.request import FinishReason, Req
from mla_backend.scheduler.schedule_batch import ScheduleBatch
from mla_backend.scheduler.schedule_policy import AddResult, PrefillAdder, SchedulePolicy

INIT_NEW_TOKEN_RATIO = 0.7  # reservation ratio after idle (times schedule_conservativeness)
BASE_MIN_NEW_TOKEN_RATIO = 0.1  # floor (times schedule_conservativeness)
NEW_TOKEN_RATIO_DECAY = 0.001  # per decode step
RETRACT_DECODE_STEPS = 20  # retraction keeps room for this many decode steps of the survivors
# With `prefill_min_free_rows` > 1, the longest run of decode steps a waiting request can be
# held back for while fewer rows than that are free.
PREFILL_MAX_DELAY_STEPS = 64


class Scheduler:
    """Continuous-batching scheduler; not thread-safe (the engine thread only).

    Args:
        config: policy and batch limits.
        cache_enabled: the prefix cache is a RadixCache (True) or a ChunkCache (False).
        req_to_token_pool, allocator: the pools of the model runner.
        tree_cache: RadixCache or ChunkCache over those pools.
        max_running_requests: cap on requests holding a row at once (clamped to the row count).
        context_len: longest sequence (prompt + output) a request may reach.
    """

    def __init__(self, config: SchedulerConfig, cache_enabled: bool,
                 req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator,
                 tree_cache: Any, max_running_requests: int, context_len: int):
        self.config = config
        self.cache_enabled = cache_enabled
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.max_running_requests = max(1, min(max_running_requests, req_to_token_pool.size))
        self.context_len = min(context_len, req_to_token_pool.max_context_len)
        self.policy = SchedulePolicy(config.schedule_policy, cache_enabled)
        cons = config.schedule_conservativeness
        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * cons, 1.0)
        self.min_new_token_ratio = min(BASE_MIN_NEW_TOKEN_RATIO * cons, 1.0)
        self.new_token_ratio = self.init_new_token_ratio

        self.waiting: list[Req] = []
        self.running: list[Req] = []  # decoding requests
        self.chunked_req: Req | None = None  # prefilled in chunks; not decoding yet
        self.jumping: list[Req] = []  # running requests whose next batch extends forced tokens
        self.num_jumps = 0  # requests run in jump-forward EXTEND batches
        # Handed out, results not processed yet, oldest first: at most two, and then the older
        # is a DECODE batch (the engine's overlap schedule builds the next batch while it runs).
        self._batches: list[ScheduleBatch] = []
        self._kv_len: dict[str, int] = {}  # rid -> tokens whose slot is in the request's row
        # rids ended outside a batch result (aborted, or a stop string found after the batch
        # was handed back): released at the next batch boundary or with their outstanding batch
        self._abort_marked: set[str] = set()
        self._admitted_once: set[str] = set()  # rids whose cached_tokens is final
        self._rejected: list[Req] = []
        self.num_retractions = 0
        self._decode_steps_waited = 0  # consecutive decode steps a prefill was held back for

    # ------------------------------------------------------------------ queue state
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Requests holding a row: decoding, in-flight chunked, or just admitted."""
        return len(self._holders())

    def has_work(self) -> bool:
        """Requests waiting, holding a row, or a batch not processed yet (no per-request work:
        the engine asks every step)."""
        return bool(self.waiting or self.running or self._batches or self.jumping
                    or self.chunked_req is not None)

    def _holders(self) -> list[Req]:
        out: dict[int, Req] = {id(r): r for r in self.running}
        out.update((id(r), r) for r in self.jumping)
        if self.chunked_req is not None:
            out[id(self.chunked_req)] = self.chunked_req
        for batch in self._batches:  # those not released yet (overlap: a request of the
            # newer batch may have been released with the older one's results)
            out.update((id(r), r) for r in batch.reqs if r.rid in self._kv_len)
        return list(out.values())

    # ------------------------------------------------------------------ requests in / out
    def add_request(self, req: Req) -> None:
        """Queue a request (its prompt must be non-empty)."""
        if not req.origin_input_ids:
            raise ValueError(f"request {req.rid} has an empty prompt")
        self.waiting.append(req)

    def abort_request(self, rid: str) -> Req | None:
        """Abort by id. A waiting request is removed now; a running one is marked and released
        (slots, row, lock) at the next batch boundary. Sets finished_reason ABORT. Returns the
        Req, or None if unknown, already finished or already aborted."""
        return self._end(rid, FinishReason.ABORT)

    def finish_request(self, rid: str) -> Req | None:
        """A request the engine ended outside a batch result (overlap schedule: a stop string
        found after its batch was handed back): released like an aborted one, at the next batch
        boundary or with the outstanding batch that holds it; finished_reason stays as set
        (STOP if unset). Returns the Req, or None if unknown or already released."""
        return self._end(rid, FinishReason.STOP)

    def _end(self, rid: str, reason: FinishReason) -> Req | None:
        for i, req in enumerate(self.waiting):
            if req.rid == rid:
                del self.waiting[i]
                self._admitted_once.discard(rid)
                req.finished_reason = req.finished_reason or reason
                return req
        if rid in self._abort_marked:
            return None
        for req in self._holders():
            if req.rid == rid:
                self._abort_marked.add(rid)
                req.finished_reason = req.finished_reason or reason
                return req
        return None

    def take_rejected(self) -> list[Req]:
        """Requests the scheduler finished on its own, already released: ABORT when the prompt
        can never fit the pool or a row, LENGTH when the pool or the row ran out while it was
        the only decoding request. The engine reports them."""
        out, self._rejected = self._rejected, []
        return out

    # ------------------------------------------------------------------ batches
    def get_next_batch(self) -> ScheduleBatch | None:
        """Next batch: an EXTEND batch if any waiting request (or the chunked one) can be
        admitted, else a DECODE batch of the running requests, else None.

        Overlap schedule: may be called while one DECODE batch is outstanding (its results not
        processed). Its sampled requests must then have `num_inflight_tokens` 1: a new DECODE
        batch takes their next position, lists them in `future_rows`, and leaves out those
        whose in-flight token is certainly their last (max_tokens or the context length).
        The caller must not let that happen when this step could retract
        (`decode_may_retract`).

        Raises:
            RuntimeError: an EXTEND batch or two batches are outstanding.
        """
        if len(self._batches) >= 2 or (self._batches and not self._batches[0].is_decode()):
            raise RuntimeError("get_next_batch: the previous batch has not been processed")
        self._release_marked()
        batch = None
        if self.jumping:
            batch = self._build_jump_extend()
        if batch is None and (self.chunked_req is not None
                              or (self.waiting and not self._hold_prefill())):
            batch = self._get_new_batch_prefill()
        if batch is None and self.running:
            batch = self._get_new_batch_decode()
        if batch is None and not self.running and self.chunked_req is None:
            self.new_token_ratio = self.init_new_token_ratio  # idle
        if batch is not None:
            self._batches.append(batch)
        return batch

    def decode_may_retract(self) -> bool:
        """True when the next decode batch might not find one free or evictable slot per
        running request (`_ensure_decode_slots` would retract): the overlap schedule then
        processes the outstanding batch before building the next."""
        return (self.allocator.available_size() + self.tree_cache.evictable_size()
                < len(self.running))

    def start_jump(self, req: Req) -> None:
        """Jump-forward: the engine appended tokens the request's grammar forces to its
        output_ids (its KV now lags by more than one token); its next batch is an EXTEND of
        them instead of a decode step. Call after `process_batch_result` of the batch that
        sampled its last token, with no outstanding batch holding it. A request that is not
        running (ended, aborted, released) is left alone."""
        if req.finished_reason is not None or req.rid in self._abort_marked:
            return
        for i, r in enumerate(self.running):
            if r is req:
                del self.running[i]
                self.jumping.append(req)
                return

    def _build_jump_extend(self) -> ScheduleBatch | None:
        """An EXTEND batch of the jumping requests: each computes the KV of the tokens past
        its `kv_len` (its last sampled token and the forced ones) on top of its own row and
        samples its next token. Without room for their slots they are retracted (recomputed
        from the waiting queue, which keeps their output). None when no request is left."""
        reqs, self.jumping = self.jumping, []
        kv_len = self._kv_len
        need = sum(r.seqlen - kv_len[r.rid] for r in reqs)
        if self.allocator.available_size() + self.tree_cache.evictable_size() < need:
            for req in reqs:
                self._free_for_recompute(req)
            self.num_retractions += len(reqs)
            self.waiting = reqs + self.waiting
            return None
        starts = [kv_len[r.rid] for r in reqs]
        for req, start in zip(reqs, starts):
            req.fill_ids = req.origin_input_ids + req.output_ids
            req.extend_input_len = len(req.fill_ids) - start
        self.num_jumps += len(reqs)
        return self._extend_batch(reqs, starts, [True] * len(reqs))

    def _hold_prefill(self) -> bool:
        """True when this step should decode instead of admitting waiting requests: requests
        are decoding, fewer than `prefill_min_free_rows` rows are free, not every waiting
        request fits them, and the queue has waited fewer than PREFILL_MAX_DELAY_STEPS
        decode steps. Counts the held-back steps."""
        free = self.max_running_requests - len(self.running)
        if (not self.running or free >= self.config.prefill_min_free_rows
                or len(self.waiting) <= free
                or self._decode_steps_waited >= PREFILL_MAX_DELAY_STEPS):
            self._decode_steps_waited = 0
            return False
        self._decode_steps_waited += 1
        return True

    def process_batch_result(self, batch: ScheduleBatch, finished: list[bool],
                             failed: bool = False) -> None:
        """After the engine ran `batch`, appended sampled tokens (where sample_mask is True) and
        decided `finished` [bs]: frees finished/aborted requests into the prefix cache, caches
        prefilled KV of unfinished ones, merges new requests into the running set.

        Args:
            failed: the forward pass raised: every request of the batch is released (finish
                reason ABORT unless set) and the KV this batch was writing is discarded, not
                cached (it may be partly written).
        Raises:
            ValueError: `batch` is not the outstanding batch or `finished` has the wrong length.
        """
        if not self._batches or batch is not self._batches[0]:
            raise ValueError("process_batch_result: not the oldest batch returned by "
                             "get_next_batch")
        if len(finished) != len(batch.reqs):
            raise ValueError(f"process_batch_result: {len(finished)} flags for "
                             f"{len(batch.reqs)} requests")
        self._batches.pop(0)
        if failed:
            gone = {id(r) for r in batch.reqs}
            for req, prefix_len in zip(batch.reqs, batch.prefix_lens):
                if req is self.chunked_req:
                    self.chunked_req = None
                req.finished_reason = req.finished_reason or FinishReason.ABORT
                if req.rid in self._kv_len:  # not released with an older batch
                    self._release(req, valid_kv_len=prefix_len)
            self.running = [r for r in self.running if id(r) not in gone]
        elif batch.forward_mode.is_extend():
            for req, fin in zip(batch.reqs, finished):
                if fin or req.rid in self._abort_marked:
                    if req is self.chunked_req:
                        self.chunked_req = None
                    self._release(req)
                elif req is self.chunked_req:
                    self.tree_cache.cache_unfinished_req(req)
                else:
                    req.is_chunked = 0
                    if self.cache_enabled:
                        self.tree_cache.cache_unfinished_req(req)
                    self.running.append(req)
        else:
            marked = self._abort_marked
            done = [r for r, fin in zip(batch.reqs, finished) if fin or r.rid in marked]
            if done:
                for req in done:
                    if req.rid in self._kv_len:  # (overlap: released once)
                        self._release(req)
                gone = {id(r) for r in done}
                self.running = [r for r in self.running if id(r) not in gone]
        self._release_marked()

    # ------------------------------------------------------------------ extend
    def _prepare(self, req: Req) -> None:
        """Match a waiting request's cached prefix (at most len - 1 tokens: >= 1 recomputed)."""
        req.fill_ids = req.origin_input_ids + req.output_ids
        match = self.tree_cache.match_prefix(req.fill_ids[:-1])
        req.prefix_indices, req.last_node = match.device_indices, match.last_node
        req.extend_input_len = len(req.fill_ids) - int(match.device_indices.numel())

    def _can_ever_fit(self, req: Req) -> bool:
        n = len(req.origin_input_ids) + len(req.output_ids)
        return n <= self.allocator.size and n <= self.context_len

    def _get_new_batch_prefill(self) -> ScheduleBatch | None:
        n_running = len(self.running)
        if self.chunked_req is None and (not self.waiting
                                         or n_running >= self.max_running_requests):
            return None
        lpm = self.policy.effective(len(self.waiting)) == "lpm"
        if lpm:  # lpm orders by the cached prefix: match everyone; fcfs matches lazily
            for req in self.waiting:
                self._prepare(req)
        order = self.policy.sort(self.waiting)
        adder = PrefillAdder(
            self.tree_cache, self.running, self.new_token_ratio,
            self.allocator.available_size() + self.tree_cache.evictable_size(),
            self.config.max_prefill_tokens, self.config.chunked_prefill_size)
        cont = self.chunked_req
        if cont is not None:
            if not adder.add_chunked_req(cont):
                return None  # no room for its next chunk: let running requests decode
            n_running += 1
        rows_free = self.req_to_token_pool.available_size()
        admitted_new = 0
        for req in order:
            if n_running + admitted_new >= self.max_running_requests or rows_free <= 0:
                break
            if adder.budget_exhausted() or adder.new_chunked_req is not None:
                break
            if not self._can_ever_fit(req):
                self._reject(req, FinishReason.ABORT)
                continue
            if not lpm:
                self._prepare(req)
            if adder.add_one_req(req) is not AddResult.ADDED:
                break
            admitted_new += 1
            rows_free -= 1
        if not adder.can_run_list and not self.running and cont is None:
            # Nothing runs, so nothing will free memory: never stall the queue.
            for req in order:
                if not self._can_ever_fit(req):
                    self._reject(req, FinishReason.ABORT)
                    continue
                self._prepare(req)
                adder.add_one_req(req, ignore_reservation=True)
                break
        if not adder.can_run_list:
            return None
        return self._build_extend(adder)

    def _build_extend(self, adder: PrefillAdder) -> ScheduleBatch:
        reqs = adder.can_run_list
        admitted = {id(r) for r in reqs}
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        pool = self.req_to_token_pool
        prefix_lens, sample_mask = [], []
        for req in reqs:
            prefix_len = int(req.prefix_indices.numel()) if req.prefix_indices is not None else 0
            if req.req_pool_idx is None:
                row = pool.alloc(1)
                assert row is not None, "admission checked free rows"
                req.req_pool_idx = row[0]
            if req.rid not in self._admitted_once:
                self._admitted_once.add(req.rid)
                req.cached_tokens = min(prefix_len, len(req.origin_input_ids))
            assert len(req.fill_ids) - prefix_len == req.extend_input_len > 0
            if prefix_len:
                pool.write_row(req.req_pool_idx, 0, req.prefix_indices)
            prefix_lens.append(prefix_len)
            last_chunk = req is not adder.new_chunked_req
            req.is_chunked = 0 if last_chunk else 1
            sample_mask.append(last_chunk)
        self.chunked_req = adder.new_chunked_req
        return self._extend_batch(list(reqs), prefix_lens, sample_mask)

    def _extend_batch(self, reqs: list[Req], prefix_lens: list[int],
                      sample_mask: list[bool]) -> ScheduleBatch:
        """The EXTEND batch computing `req.fill_ids[prefix_len:]` of each request on top of
        its row's first prefix_len slots: new slots for those tokens go into the rows and
        `kv_len` becomes len(fill_ids)."""
        slots = self._alloc_slots(sum(len(r.fill_ids) - p for r, p in zip(reqs, prefix_lens)))
        input_ids: list[int] = []
        positions: list[int] = []
        rows, seq_lens, extend_lens = [], [], []
        off = 0
        for req, prefix_len in zip(reqs, prefix_lens):
            seq_len = len(req.fill_ids)
            ext = seq_len - prefix_len
            self.req_to_token_pool.write_row(req.req_pool_idx, prefix_len, slots[off:off + ext])
            off += ext
            self._kv_len[req.rid] = seq_len
            input_ids.extend(req.fill_ids[prefix_len:])
            positions.extend(range(prefix_len, seq_len))
            rows.append(req.req_pool_idx)
            seq_lens.append(seq_len)
            extend_lens.append(ext)
        return ScheduleBatch(ForwardMode.EXTEND, reqs, input_ids, positions, rows, seq_lens,
                             prefix_lens, extend_lens, slots, sample_mask)

    def _alloc_slots(self, n: int) -> torch.Tensor:
        short = n - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)
        out = self.allocator.alloc(n)
        if out is None:
            raise RuntimeError(f"scheduler: {n} slots admitted but only "
                               f"{self.allocator.available_size()} obtainable")
        return out

    # ------------------------------------------------------------------ decode
    def _get_new_batch_decode(self) -> ScheduleBatch | None:
        self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY,
                                   self.min_new_token_ratio)
        ctx = self.context_len
        for req in [r for r in self.running if len(r.origin_input_ids) + len(r.output_ids) > ctx]:
            self.running.remove(req)
            self._reject(req, FinishReason.LENGTH)
        self._ensure_decode_slots()
        if not self.running:
            return None
        # One pass over the running requests (per-request host time bounds the decode step at
        # large batches: issue 6). With overlap, requests already ended (a stop string found
        # late, an abort: the outstanding batch's results release them) and those whose
        # in-flight token is certainly their last are left out.
        overlap = bool(self._batches)
        kv_len = self._kv_len
        reqs: list[Req] = []
        future: list[int] = []
        input_ids, positions, rows, seq_lens = [], [], [], []
        # (a request's KV length is its tokens less the one it decodes now: `_kv_len` gives
        # its position, without counting its lists)
        for req in self.running:
            rid = req.rid
            pos = kv_len[rid]
            if req.num_inflight_tokens:  # its input token is the one still on the GPU
                if overlap and (req.finished_reason is not None or req.jump_pending
                                or len(req.output_ids) + 1 >= req.sampling_params.max_new_tokens
                                or pos + 1 >= ctx):
                    continue
                future.append(len(reqs))
                input_ids.append(0)
            else:
                if overlap and req.finished_reason is not None:
                    continue
                out_ids = req.output_ids
                input_ids.append(out_ids[-1] if out_ids else req.origin_input_ids[-1])
            kv_len[rid] = pos + 1
            reqs.append(req)
            positions.append(pos)
            rows.append(req.req_pool_idx)
            seq_lens.append(pos + 1)
        if not reqs:
            return None
        try:
            slots = self._alloc_slots(len(reqs))
        except RuntimeError:  # (cannot happen after _ensure_decode_slots) undo the KV lengths
            for req, seq_len in zip(reqs, seq_lens):
                kv_len[req.rid] = seq_len - 1
            raise
        self.req_to_token_pool.write_positions(rows, positions, slots)
        n = len(reqs)
        return ScheduleBatch(ForwardMode.DECODE, reqs, input_ids, positions, rows, seq_lens,
                             list(positions), [1] * n, slots, [True] * n, future_rows=future)

    def _ensure_decode_slots(self) -> None:
        """Make one free slot per running request: evict, else retract, else (a lone request
        that filled the pool) finish it with LENGTH."""
        need = len(self.running)
        if self.allocator.available_size() < need:
            self.tree_cache.evict(need - self.allocator.available_size())
        if self.allocator.available_size() >= len(self.running):
            return
        self._retract()
        short = len(self.running) - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)
        if self.allocator.available_size() < len(self.running):
            for req in list(self.running):
                self.running.remove(req)
                self._reject(req, FinishReason.LENGTH)

    def _retract(self) -> None:
        """Requeue requests for recompute until the survivors have room for
        RETRACT_DECODE_STEPS decode steps (keeping >= 1): the in-flight chunked prefill first,
        then fewest output tokens first, ties → longest prompt."""
        victims = sorted(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        if self.chunked_req is not None:
            victims.insert(0, self.chunked_req)
        retracted: list[Req] = []

        def room() -> int:
            return self.allocator.available_size() + self.tree_cache.evictable_size()

        for victim in victims:
            if room() >= len(self.running) * RETRACT_DECODE_STEPS:
                break
            if victim is self.chunked_req:
                self.chunked_req = None
            else:
                if len(self.running) <= 1:
                    break
                self.running.remove(victim)
            self._free_for_recompute(victim)
            retracted.append(victim)
        if retracted:
            self.num_retractions += len(retracted)
            self.waiting = retracted + self.waiting
            decoded = sum(len(r.output_ids) for r in self.running)
            max_new = sum(r.sampling_params.max_new_tokens for r in self.running)
            if max_new > 0:
                ratio = (decoded + RETRACT_DECODE_STEPS * len(self.running)) / max_new
                self.new_token_ratio = min(1.0, ratio)

    def _free_for_recompute(self, req: Req) -> None:
        """Give back everything a retracted request holds; it keeps its output_ids."""
        kv_len = self._kv_len.pop(req.rid)
        row = req.req_pool_idx
        assert row is not None
        if isinstance(self.tree_cache, ChunkCache):
            self.tree_cache.cache_finished_req(req, kv_len)  # frees all: nothing is shared
        else:
            prefix_len = int(req.prefix_indices.numel()) if req.prefix_indices is not None else 0
            self.allocator.free(self.req_to_token_pool.read_row(row, prefix_len, kv_len))
            self.req_to_token_pool.free(row)
            self.tree_cache.dec_lock_ref(req.last_node)
        req.req_pool_idx, req.prefix_indices, req.last_node = None, None, None
        req.fill_ids, req.extend_input_len, req.is_chunked = [], 0, 0

    # ------------------------------------------------------------------ release
    def _release(self, req: Req, valid_kv_len: int | None = None) -> None:
        """Hand a finished or aborted request's KV to the prefix cache (exactly once); slots
        beyond `valid_kv_len` (default: all its tokens) are freed, not cached."""
        kv_len = self._kv_len.pop(req.rid)
        keep = min(kv_len, req.seqlen, kv_len if valid_kv_len is None else valid_kv_len)
        if kv_len > keep:  # output trimmed after its KV was computed
            self.allocator.free(self.req_to_token_pool.read_row(req.req_pool_idx, keep, kv_len))
        self.tree_cache.cache_finished_req(req, keep)
        req.is_chunked = 0
        self._abort_marked.discard(req.rid)
        self._admitted_once.discard(req.rid)

    def _release_marked(self) -> None:
        """Release aborted requests that are not part of an outstanding batch."""
        if not self._abort_marked:
            return
        in_batch = {id(r) for b in self._batches for r in b.reqs}
        for req in list(self.running):
            if req.rid in self._abort_marked and id(req) not in in_batch:
                self.running.remove(req)
                self._release(req)
        for req in [r for r in self.jumping if r.rid in self._abort_marked]:
            self.jumping.remove(req)
            self._release(req)
        cr = self.chunked_req
        if cr is not None and cr.rid in self._abort_marked and id(cr) not in in_batch:
            self.chunked_req = None
            self._release(cr)

    def _reject(self, req: Req, reason: FinishReason) -> None:
        if req.req_pool_idx is not None:
            self._release(req)
        else:
            self.waiting = [r for r in self.waiting if r is not req]
            self._admitted_once.discard(req.rid)
            req.prefix_indices, req.last_node = None, None
        req.finished_reason = reason
        self._rejected.append(req)

    # ------------------------------------------------------------------ checks
    def check_invariant(self) -> None:
        """free + evictable + protected + slots held only by requests == pool size, and every
        row is either free or held by exactly one request.

        Raises:
            AssertionError: with the numbers, when the accounting does not add up.
        """
        holders = self._holders()
        held = 0
        for req in holders:
            prefix = int(req.prefix_indices.numel()) if req.prefix_indices is not None else 0
            held += self._kv_len[req.rid] - prefix
        free = self.allocator.available_size()
        ev, prot = self.tree_cache.evictable_size(), self.tree_cache.protected_size()
        total = free + ev + prot + held
        if total != self.allocator.size:
            raise AssertionError(
                f"KV slot leak: free {free} + evictable {ev} + protected {prot} + request-held "
                f"{held} = {total} != pool size {self.allocator.size}")
        rows_free = self.req_to_token_pool.available_size()
        if rows_free + len(holders) != self.req_to_token_pool.size or \
                len(self._kv_len) != len(holders):
            raise AssertionError(
                f"row leak: free rows {rows_free} + holders {len(holders)} != "
                f"{self.req_to_token_pool.size} (tracked {len(self._kv_len)})")


__all__ = ["Scheduler"]
