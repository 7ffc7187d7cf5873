"""The tensor-parallel step message (`tp_workers.encode_step` / `decode_step`) and the write
record of rank 0's `ReqToTokenPool` (`track_writes` / `take_writes`), on the CPU.

A worker that applies each message's writes must hold the same `req_to_token` table as rank 0,
whatever rank 0 wrote between messages: the rows of the batch (an extend's prefix and new slots,
a decode's new slot) and later rewrites of earlier rows (the radix cache swaps a request's
duplicate slots for the tree's after a prefill), a cell written twice keeping its last value.
It must also build its batch from the very ints rank 0 built its own from. Random sequences of
such writes and messages (hypothesis).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_backend.forward_batch import ForwardBatch, ForwardMode
from mla_backend.mem_cache.memory_pool import ReqToTokenPool, expand_writes
from mla_backend.model_executor.tp_workers import (apply_req_to_token_writes, decode_step,
                                                   encode_step)

ROWS, CONTEXT = 16, 64


def _slots(n: int) -> torch.Tensor:
    return torch.randint(1, 1 << 30, (n,), dtype=torch.int64)


def _batch(pool: ReqToTokenPool, mode: ForwardMode, rows: list[int], prefix: list[int],
           ext: list[int], with_host_copy: bool) -> ForwardBatch:
    """Writes the batch's rows as the scheduler does, then builds its `ForwardBatch`."""
    seq = [p + e for p, e in zip(prefix, ext)]
    if mode.is_decode():
        new = _slots(len(rows))
        pool.write_positions(rows, [s - 1 for s in seq], new)
        loc = new.tolist()
    else:
        loc = []
        for r, p, e in zip(rows, prefix, ext):
            if p:
                pool.write_row(r, 0, _slots(p))  # the matched prefix
            new = _slots(e)
            pool.write_row(r, p, new)
            loc += new.tolist()
    ids = torch.randint(0, 50_000, (sum(ext),)).tolist()
    pos = [c for p, s in zip(prefix, seq) for c in range(p, s)]
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    host = t(ids + pos + loc + rows + seq)  # as ModelRunner.make_forward_batch packs them
    return ForwardBatch(forward_mode=mode, batch_size=len(rows), input_ids=t(ids),
                        positions=t(pos), req_pool_indices=t(rows), seq_lens=t(seq),
                        out_cache_loc=t(loc), seq_lens_cpu=seq, extend_prefix_lens_cpu=prefix,
                        extend_seq_lens_cpu=ext, req_to_token_pool=pool, token_to_kv_pool=None,
                        attn_backend=None, return_all_logits=len(rows) % 2 == 1,
                        host_packed=host if with_host_copy else None)


@st.composite
def batches(draw):
    decode = draw(st.booleans())
    rows = draw(st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=8, unique=True))
    n = len(rows)
    if decode:
        prefix = draw(st.lists(st.integers(0, CONTEXT - 2), min_size=n, max_size=n))
        ext = [1] * n
    else:
        prefix = draw(st.lists(st.one_of(st.just(0), st.integers(0, CONTEXT // 2)),
                               min_size=n, max_size=n))
        ext = draw(st.lists(st.integers(1, CONTEXT // 2 - 1), min_size=n, max_size=n))
    mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
    return "batch", mode, rows, prefix, ext, draw(st.booleans())


@st.composite
def rewrites(draw):
    """A write outside any batch: `write_row` (the radix cache's swap) or `write_positions`."""
    row = draw(st.integers(0, ROWS - 1))
    start = draw(st.integers(0, CONTEXT - 1))
    n = draw(st.integers(0, CONTEXT - start))
    if draw(st.booleans()):
        return "row", row, start, n
    return "points", draw(st.lists(st.tuples(st.integers(0, ROWS - 1),
                                             st.integers(0, CONTEXT - 1)), max_size=6))


@settings(max_examples=120, deadline=None)
@given(st.lists(st.one_of(batches(), rewrites()), min_size=1, max_size=8),
       st.integers(0, 2**31 - 1))
def test_worker_table_and_batch_mirror_rank0(ops, seed):
    torch.manual_seed(seed)
    rank0, worker = ReqToTokenPool(ROWS, CONTEXT), ReqToTokenPool(ROWS, CONTEXT)
    rank0.track_writes()
    for op in ops:
        if op[0] == "row":
            rank0.write_row(op[1], op[2], _slots(op[3]))
            continue
        if op[0] == "points":
            rank0.write_positions([r for r, _ in op[1]], [c for _, c in op[1]],
                                  _slots(len(op[1])))
            continue
        _, mode, rows, prefix, ext, with_host_copy = op
        fb = _batch(rank0, mode, rows, prefix, ext, with_host_copy)
        batch, writes = decode_step(encode_step(fb))
        apply_req_to_token_writes(worker.req_to_token, writes)
        assert torch.equal(worker.req_to_token, rank0.req_to_token)
        assert batch["mode"] is mode and batch["return_all_logits"] is fb.return_all_logits
        assert batch["req_pool_indices"] == rows and batch["seq_lens"] == fb.seq_lens_cpu
        if mode.is_decode():  # make_forward_batch derives them
            assert batch["prefix_lens"] is None and batch["extend_lens"] is None
        else:
            assert batch["prefix_lens"] == prefix and batch["extend_lens"] == ext
        for key in ("input_ids", "positions", "out_cache_loc"):
            assert batch[key] == getattr(fb, key).tolist(), key


def test_a_cell_written_twice_carries_its_last_value():
    pool = ReqToTokenPool(ROWS, CONTEXT)
    pool.track_writes()
    pool.write_row(2, 0, torch.tensor([5, 6, 7]))
    pool.write_positions([2], [1], torch.tensor([9]))
    pool.write_row(2, 1, torch.tensor([8]))
    runs, run_slots, points = pool.take_writes()
    assert runs.tolist() == [[2, 0, 3], [2, 1, 1]] and run_slots.tolist() == [5, 8, 7, 8]
    assert points.tolist() == [[2], [1], [8]]
    assert expand_writes(runs, run_slots, points).tolist() == [[2, 2, 2, 2, 2], [0, 1, 2, 1, 1],
                                                               [5, 8, 7, 8, 8]]
    assert [t.numel() for t in pool.take_writes()] == [0, 0, 0]  # taken


def test_message_sizes():
    pool = ReqToTokenPool(ROWS, CONTEXT)
    pool.track_writes()
    cold = encode_step(_batch(pool, ForwardMode.EXTEND, [3, 5], [0, 0], [10, 7], True))
    warm = encode_step(_batch(pool, ForwardMode.EXTEND, [3, 5], [6, 20], [4, 7], True))
    decode = encode_step(_batch(pool, ForwardMode.DECODE, [3, 5, 9], [6, 20, 1], [1, 1, 1], True))
    # 56-byte header, 3 per-token and 4 per-request int64s (2 for a decode), then int32: 3 per
    # written run (row, start, n) and 1 per slot in it, 3 per written point (row, column, slot).
    assert len(cold) == 56 + 8 * (3 * 17 + 4 * 2) + 4 * (3 * 2 + 17)
    assert len(warm) == 56 + 8 * (3 * 11 + 4 * 2) + 4 * (3 * 4 + 37)
    assert len(decode) == 56 + 8 * (3 * 3 + 2 * 3) + 4 * 3 * 3


def test_a_truncated_message_and_an_untracked_pool_are_refused():
    pool = ReqToTokenPool(ROWS, CONTEXT)
    with pytest.raises(RuntimeError, match="track_writes"):
        pool.take_writes()
    pool.track_writes()
    msg = encode_step(_batch(pool, ForwardMode.EXTEND, [1, 2], [4, 0], [3, 5], True))
    for cut in (1, 4, 8 * 3):
        with pytest.raises(ValueError, match="does not fit its header"):
            decode_step(msg[:-cut])
