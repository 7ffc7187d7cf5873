"""Where torch's CPU work runs, and with how many threads: in-process decode throughput of a model
from model_repository/ (no server), for the thread placements the Triton adapter could use.

Placements (`--placement`):
- main: engine built and stepped on the main thread (one OpenMP team);
- build-main: built on the main thread, stepped on a second thread (two teams: how the adapter
  ran before it built the engine on its engine thread);
- thread: built and stepped on one second thread (one team: how the adapter runs now).
`--threads N` sets torch's intra-op threads first (default: torch's default); `--busy` runs a
1-core busy loop in another process meanwhile (contention, as tritonserver and clients add).
Output: one line, output tokens/s at concurrency 1 (6 requests one after another) and 64 (64
at once), 32 greedy tokens each. The OpenMP runtime reads GOMP_SPINCOUNT / OMP_WAIT_POLICY at
start-up, so set those in the environment of the command.

    .venv/bin/python benchmarks/torch_threads.py --placement thread --threads 1 --busy
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_client import REPO, engine_load  # noqa: E402
from serving_overhead import jobs_for, settings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v2-tiny")
    ap.add_argument("--placement", choices=["main", "build-main", "thread"], default="thread")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    ap.add_argument("--busy", action="store_true", help="a 1-core busy loop runs meanwhile")
    args = ap.parse_args()

    import torch

    from mla_backend.config import EngineConfig
    from mla_backend.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    weights = str(REPO / "model_repository" / args.model / "weights")
    state: dict = {}

    def build() -> None:
        state["engine"] = Engine(EngineConfig.create(model_path=weights, **settings(64, 32)))

    def run() -> None:
        eng = state["engine"]
        engine_load(eng, jobs_for(4, 32, "warm"), 1)
        for c, n in ((1, 6), (64, 64)):
            t = time.perf_counter()
            stats = engine_load(eng, jobs_for(n, 32, f"c{c}"), c)
            state[c] = stats.output_tokens / (time.perf_counter() - t)

    def on_thread(fn) -> None:
        th = threading.Thread(target=fn)
        th.start()
        th.join()

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        if args.placement == "main":
            build()
            run()
        elif args.placement == "build-main":
            build()
            on_thread(run)
        else:
            on_thread(lambda: (build(), run()))
    finally:
        if busy is not None:
            busy.kill()
    print(f"{args.model} placement={args.placement} threads={torch.get_num_threads()} "
          f"busy={args.busy} GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '-')}: "
          f"concurrency 1 {state[1]:.1f} tok/s, concurrency 64 {state[64]:.1f} tok/s")


if __name__ == "__main__":
    main()
