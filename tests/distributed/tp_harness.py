"""Run a function on N CPU tensor-parallel ranks (gloo) and collect each rank's return value.

Used by the TP tests: every rank process joins the TP group through
`mla_backend.distributed.init_tensor_parallel` (rendezvous through a `file://` in a fresh temp
folder: no ports), runs `fn(*args)` and sends back its return value (pickled, plain bytes: no
shared-memory tensors outliving a process). A rank's exception fails the caller with that rank's
traceback; timeouts turn a hang (e.g. one rank stuck in a collective its peer never reached) into a
failure; worker processes are always terminated.

- `run_tp(world_size, fn, *args, timeout=60.0) -> list` (rank order): one-shot.
- `TpWorkers(world_size, timeout=60.0)`: persistent ranks (process start-up paid once) whose
  `.run(fn, *args)` has the same contract; after a failure the ranks are torn down and the next
  `.run` starts fresh ones. Use as a context manager or call `.close()`.

`fn` and `args` must be picklable by reference (module-level functions of an importable module;
the spawned ranks get the parent's `sys.path`). Each rank uses one torch thread.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable


class TpRankError(AssertionError):
    """A rank raised (message: each failing rank's traceback), died, or timed out."""


def _rank_main(rank: int, world_size: int, init_method: str, timeout_s: float,
               tasks: Any, results: Any) -> None:
    """Entry point of one rank process: join the group, then run tasks until None arrives."""
    import torch

    from mla_backend.distributed import destroy_tensor_parallel, init_tensor_parallel

    torch.set_num_threads(1)
    try:
        init_tensor_parallel(rank, world_size, init_method, backend="gloo",
                             timeout=timedelta(seconds=timeout_s))
    except BaseException:
        results.put((rank, -1, False, traceback.format_exc()))
        return
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            task_id, payload = task
            try:
                fn, args = pickle.loads(payload)
                out = (rank, task_id, True, pickle.dumps(fn(*args)))
            except BaseException:
                out = (rank, task_id, False, traceback.format_exc())
            results.put(out)
    finally:
        destroy_tensor_parallel()


class TpWorkers:
    """`world_size` persistent CPU rank processes in one gloo TP group.

    Args:
        world_size: number of ranks.
        timeout: seconds one `.run` (and the group's collectives) may take.
    """

    def __init__(self, world_size: int, timeout: float = 60.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._ctx = mp.get_context("spawn")
        self._procs: list = []
        self._tasks: list = []
        self._results: Any = None
        self._tmp: str | None = None
        self._next_id = 0

    def _start(self) -> None:
        self._tmp = tempfile.mkdtemp(prefix="tp_harness_")
        init_method = "file://" + os.path.join(self._tmp, "rendezvous")
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            self._ctx.Process(target=_rank_main, daemon=True, name=f"tp-rank-{r}",
                              args=(r, self.world_size, init_method, self.timeout,
                                    self._tasks[r], self._results))
            for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable, *args: Any) -> list:
        """fn(*args) on every rank; returns the return values in rank order.

        Raises:
            TpRankError: a rank raised (its traceback is in the message), a rank process died,
                or the ranks did not all answer within `timeout` seconds. The ranks are then
                torn down (the next run starts new ones).
        """
        if not self._procs:
            self._start()
        task_id, self._next_id = self._next_id, self._next_id + 1
        payload = pickle.dumps((fn, args))
        for q in self._tasks:
            q.put((task_id, payload))
        got: dict[int, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + self.timeout
        while len(got) + len(errors) < self.world_size:
            try:
                rank, tid, ok, data = self._results.get(timeout=0.1)
            except queue.Empty:
                if time.monotonic() > deadline:
                    if not errors:
                        missing = sorted(set(range(self.world_size)) - set(got))
                        errors.append(f"timed out after {self.timeout:.0f} s waiting for ranks "
                                      f"{missing} (a hang in a collective?)")
                    break
                dead = [p for p in self._procs if not p.is_alive()]
                if dead:
                    errors.append(", ".join(f"{p.name} died (exit code {p.exitcode})"
                                            for p in dead))
                    break
                continue
            if tid == -1:  # failed to join the group
                errors.append(f"rank {rank} failed to initialize:\n{data}")
            elif tid != task_id:
                continue  # an answer to an earlier, abandoned task
            elif ok:
                got[rank] = pickle.loads(data)
            else:
                errors.append(f"rank {rank} raised:\n{data}")
            if errors:  # give the peers a moment to report too; they may be stuck waiting
                deadline = min(deadline, time.monotonic() + 1.0)
        if errors:
            self.close()
            raise TpRankError(f"{getattr(fn, '__name__', fn)} on {self.world_size} ranks:\n"
                              + "\n".join(errors))
        return [got[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the ranks: ask politely, then terminate, then kill. Idempotent."""
        for q in self._tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        end = time.monotonic() + 5.0
        for p in self._procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
        for q in [*self._tasks, self._results]:
            if q is not None:
                q.close()
                q.cancel_join_thread()
        self._procs, self._tasks, self._results = [], [], None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> TpWorkers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_tp(world_size: int, fn: Callable, *args: Any, timeout: float = 60.0) -> list:
    """fn(*args) on `world_size` fresh CPU ranks; each rank's return value, in rank order.

    Raises:
        TpRankError: see `TpWorkers.run`.
    """
    with TpWorkers(world_size, timeout) as workers:
        return workers.run(fn, *args)
