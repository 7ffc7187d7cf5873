"""Cost of one step's outputs on the engine-process pipe, per encoding, in one run.

    .venv/bin/python benchmarks/bench_engine_pipe.py [--batch 64 256 1024] [--steps 200]

A child process sends `--steps` messages of `batch` decode outputs (one token each, as a decode
step of that many streaming requests makes them) over `client.engine_client._PipeChannel`, the
engine process's pipe; the parent receives and decodes each. Encodings: "objects" (the
[RequestOutput] list pickled as it is) and "rows" (`engine_client.pack_outputs` /
`unpack_outputs`, what the engine process sends). Reports per step (median over the steps after 20
warm-up ones): the child's encode time (pack + pickle; it runs on the engine's loop), the parent's
decode time (unpickle + unpack; it runs in the stub, under its GIL) and the bytes. Waiting on the
pipe is not counted.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mla_backend.request import RequestOutput  # noqa: E402
from mla_backend.client.engine_client import (  # noqa: E402
    _PipeChannel,
    pack_outputs,
    unpack_outputs,
)

ENCODE = {"objects": lambda outs: outs, "rows": pack_outputs}
DECODE = {"objects": lambda rows: rows, "rows": unpack_outputs}
WARMUP = 20  # steps left out of the medians


def step_outputs(batch: int, step: int) -> list[RequestOutput]:
    """One decode step's outputs for `batch` streaming requests (text left to the stub)."""
    return [RequestOutput(f"{i}-{step % 7}", [1000 + (i * 31 + step) % 30000], "", False, None,
                          200, step + 1, 0) for i in range(batch)]


def _child(conn, encoding: str, batch: int, steps: int) -> None:
    channel = _PipeChannel(conn)
    messages = [step_outputs(batch, s) for s in range(steps)]
    encode = ENCODE[encoding]
    spent = []
    for outs in messages:
        t0 = time.perf_counter()
        raw = pickle.dumps(("out", encode(outs), None, None), protocol=pickle.HIGHEST_PROTOCOL)
        spent.append(time.perf_counter() - t0)
        channel.conn.send_bytes(raw)  # as _PipeChannel.send, with the encoding timed apart
    channel.send(("done", statistics.median(spent[WARMUP:])))


def run(encoding: str, batch: int, steps: int) -> tuple[float, float, int]:
    """(child ms per step, parent ms per step, bytes per step)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_child, args=(child, encoding, batch, steps), daemon=True)
    proc.start()
    child.close()
    channel = _PipeChannel(parent)
    decode = DECODE[encoding]
    spent = []
    nbytes = 0
    while True:
        channel.poll(60.0)
        raw = channel.conn.recv_bytes()
        t0 = time.perf_counter()
        kind, payload, *_ = pickle.loads(raw)
        if kind == "done":
            child_s = payload
            break
        outs = decode(payload)
        spent.append(time.perf_counter() - t0)
        assert len(outs) == batch and outs[-1].num_output_tokens == len(spent)
        nbytes = len(raw)
    proc.join(30)
    return child_s * 1e3, statistics.median(spent[WARMUP:]) * 1e3, nbytes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--steps", type=int, default=200, help="messages per run (> 20)")
    args = ap.parse_args(argv)
    print("| outputs per step | encoding | engine process: encode (ms) | stub: decode (ms) "
          "| bytes |")
    print("|---|---|---|---|---|")
    for batch in args.batch:
        for encoding in ENCODE:
            child_ms, parent_ms, nbytes = run(encoding, batch, args.steps)
            print(f"| {batch} | {encoding} | {child_ms:.3f} | {parent_ms:.3f} | {nbytes} |")


if __name__ == "__main__":
    main()
