"""Rank 0's per-step message to its tensor-parallel workers, by encoding, on the CPU (issue 45:
the worker's host path at TP 8).

Each forward at TP > 1 first sends every worker the batch (`tp_workers.encode_step`): rank 0
spends that time before launching its own forward, and a worker before launching its own. Two
encodings of the same step, sent to 1, 3 and 7 worker processes that decode each message and
apply its `req_to_token` writes to a CPU table:
- "pickled lists": a dict of Python int lists pickled once per worker (`Connection.send`), an
  extend carrying every request's whole row [0, seq_len) as (row, column, slot) triples;
- "bytes": `encode_step` once for all workers (`send_bytes`): raw int64 arrays and the
  (row, column, slot) cells rank 0's pool recorded since the last message (here: the batch's
  own rows, written before each message as the scheduler writes them, not timed); the worker
  decodes with `decode_step`.
Steps: decodes of 64 and 1,024 rows (contexts 200-1,500), a 6,800-token prefill of 20 new
requests, and 64 requests of 128 new tokens on 1,024-token cached prefixes. Prints the medians
(ms) of rank 0's encode + send, and of the time from rank 0 starting the message until a worker
has its batch's ints and its `req_to_token` written (the slowest worker's median: the
collectives wait for it), and the message's bytes. With more worker processes than cores (the
2-core CPU VM at 3 and 7 workers) the workers' column includes waiting for a core.

    .venv/bin/python benchmarks/bench_tp_message.py [--repeats 40]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_suite import table  # noqa: E402

from mla_backend.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from mla_backend.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from mla_backend.model_executor.tp_workers import (apply_req_to_token_writes,  # noqa: E402
                                                   decode_step, encode_step)

ROWS, CONTEXT = 1024, 4096


def pickled_lists(fb: ForwardBatch, host: dict[str, list[int]]) -> dict:
    """The baseline message: plain int lists (`host`: the batch's lists, as the scheduler made
    them), an extend's rows whole."""
    rows, out_loc = host["req_pool_indices"], host["out_cache_loc"]
    if fb.forward_mode.is_decode():
        writes = (rows, [s - 1 for s in fb.seq_lens_cpu], out_loc)
    else:
        r2t = fb.req_to_token_pool.req_to_token_host
        w_rows, w_cols = [], []
        for row, n in zip(rows, fb.seq_lens_cpu):
            w_rows += [row] * n
            w_cols += range(n)
        idx, col = torch.tensor(w_rows), torch.tensor(w_cols)
        writes = (w_rows, w_cols, r2t[idx, col].tolist())
    return {"req_to_token": writes, "batch": {
        "mode": fb.forward_mode, "input_ids": host["input_ids"], "positions": host["positions"],
        "req_pool_indices": rows, "seq_lens": list(fb.seq_lens_cpu),
        "prefix_lens": list(fb.extend_prefix_lens_cpu),
        "extend_lens": list(fb.extend_seq_lens_cpu), "out_cache_loc": out_loc,
        "return_all_logits": fb.return_all_logits}}


def _worker(conn) -> None:
    """A worker: per step a marker (encoding and tag), then the message; times from the marker
    until the batch's ints are lists and the writes applied; sends its times on "stop"."""
    torch.set_num_threads(1)
    table_ = torch.zeros((ROWS, CONTEXT), dtype=torch.int32)
    spent: dict[str, list[float]] = {}
    while True:
        raw = conn.recv_bytes()
        if raw == b"stop":
            conn.send(spent)
            return
        kind, tag = raw[:1], raw[1:].decode()
        t = time.perf_counter()
        if kind == b"P":
            msg = conn.recv()
            rows, cols, slots = msg["req_to_token"]
            w = torch.tensor([rows, cols, slots], dtype=torch.int64)
            table_[w[0], w[1]] = w[2].to(torch.int32)
        else:
            batch, writes = decode_step(conn.recv_bytes())
            apply_req_to_token_writes(table_, writes)
            for key in ("input_ids", "positions", "out_cache_loc"):  # make_forward_batch's lists
                list(batch[key])
        spent.setdefault(tag, []).append(time.perf_counter() - t)


def write_rows(fb: ForwardBatch) -> None:
    """Write the batch's cells into its pool as the scheduler does before a forward (an extend:
    the cached prefix and the new slots of each row; a decode: the new slot), so that rank 0's
    pool records them for the next message. The values are the ones already there."""
    pool, r2t = fb.req_to_token_pool, fb.req_to_token_pool.req_to_token_host
    rows = fb.req_pool_indices.tolist()
    if fb.forward_mode.is_decode():
        cols = [s - 1 for s in fb.seq_lens_cpu]
        pool.write_positions(rows, cols, r2t[rows, cols].to(torch.int64))
        return
    for r, p, s in zip(rows, fb.extend_prefix_lens_cpu, fb.seq_lens_cpu):
        if p:
            pool.write_row(r, 0, r2t[r, :p].clone())
        pool.write_row(r, p, r2t[r, p:s].clone())


def make_batch(pool: ReqToTokenPool, mode: ForwardMode, prefix: list[int],
               ext: list[int]) -> tuple[ForwardBatch, dict[str, list[int]]]:
    """A batch of requests in rows 0..n-1 with the given prefixes and new tokens, and the int
    lists it was built from."""
    rows = list(range(len(prefix)))
    seq = [p + e for p, e in zip(prefix, ext)]
    r2t = pool.req_to_token_host
    ids = [random.randrange(100_000) for _ in range(sum(ext))]
    pos = [c for p, s in zip(prefix, seq) for c in range(p, s)]
    loc = torch.cat([r2t[r, p:s] for r, p, s in zip(rows, prefix, seq)]).tolist()
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    fb = ForwardBatch(forward_mode=mode, batch_size=len(rows), input_ids=t(ids),
                      positions=t(pos), req_pool_indices=t(rows), seq_lens=t(seq),
                      out_cache_loc=t(loc), seq_lens_cpu=seq, extend_prefix_lens_cpu=prefix,
                      extend_seq_lens_cpu=ext, req_to_token_pool=pool, token_to_kv_pool=None,
                      attn_backend=None, host_packed=t(ids + pos + loc + rows + seq))
    return fb, {"input_ids": ids, "positions": pos, "req_pool_indices": rows,
                "out_cache_loc": loc}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 3, 7])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    random.seed(0)
    pool = ReqToTokenPool(ROWS, CONTEXT)
    pool.req_to_token.copy_(torch.randint(0, 3_000_000, (ROWS, CONTEXT), dtype=torch.int32))
    pool.track_writes()  # as a rank 0 with workers
    steps = {
        "decode, 64 rows": make_batch(pool, ForwardMode.DECODE,
                                      [random.randint(200, 1500) for _ in range(64)], [1] * 64),
        "decode, 1,024 rows": make_batch(pool, ForwardMode.DECODE,
                                         [random.randint(200, 1500) for _ in range(1024)],
                                         [1] * 1024),
        "prefill, 20 requests, 6,800 tokens": make_batch(pool, ForwardMode.EXTEND, [0] * 20,
                                                         [340] * 20),
        "extend, 64 x 128 on 1,024 cached": make_batch(pool, ForwardMode.EXTEND, [1024] * 64,
                                                       [128] * 64),
    }
    ctx = mp.get_context("spawn")
    rows_out = []
    for k in args.workers:
        pipes, procs = [], []
        for _ in range(k):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(b,), daemon=True)
            p.start()
            pipes.append(a)
            procs.append(p)
        sender: dict[str, list[float]] = {}
        for name, (fb, lists) in steps.items():
            for enc in ("pickled lists", "bytes"):
                tag = f"{name}|{enc}"
                for _ in range(args.repeats):
                    write_rows(fb)  # (not timed: the scheduler's part)
                    for c in pipes:  # the worker times from this marker on
                        c.send_bytes((b"P" if enc == "pickled lists" else b"B") + tag.encode())
                    t = time.perf_counter()
                    if enc == "pickled lists":
                        msg = pickled_lists(fb, lists)
                        for c in pipes:
                            c.send(msg)
                    else:
                        raw = encode_step(fb)
                        for c in pipes:
                            c.send_bytes(raw)
                    sender.setdefault(tag, []).append(time.perf_counter() - t)
                    time.sleep(0.002)  # let the workers drain, as a forward would
        for c in pipes:
            c.send_bytes(b"stop")
        worker_spent = [c.recv() for c in pipes]
        for p in procs:
            p.join()
        for name, (fb, lists) in steps.items():
            for enc in ("pickled lists", "bytes"):
                tag = f"{name}|{enc}"
                write_rows(fb)
                size = len(pickle.dumps(pickled_lists(fb, lists))) \
                    if enc == "pickled lists" else len(encode_step(fb))
                w = max(statistics.median(s[tag]) for s in worker_spent)
                rows_out.append([name, enc, k, f"{1e3 * statistics.median(sender[tag]):.3f}",
                                 f"{1e3 * w:.3f}", f"{size:,}"])
    table("Tensor-parallel step message (ms, medians)",
          ["step", "encoding", "workers", "rank 0: encode + send",
           "slowest worker: batch in hand", "bytes"], rows_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
