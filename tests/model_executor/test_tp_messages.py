"""The tensor-parallel step message (`tp_workers.encode_step` / `decode_step`) on the CPU.

A worker that applies the decoded `req_to_token` writes must hold, for every request of the
batch, the same row [0, seq_len) as rank 0, and must build its batch from the same ints rank 0
built its own from. Random batches (hypothesis): extends with and without cached prefixes, and
decodes whose rows already hold the earlier tokens (as after the previous steps).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_backend.forward_batch import ForwardBatch, ForwardMode
from mla_backend.mem_cache.memory_pool import ReqToTokenPool
from mla_backend.model_executor.tp_workers import (apply_req_to_token_writes, decode_step,
                                                   encode_step)

ROWS, CONTEXT = 16, 64


def _batch(pool: ReqToTokenPool, mode: ForwardMode, rows: list[int], prefix: list[int],
           ext: list[int], with_host_copy: bool) -> ForwardBatch:
    seq = [p + e for p, e in zip(prefix, ext)]
    r2t = pool.req_to_token_host
    ids = [int(x) for x in torch.randint(0, 50_000, (sum(ext),))]
    pos = [c for p, s in zip(prefix, seq) for c in range(p, s)]
    loc = [int(r2t[r, c]) for r, p, s in zip(rows, prefix, seq) for c in range(p, s)]
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
    return (ForwardMode.DECODE if decode else ForwardMode.EXTEND), rows, prefix, ext, \
        draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(batches(), st.integers(0, 2**31 - 1))
def test_worker_mirrors_rank0_rows_and_batch(case, seed):
    mode, rows, prefix, ext, with_host_copy = case
    torch.manual_seed(seed)
    rank0, worker = ReqToTokenPool(ROWS, CONTEXT), ReqToTokenPool(ROWS, CONTEXT)
    rank0.req_to_token.copy_(torch.randint(0, 1 << 30, (ROWS, CONTEXT), dtype=torch.int32))
    worker.req_to_token.copy_(torch.randint(0, 1 << 30, (ROWS, CONTEXT), dtype=torch.int32))
    if mode.is_decode():  # the earlier steps already mirrored the row up to the new token
        for r, p in zip(rows, prefix):
            worker.req_to_token[r, :p] = rank0.req_to_token[r, :p]
    fb = _batch(rank0, mode, rows, prefix, ext, with_host_copy)
    before = worker.req_to_token.clone()

    batch, writes = decode_step(encode_step(fb))
    apply_req_to_token_writes(worker.req_to_token, writes)

    touched = torch.zeros_like(before, dtype=torch.bool)
    for r, s in zip(rows, fb.seq_lens_cpu):
        assert torch.equal(worker.req_to_token[r, :s], rank0.req_to_token[r, :s]), r
        touched[r, :s] = True
    assert torch.equal(worker.req_to_token[~touched], before[~touched])  # nothing else written
    assert batch["mode"] is mode and batch["return_all_logits"] is fb.return_all_logits
    assert batch["req_pool_indices"] == rows and batch["seq_lens"] == fb.seq_lens_cpu
    if mode.is_decode():  # make_forward_batch derives them
        assert batch["prefix_lens"] is None and batch["extend_lens"] is None
    else:
        assert batch["prefix_lens"] == prefix and batch["extend_lens"] == ext
    for key in ("input_ids", "positions", "out_cache_loc"):
        assert batch[key] == getattr(fb, key).tolist(), key


def test_message_sizes_extend_carries_only_the_cached_prefixes():
    pool = ReqToTokenPool(ROWS, CONTEXT)
    pool.req_to_token.copy_(torch.arange(ROWS * CONTEXT, dtype=torch.int32).view(ROWS, CONTEXT))
    cold = encode_step(_batch(pool, ForwardMode.EXTEND, [3, 5], [0, 0], [10, 7], True))
    warm = encode_step(_batch(pool, ForwardMode.EXTEND, [3, 5], [6, 20], [4, 7], True))
    decode = encode_step(_batch(pool, ForwardMode.DECODE, [3, 5, 9], [6, 20, 1], [1, 1, 1], True))
    # 32-byte header, 3 per-token and 4 per-request int64s (2 for a decode), 4 bytes per
    # cached-prefix slot.
    assert len(cold) == 32 + 8 * (3 * 17 + 4 * 2)
    assert len(warm) == 32 + 8 * (3 * 11 + 4 * 2) + 4 * 26
    assert len(decode) == 32 + 8 * (3 * 3 + 2 * 3)


def test_a_truncated_message_is_refused():
    pool = ReqToTokenPool(ROWS, CONTEXT)
    msg = encode_step(_batch(pool, ForwardMode.EXTEND, [1, 2], [4, 0], [3, 5], True))
    with pytest.raises(ValueError, match="does not fit its header"):
        decode_step(msg[:-8 * 3 - 16])
    with pytest.raises(ValueError, match="cached slots"):
        decode_step(msg[:-8])
