"""Tensor-parallel worker processes driven by rank 0 (the process that runs the scheduler).

Owned by rank 0's `ModelRunner` when `tensor_parallel_size` > 1 and no process group exists (the
Triton adapter's case): `TpWorkerGroup` spawns ranks 1..N-1 and joins the group as rank 0
(rendezvous via `file://` in a fresh temp folder, no ports).

Per forward, each worker gets one message of bytes over a pipe (`encode_step`, encoded once
for all workers): a 56-byte header, the `ModelRunner.make_forward_batch` ints as raw int64 (the
batch's own host copy) and every `req_to_token` cell rank 0 wrote since the previous message
(its pool tracks them: the batch's rows, and the prefix cache's rewrites of rows after a step).
`decode_step` turns it back into the batch's arguments and those writes, so each worker's table
mirrors rank 0's. Workers hold the same pools, run the same forward (their collectives meet rank
0's) and drop the logits; KV pools stay mirrored. An empty message stops a worker.

Any failure is fatal (ranks out of step; the model must be reloaded). Rank 0 checks liveness
before each step (`check_alive`); a worker dying mid-step makes a collective fail or time out
after `timeout_s`, and `step_failed` turns that into a `TpWorkerError` naming the dead rank, pid
and exit status. The first failure sticks: every later `check_alive` / `send_step` raises it.
`close()` stops and joins the workers and destroys the process group.
"""

from __future__ import annotations

import array
import gc
import logging
import multiprocessing as mp
import os
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import torch

from mla_backend.config import GC_THRESHOLDS
from mla_backend.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from mla_backend.forward_batch import ForwardMode
from mla_backend.mem_cache.memory_pool import expand_writes

if TYPE_CHECKING:
    from mla_backend.config import EngineConfig
    from mla_backend.forward_batch import ForwardBatch

DEFAULT_TIMEOUT_S = 300.0
logger = logging.getLogger(__name__)


class TpWorkerError(RuntimeError):
    """A tensor-parallel worker died, failed to start, or raised; or a step failed on rank 0
    after the workers were sent it (the ranks are out of step)."""


def how_it_ended(exitcode: int | None) -> str:
    """"signal 9, SIGKILL" / "exit code 1" for a `multiprocessing.Process.exitcode`."""
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            return f"signal {-exitcode}, {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def python_executable() -> str:
    """The interpreter for spawned workers. Inside Triton's Python-backend stub `sys.executable`
    is the stub binary, so fall back to the `python3` that runs this environment."""
    exe = sys.executable or ""
    if os.path.basename(exe).startswith("python"):
        return exe
    found = shutil.which("python3") or shutil.which("python")
    if not found:
        raise TpWorkerError("no python3 on PATH to start tensor-parallel workers")
    return found


def _rank_device(config: "EngineConfig", rank: int) -> str:
    """Device of `rank`: GPU `rank` for "auto"/"cuda" when CUDA exists, else the configured one."""
    device = config.model.device
    if device in ("auto", "cuda"):
        return f"cuda:{rank}" if torch.cuda.is_available() else "cpu"
    return device


def _worker_main(rank: int, world_size: int, init_method: str, config: "EngineConfig",
                 conn: Any, timeout_s: float, make_runner: Callable[["EngineConfig"], Any]) -> None:
    """Entry point of rank `rank`: join the group, build the runner, mirror rank 0's steps."""
    hang_dump_s = float(os.environ.get("MLA_TP_HANG_DUMP_S", "0") or 0)
    if hang_dump_s > 0:  # debugging aid: print this worker's stacks every N seconds
        import faulthandler

        faulthandler.dump_traceback_later(hang_dump_s, repeat=True)
    try:
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
        init_tensor_parallel(rank, world_size, init_method, device=_rank_device(config, rank),
                             timeout=timedelta(seconds=timeout_s))
        runner = make_runner(config)
        gc.collect()  # start-up objects out of every later full collection, and the
        gc.freeze()  # serving thresholds, as `engine.freeze_startup_objects` does for rank 0
        gc.set_threshold(*GC_THRESHOLDS)
        conn.send(("ready", rank))
    except BaseException:
        # Also on stderr at once: on CUDA, rank 0 may be blocked in a start-up collective (graph
        # capture) that this rank never reaches, and read the message only after that.
        print(f"tensor-parallel worker rank {rank} failed to start:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            msg = conn.recv_bytes()
            if not msg:
                break
            batch, writes = decode_step(msg)
            apply_req_to_token_writes(runner.req_to_token_pool.req_to_token, writes)
            runner.forward(runner.make_forward_batch(**batch))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        if runner.cuda_graph_runner is not None:  # graphs pin the NCCL communicator
            runner.cuda_graph_runner.release()
        destroy_tensor_parallel()


class TpWorkerGroup:
    """Ranks 1..world_size-1 as child processes; this process becomes rank 0.

    Args:
        config: the engine config every rank builds its `ModelRunner` from.
        world_size: tensor-parallel degree (>= 2).
        make_runner: builds a rank's runner from `config`: the `ModelRunner` class, passed in by
            its owner (pickled by name into each worker), so that this module, which the
            runner imports, never imports it back.
        timeout_s: collective and start-up timeout (seconds).
    Raises:
        TpWorkerError: a worker failed to start (its traceback in the message).
    """

    def __init__(self, config: "EngineConfig", world_size: int,
                 make_runner: Callable[["EngineConfig"], Any],
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if world_size < 2:
            raise ValueError(f"TpWorkerGroup needs world_size >= 2, got {world_size}")
        if _rank_device(config, 0).startswith("cuda"):
            have = torch.cuda.device_count()
            if world_size > have:
                raise TpWorkerError(f"tensor_parallel_size={world_size} needs {world_size} GPUs "
                                    f"(one per rank); this machine has {have}")
        self.world_size = world_size
        self._dir = tempfile.mkdtemp(prefix="mla_tp_")
        init_method = "file://" + os.path.join(self._dir, "rendezvous")
        ctx = mp.get_context("spawn")
        ctx.set_executable(python_executable())
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._closed = False
        self._failure: str | None = None  # the first fatal error; every later step raises it
        try:
            for rank in range(1, world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, name=f"mla-tp-rank{rank}", daemon=True,
                                   args=(rank, world_size, init_method, config, child, timeout_s,
                                         make_runner))
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
            init_tensor_parallel(0, world_size, init_method, device=_rank_device(config, 0),
                                 timeout=timedelta(seconds=timeout_s))
        except BaseException:
            self.close()
            raise

    def wait_ready(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Block until every worker has built its runner (call after rank 0 built its own; a
        worker's start-up failure is reported here). On CPU the runners' constructors contain no
        collectives; on CUDA they do (NCCL warm-up, pool sizing, graph capture), so a worker
        that fails before those leaves rank 0 waiting in them until `timeout_s`.

        Raises:
            TpWorkerError: a worker raised while starting, or did not answer in time.
        """
        for rank, conn in enumerate(self._conns, start=1):
            if not conn.poll(timeout_s):
                self.close()
                raise TpWorkerError(f"tensor-parallel worker rank {rank} did not start within "
                                    f"{timeout_s:.0f} s")
            kind, detail = conn.recv()
            if kind != "ready":
                self.close()
                raise TpWorkerError(f"tensor-parallel worker rank {rank} failed to start:\n"
                                    f"{detail}")

    def dead_worker(self) -> str | None:
        """The message naming the first worker that is no longer running (rank, pid and how it
        ended), or None while all run. Cheap (a non-blocking waitpid per worker)."""
        for rank, proc in enumerate(self._procs, start=1):
            if not proc.is_alive():
                return (f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited "
                        f"({how_it_ended(proc.exitcode)}); the model must be reloaded")
        return None

    def check_alive(self) -> None:
        """Raises TpWorkerError: the group was closed, an earlier step failed (the same message
        again), or a worker is no longer running (naming it; the failure sticks)."""
        if self._closed:
            raise TpWorkerError("the tensor-parallel workers were shut down")
        if self._failure is None:
            self._failure = self.dead_worker()
        if self._failure is not None:
            raise TpWorkerError(self._failure)

    def step_failed(self, error: BaseException, wait_s: float = 2.0) -> TpWorkerError:
        """The error to raise when rank 0's part of a step raised after `send_step`: the workers
        ran (or are stuck in) that step, so the ranks are out of step for good. Names the dead
        worker when one exited (waiting up to `wait_s` seconds for it to be reaped: a killed
        worker's sockets close before its exit status exists), else quotes `error`. The failure
        sticks: every later `check_alive` / `send_step` raises the same message.

        Returns:
            the TpWorkerError (the caller raises it from `error`).
        """
        if self._failure is None:
            deadline = time.monotonic() + wait_s
            message = self.dead_worker()
            while message is None and time.monotonic() < deadline:
                time.sleep(0.02)
                message = self.dead_worker()
            self._failure = message or (
                f"tensor-parallel step failed on rank 0 ({error!r}); the ranks are out of step; "
                "the model must be reloaded")
        return TpWorkerError(self._failure)

    def send_step(self, forward_batch: "ForwardBatch") -> None:
        """Send every worker the message that makes it run `forward_batch` in step.

        Raises:
            TpWorkerError: see `check_alive` (checked first); or a worker's pipe is closed
                (naming the dead worker, as `step_failed`).
        """
        self.check_alive()
        msg = encode_step(forward_batch)
        try:
            for conn in self._conns:
                conn.send_bytes(msg)
        except (BrokenPipeError, OSError) as e:
            raise self.step_failed(e) from e

    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1 (for supervision and tests)."""
        return [p.pid for p in self._procs]

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop and join the workers (terminate, then kill, if they do not exit), destroy the
        process group, remove the rendezvous folder. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            try:
                conn.send_bytes(b"")
            except (BrokenPipeError, OSError):
                pass
        # Rank 0 leaves the group while the workers leave theirs (destroying a NCCL group waits
        # for the peers: done one after the other, the workers' join would wait out its
        # timeout). Leaving can block (ncclCommDestroy also waits for CUDA graphs that captured
        # its collectives): a daemon thread, so it never hangs the caller (Triton's finalize).
        leave = threading.Thread(target=destroy_tensor_parallel, name="mla-tp-destroy",
                                 daemon=True)
        leave.start()
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self._conns:
            conn.close()
        leave.join(max(0.0, deadline - time.monotonic()))
        if leave.is_alive():
            logger.warning("leaving the tensor-parallel process group did not finish within "
                           "%.0f s; continuing without it", timeout_s)
        shutil.rmtree(self._dir, ignore_errors=True)


# forward mode, return_all_logits, tokens T, requests bs, runs k, their slots, points m
_HEADER = struct.Struct("<7q")


def encode_step(fb: "ForwardBatch") -> bytes:
    """The message that makes a worker run `fb` (see the module docstring): header (mode,
    return_all_logits, T, bs, runs k, run slots, points m), then int64 input_ids [T], positions
    [T], out_cache_loc [T], req_pool_indices [bs], seq_lens [bs], for an extend also prefix_lens
    [bs] and extend_lens [bs], then the `req_to_token` cells written on this rank since the
    previous message (`ReqToTokenPool.take_writes`: the batch's own rows and the prefix cache's
    later rewrites of earlier ones) as int32 runs [k, 3], their slots and points [3, m]. Reads
    host copies only (`ForwardBatch.host_packed`, `req_to_token_host`), so it costs no device
    sync when they exist. The host copy is final only without the overlap schedule, which fills
    a decode's input ids on the device after the batch is built (the engine turns it off at
    TP > 1).

    Raises:
        RuntimeError: the batch's `ReqToTokenPool` does not track its writes.
    """
    packed = fb.host_packed
    if packed is None:
        packed = torch.cat([fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices,
                            fb.seq_lens]).to("cpu", torch.int64)
    runs, run_slots, points = fb.req_to_token_pool.take_writes()
    parts = [_HEADER.pack(int(fb.forward_mode), int(fb.return_all_logits), fb.num_tokens,
                          fb.batch_size, runs.shape[0], run_slots.numel(), points.shape[1]),
             packed.numpy().tobytes()]
    if not fb.forward_mode.is_decode():
        lens = array.array("q", fb.extend_prefix_lens_cpu)
        lens.extend(fb.extend_seq_lens_cpu)
        parts.append(lens.tobytes())
    parts += [runs.numpy().tobytes(), run_slots.numpy().tobytes(), points.numpy().tobytes()]
    return b"".join(parts)


def decode_step(msg: bytes) -> tuple[dict[str, Any], torch.Tensor]:
    """(keyword arguments of `ModelRunner.make_forward_batch`, req_to_token writes) from an
    `encode_step` message. The ints come back as lists; the writes as a CPU tensor [3, N] of
    (rows, columns, slots) (`memory_pool.expand_writes`).

    Raises:
        ValueError: a message whose length does not match its header.
    """
    mode, all_logits, t, b, k, k_slots, m = _HEADER.unpack_from(msg)
    forward_mode = ForwardMode(mode)
    decode = forward_mode.is_decode()
    head = _HEADER.size // 8
    end = 8 * (head + 3 * t + (2 if decode else 4) * b)
    if len(msg) != end + 4 * (3 * k + k_slots + 3 * m):
        raise ValueError(f"tensor-parallel step message of {len(msg)} bytes does not fit its "
                         f"header ({t} tokens, {b} requests, {k} runs of {k_slots} slots, {m} "
                         "points)")
    ints = memoryview(msg)[:end].cast("q")  # C-level slices and lists: no torch op per field
    ids, pos, loc = (ints[head + i * t:head + (i + 1) * t].tolist() for i in range(3))
    rows, seq, prefix, ext = (ints[head + 3 * t + i * b:head + 3 * t + (i + 1) * b].tolist()
                              if i < 2 or not decode else None for i in range(4))
    # decode: prefix_lens, extend_lens None (make_forward_batch takes seq_len - 1 and 1)
    cells = torch.frombuffer(bytearray(msg[end:]), dtype=torch.int32) if len(msg) > end \
        else torch.empty(0, dtype=torch.int32)
    writes = expand_writes(cells[:3 * k].view(k, 3), cells[3 * k:3 * k + k_slots],
                           cells[3 * k + k_slots:].view(3, m))
    batch = {"mode": forward_mode, "input_ids": ids, "positions": pos, "req_pool_indices": rows,
             "seq_lens": seq, "prefix_lens": prefix, "extend_lens": ext, "out_cache_loc": loc,
             "return_all_logits": bool(all_logits)}
    return batch, writes


def apply_req_to_token_writes(req_to_token: torch.Tensor, writes: torch.Tensor) -> None:
    """Copy rank 0's `req_to_token` entries into this rank's table: `writes` = int32 or int64
    CPU [3, N] (rows, columns, slots), as `decode_step` returns; one host-to-device copy and one
    scatter, whatever the batch size."""
    if not writes.shape[1]:
        return
    t = writes.to(req_to_token.device, non_blocking=True)  # no wait: see host_tensors.int64_on
    req_to_token[t[0], t[1]] = t[2].to(req_to_token.dtype)  # (int32 slots: no copy)


__all__ = ["TpWorkerError", "TpWorkerGroup", "apply_req_to_token_writes", "decode_step",
           "encode_step"]
