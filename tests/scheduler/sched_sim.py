"""A model-free engine loop for scheduler tests.

The fake "KV pool" stores, per slot, the (token id, position) written there by the batch that
computed it. The fake "model" reads a request's whole sequence back through its req_to_token row
and samples `next_token(sequence)`, a hash of the full sequence: a wrong slot, a slot freed and
reused while still referenced, or a retraction that loses tokens changes every later output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mla_backend.config import SchedulerConfig
from mla_backend.mem_cache.chunk_cache import ChunkCache
from mla_backend.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from mla_backend.mem_cache.radix_cache import RadixCache
from mla_backend.request import FinishReason, Req, SamplingParams
from mla_backend.scheduler.schedule_batch import ScheduleBatch
from mla_backend.scheduler.scheduler import Scheduler

VOCAB = 53
STOP_ID = 0  # the fake model's EOS


def next_token(seq: list[int]) -> int:
    """Deterministic 'model': a hash of the whole sequence."""
    h = 1469598103934665603
    for t in seq:
        h = ((h ^ (t + 1)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return (h >> 17) % VOCAB


def expected_output(prompt: list[int], max_new: int) -> list[int]:
    seq, out = list(prompt), []
    while len(out) < max_new:
        t = next_token(seq)
        out.append(t)
        seq.append(t)
        if t == STOP_ID:
            break
    return out


@dataclass
class Sim:
    radix: bool
    chunk: int
    policy: str
    pool_size: int
    max_running: int
    max_prefill: int
    rows: int = 8
    context_len: int = 256
    append_for_aborted: bool = False
    conservativeness: float = 1.0  # small values make admission optimistic: forces retraction
    min_free_rows: int = 1  # SchedulerConfig.prefill_min_free_rows
    stats: dict = field(default_factory=lambda: {"extend": 0, "decode": 0, "chunked": 0})

    def __post_init__(self) -> None:
        self.r2t = ReqToTokenPool(self.rows, self.context_len + 8)
        self.alloc = TokenToKVPoolAllocator(self.pool_size)
        cache_cls = RadixCache if self.radix else ChunkCache
        self.tree = cache_cls(self.r2t, self.alloc)
        cfg = SchedulerConfig(schedule_policy=self.policy, chunked_prefill_size=self.chunk,
                              max_prefill_tokens=self.max_prefill,
                              max_running_requests=self.max_running,
                              schedule_conservativeness=self.conservativeness,
                              prefill_min_free_rows=self.min_free_rows)
        self.sched = Scheduler(cfg, self.radix, self.r2t, self.alloc, self.tree,
                               self.max_running, self.context_len)
        self.kv: list[tuple[int, int] | None] = [None] * (self.pool_size + 1)
        # A freed slot forgets its content: a row still pointing at it then fails the read-back.
        real_free = self.alloc.free

        def free_and_forget(t):
            for s in t.reshape(-1).tolist():
                self.kv[s] = None
            real_free(t)

        self.alloc.free = free_and_forget  # type: ignore[method-assign]

    def make_req(self, rid: str, prompt: list[int], max_new: int) -> Req:
        return Req(rid=rid, origin_input_ids=list(prompt),
                   sampling_params=SamplingParams(max_new_tokens=max_new))

    def step(self) -> ScheduleBatch | None:
        """One engine step; checks the invariant before and after the batch."""
        batch = self.sched.get_next_batch()
        self.sched.check_invariant()
        if batch is None:
            return None
        finished = self.run(batch)
        self.sched.process_batch_result(batch, finished)
        self.sched.check_invariant()
        return batch

    def run(self, batch: ScheduleBatch) -> list[bool]:
        """Check the batch, write the fake KV, read every sequence back and sample."""
        self.stats["extend" if batch.is_extend() else "decode"] += 1
        self.stats["chunked"] += sum(not m for m in batch.sample_mask)
        out_loc = batch.out_cache_loc.tolist()
        assert len(out_loc) == len(batch.input_ids) == len(batch.positions)
        assert len(set(out_loc)) == len(out_loc) and 0 not in out_loc
        off, rows = 0, []
        for i, req in enumerate(batch.reqs):
            toks = req.origin_input_ids + req.output_ids
            pre, ext, sl = batch.prefix_lens[i], batch.extend_lens[i], batch.seq_lens[i]
            assert sl == pre + ext and ext >= 1 and sl <= len(toks)
            assert batch.req_pool_indices[i] == req.req_pool_idx
            assert batch.input_ids[off:off + ext] == toks[pre:sl]
            assert batch.positions[off:off + ext] == list(range(pre, sl))
            row = self.r2t.req_to_token[req.req_pool_idx, :sl].tolist()
            assert row[pre:sl] == out_loc[off:off + ext]
            for j in range(pre, sl):
                self.kv[row[j]] = (toks[j], j)
            rows.append(row)
            off += ext
        finished = []
        for i, req in enumerate(batch.reqs):
            row, sl = rows[i], batch.seq_lens[i]
            assert 0 not in row, f"{req.rid}: sink slot in row"
            seq = []
            for j, slot in enumerate(row):
                cell = self.kv[slot]
                assert cell is not None and cell[1] == j, f"{req.rid}: slot {slot} pos {j} {cell}"
                seq.append(cell[0])
            toks = req.origin_input_ids + req.output_ids
            assert seq == toks[:sl], f"{req.rid}: KV read back differs from its tokens"
            aborted = req.finished_reason is FinishReason.ABORT
            if not batch.sample_mask[i] or (aborted and not self.append_for_aborted):
                finished.append(False)
                continue
            tok = next_token(seq)
            req.output_ids.append(tok)
            if tok == STOP_ID:
                req.finished_reason = req.finished_reason or FinishReason.STOP
            elif len(req.output_ids) >= req.sampling_params.max_new_tokens:
                req.finished_reason = req.finished_reason or FinishReason.LENGTH
            finished.append(req.finished_reason in (FinishReason.STOP, FinishReason.LENGTH))
        return finished

    def drained(self) -> bool:
        return (self.alloc.available_size() + self.tree.evictable_size() == self.pool_size
                and self.tree.protected_size() == 0 and self.r2t.available_size() == self.rows)
