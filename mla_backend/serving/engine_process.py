"""`EngineProcess`: the adapter's `Engine` in a child process of the Python-backend stub.

Why a process: in the stub the engine thread shares one GIL with the response and sender
threads. Every `InferenceResponseSender.send` takes the GIL back when its IPC round trip
returns, so per-token streaming makes the engine thread block and wait for a core once per
token, which slowed its decode steps on a small CPU VM. In its own process the engine has its
own GIL; what crosses the boundary is one message per step.

Owns the child process (spawned with this environment's `python3`; it spawns the tensor-parallel
workers itself), the pipe to it, and a stub-side front with the part of `Engine`'s interface the
adapter uses (`add_request`, `abort`, `wait_for_work`, `step`, `check_health`, `failed`, `stats`,
`check_invariant`, `close`, `tokenizer`, `context_len`, `max_total_tokens`). Requests are
checked and tokenized in the stub (`engine.validate_request`), so a bad request is refused at
once; the child gets prompt ids and does not detokenize (`Engine(detokenize=False)`) except
where stop strings need it: the stub fills the text in `step` (`OutputDetokenizer`).

Messages (one duplex `multiprocessing` pipe, pickled tuples):
- stub → child: ("add", GenerateRequest with input_ids), ("abort", rid), ("check",), ("close",).
- child → stub: ("ready", facts) or ("load_error", message) once; then ("out", rows, failed,
  stats or None) after a step that produced outputs or changed `failed` or the counters, rows =
  `pack_outputs` of the step's [RequestOutput] (plain tuples unpickle faster than dataclasses;
  `benchmarks/bench_engine_pipe.py`); ("step_error", message) when a step raised; ("check",
  verdict or None, stats).

If the child dies, `failed` says so ("the engine process (pid N) exited (signal 9, SIGKILL); the
model must be reloaded") and every live request ends with that error, as for a dead
tensor-parallel worker. If the stub dies, the child sees the pipe close and exits.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import operator
import os
import pickle
import select
import signal
import threading
import time
from itertools import starmap
from typing import Any

from mla_backend.config import EngineConfig
from mla_backend.engine import EngineFailedError, InvalidRequestError, validate_request
from mla_backend.model_executor.tp_workers import _how_it_ended, _python_executable
from mla_backend.request import GenerateRequest, RequestOutput
from mla_backend.tokenizer.detokenizer import OutputDetokenizer

_IDLE_POLL_S = 0.1  # the child's wait for a message while it has no work (s)
_STATS_EVERY_S = 0.1  # the child sends changed counters at most this often while busy (s)
_START_POLL_S = 0.5  # how often the stub checks the child is alive while it loads (s)
_CHECK_TIMEOUT_S = 30.0  # check_invariant's wait for the child's answer (s)
_CLOSE_TIMEOUT_S = 30.0  # close() waits this long for the child, then terminates it (s)


# One output on the pipe: its RequestOutput's fields as a tuple, in declaration order.
_pack_output = operator.attrgetter(*(f.name for f in dataclasses.fields(RequestOutput)))


def pack_outputs(outputs: list[RequestOutput]) -> list[tuple]:
    """The pipe form of a step's outputs (`unpack_outputs` rebuilds them)."""
    return list(map(_pack_output, outputs))


def unpack_outputs(rows: list[tuple]) -> list[RequestOutput]:
    """RequestOutputs from `pack_outputs` rows."""
    return list(starmap(RequestOutput, rows))


class EngineProcessError(RuntimeError):
    """The engine process failed to start (its own load error's message, or how it exited)."""


class _Channel:
    """One end of the stub <-> engine-process pipe (a `multiprocessing` Connection): one pickled
    tuple per message, and a poll that is a single poll(2) call.

    `Connection.send` / `poll` work too but cost more per call, and the engine process calls
    them once per step: `send` pickles through `ForkingPickler` (it rebuilds its dispatch table
    on every call, for the tensors and file descriptors our messages never carry) and `poll`
    builds a new selector each time. This class cuts the gap between two steps of the engine
    process.

    Raises (every method): EOFError / OSError when the other end is gone.
    """

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self._poller = select.poll()
        self._poller.register(conn.fileno(), select.POLLIN)

    def send(self, message: tuple) -> None:
        self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> Any:
        return pickle.loads(self.conn.recv_bytes())

    def poll(self, timeout_s: float) -> bool:
        """True when a message (or the other end's close) is waiting; waits up to `timeout_s`."""
        return bool(self._poller.poll(math.ceil(max(timeout_s, 0.0) * 1000)))

    def close(self) -> None:
        self.conn.close()


class EngineProcess:
    """Stub-side front of an `Engine` running in a child process (module docstring).

    Thread use: `add_request` / `abort` from any thread; `wait_for_work`, `step`,
    `check_health` from one receiver thread (the adapter's engine thread); `check_invariant`
    and `close` once that thread has stopped.

    Args:
        config: the engine configuration (pickled to the child).
        threads: torch intra-op threads for the child (None: torch's default).
    Raises:
        EngineProcessError: the child could not build the engine (its message: bad parameters,
            missing weights, ...) or exited while loading.
    """

    def __init__(self, config: EngineConfig, threads: int | None) -> None:
        from transformers import AutoTokenizer

        ctx = mp.get_context("spawn")
        ctx.set_executable(_python_executable())
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self._conn = _Channel(parent_conn)
        # Not a daemon: the child spawns tensor-parallel workers of its own.
        self._proc = ctx.Process(target=_child_main, args=(child_conn, config, threads),
                                 name="mla-engine", daemon=False)
        self._proc.start()
        child_conn.close()
        self.pid: int = self._proc.pid
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # _live, _pending, failed
        self._live: set[str] = set()  # rids added and not yet finished
        self._pending: list[RequestOutput] = []  # outputs made here (the child died)
        self._closed = False
        self.failed: str | None = None
        try:
            facts = self._wait_ready()  # first: the engine's own load error names the cause
            # The stub's own copy tokenizes and checks requests (`add_request`) and detokenizes
            # the child's outputs (`step`).
            self.tokenizer = AutoTokenizer.from_pretrained(config.model.model_path)
            self._detok = OutputDetokenizer(self.tokenizer)
        except BaseException:
            self._stop_child(5.0)
            raise
        self.vocab_size: int = facts["vocab_size"]
        self.context_len: int = facts["context_len"]
        self.max_total_tokens: int = facts["max_total_tokens"]
        self.device: str = facts["device"]
        self.torch_threads: int = facts["torch_threads"]
        self.tp_worker_pids: list[int] | None = facts["tp_worker_pids"]
        self._stats: dict[str, int] = facts["stats"]

    def _wait_ready(self) -> dict[str, Any]:
        while not self._conn.poll(_START_POLL_S):
            if not self._proc.is_alive():
                self._proc.join(1.0)
                raise EngineProcessError(
                    f"the engine process (pid {self.pid}) exited while loading "
                    f"({_how_it_ended(self._proc.exitcode)})")
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5.0)
            raise EngineProcessError(
                f"the engine process (pid {self.pid}) exited while loading "
                f"({_how_it_ended(self._proc.exitcode)})") from None
        if kind == "load_error":
            self._proc.join(10.0)
            raise EngineProcessError(payload)
        return payload

    # ------------------------------------------------------------------ any thread
    def add_request(self, request: GenerateRequest) -> None:
        """Check, tokenize and send a request to the engine process.

        Raises:
            InvalidRequestError: as `Engine.add_request` (bad prompt or sampling values, beyond
                the context or the pool, duplicate id, shutting down).
            EngineFailedError: the engine (or its process) has failed.
        """
        if self.failed is not None:
            raise EngineFailedError(self.failed)
        if self._closed:
            raise InvalidRequestError("the engine is shutting down")
        ids = validate_request(request, self.tokenizer, self.vocab_size, self.context_len,
                               self.max_total_tokens)
        with self._lock:
            if request.rid in self._live:
                raise InvalidRequestError(f"request id {request.rid!r} is already in use")
            self._live.add(request.rid)
        self._detok.start(request.rid, ids, request.sampling_params.skip_special_tokens)
        if not self._send(("add", dataclasses.replace(request, text=None, input_ids=ids))):
            self._detok.forget(request.rid)
            raise EngineFailedError(self.failed or "the engine process is gone")

    def abort(self, rid: str) -> None:
        """Ask the engine to abort `rid` (its final output follows from a later `step`)."""
        self._send(("abort", rid))

    def stats(self) -> dict[str, int]:
        """The engine's counters as of its latest message (`Engine.stats`)."""
        return dict(self._stats)

    def _send(self, message: tuple) -> bool:
        """Send `message` to the child; False (and `failed` set) when the child is gone."""
        try:
            with self._send_lock:
                self._conn.send(message)
            return True
        except (BrokenPipeError, EOFError, OSError):
            self._child_gone()
            return False

    def _child_gone(self) -> None:
        """The child exited: set `failed` and queue one error output per live request."""
        self._proc.join(1.0)
        with self._lock:
            if self.failed is not None and not self._live:
                return
            if self.failed is None:
                self.failed = (f"the engine process (pid {self.pid}) exited "
                               f"({_how_it_ended(self._proc.exitcode)}); the model must be "
                               "reloaded")
            self._pending += [RequestOutput(rid=rid, new_token_ids=[], new_text="",
                                            finished=True, error=self.failed)
                              for rid in sorted(self._live)]
            self._live.clear()

    # ------------------------------------------------------------------ receiver thread
    def wait_for_work(self, timeout: float) -> bool:
        """Block up to `timeout` s until the child has sent something (or died)."""
        if self._pending:
            return True
        try:
            return self._conn.poll(timeout)
        except (EOFError, OSError):
            self._child_gone()
            return True

    def step(self) -> list[RequestOutput]:
        """Every output the child has sent since the last call (possibly several steps'), with
        its text (detokenized here unless the child did).

        Raises:
            RuntimeError: the child's step raised (its message); outputs received before it are
                returned by the next call.
        """
        outputs: list[RequestOutput] = []
        error = None
        try:
            while error is None and self._conn.poll(0):
                kind, *payload = self._conn.recv()
                if kind == "out":
                    rows, failed, stats = payload
                    outputs += unpack_outputs(rows)
                    if failed is not None and self.failed is None:
                        self.failed = failed
                    if stats is not None:
                        self._stats = stats
                elif kind == "step_error":
                    error = payload[0]
        except (EOFError, OSError):
            self._child_gone()
        with self._lock:
            for out in outputs:
                if out.finished:
                    self._live.discard(out.rid)
            if error is not None:
                self._pending = outputs + self._pending
                outputs = []
            else:
                outputs += self._pending
            self._pending = []
        # (dict operations only: safe beside `add_request`'s `start` on another thread)
        self._detok.fill(outputs)
        if error is not None:
            raise RuntimeError(error)
        return outputs

    def check_health(self) -> str | None:
        """`failed`, after noticing a child that exited while idle."""
        if self.failed is None and not self._proc.is_alive():
            self._child_gone()
        return self.failed

    # ------------------------------------------------------------------ after the receiver stops
    def check_invariant(self) -> None:
        """Ask the child to check its pools (`Engine.check_invariant`); refreshes `stats`.

        Raises:
            AssertionError: the pool invariant failed, or the child did not answer.
            EngineFailedError: the child is gone (nothing to check).
        """
        if not self._send(("check",)):
            raise EngineFailedError(self.failed)
        deadline = time.monotonic() + _CHECK_TIMEOUT_S
        try:
            while self._conn.poll(max(deadline - time.monotonic(), 0.0)):
                kind, *payload = self._conn.recv()
                if kind == "check":
                    verdict, self._stats = payload
                    if verdict is not None:
                        raise AssertionError(verdict)
                    return
                if kind == "out" and payload[2] is not None:
                    self._stats = payload[2]
        except (EOFError, OSError):
            self._child_gone()
            raise EngineFailedError(self.failed) from None
        raise AssertionError(f"the engine process (pid {self.pid}) did not answer within "
                             f"{_CHECK_TIMEOUT_S:.0f} s")

    def close(self) -> None:
        """Stop the engine (it aborts what is left and stops its tensor-parallel workers) and
        join its process; terminate it if it does not exit in time. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_child(_CLOSE_TIMEOUT_S)

    def _stop_child(self, timeout_s: float) -> None:
        try:
            with self._send_lock:
                self._conn.send(("close",))
        except (BrokenPipeError, EOFError, OSError):
            pass
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)
        self._conn.close()


# ---------------------------------------------------------------------- child process
def _child_main(conn: Any, config: EngineConfig, threads: int | None) -> None:
    """Entry point of the engine process: build the engine, then serve the pipe."""
    # Ctrl-C reaches the whole process group; the stub decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _own_session()
    import torch

    from mla_backend.engine import Engine

    conn = _Channel(conn)
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        engine = Engine(config, detokenize=False)  # the stub detokenizes (`EngineProcess.step`)
    except BaseException as e:  # noqa: BLE001 - the stub fails the load with this message
        conn.send(("load_error", str(e) or repr(e)))
        conn.close()
        return
    workers = engine.runner.tp_workers
    conn.send(("ready", {
        "vocab_size": engine.vocab_size, "context_len": engine.context_len,
        "max_total_tokens": engine.max_total_tokens, "device": str(engine.runner.device),
        "torch_threads": torch.get_num_threads(),
        "tp_worker_pids": None if workers is None else workers.pids(),
        "stats": engine.stats()}))
    try:
        _serve(engine, conn)
    finally:
        engine.close()
        conn.close()


def _own_session() -> None:
    """Move this process into a session of its own (setsid), hence into a scheduling group of
    its own where Linux groups processes by session (`autogroup`: kernel.sched_autogroup_enabled
    = 1 and the process in the root cpu cgroup, as on our CPU VMs; inside a container's cgroup
    it changes nothing). There the CPU scheduler weighs the engine against tritonserver, the
    stub and the clients as one group against another, instead of one thread against each of
    their threads: with per-token streaming their threads wake ~60 times per decode step of 64
    requests, and on a machine with few cores many of those wake-ups preempted the engine.
    Signals of the terminal's session no
    longer reach this process, which is what we want: the stub decides when it stops (closing
    the pipe or sending ("close",)). No-op where setsid is refused."""
    try:
        os.setsid()
    except OSError:  # already a session or group leader
        pass


def _serve(engine: Any, conn: _Channel) -> None:
    """Alternate between the stub's messages and engine steps until ("close",) or EOF."""
    last_stats: dict[str, int] | None = None
    last_stats_t = 0.0
    failed_sent: str | None = None
    while True:
        wait = 0.0 if engine.has_work() else _IDLE_POLL_S
        try:
            while conn.poll(wait):
                message = conn.recv()
                if message[0] == "close":
                    return
                _handle(engine, conn, message)
                wait = 0.0
        except (EOFError, OSError):  # the stub is gone
            return
        outputs: list[RequestOutput] = []
        if engine.has_work():
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - the stub reports it and fails the requests
                conn.send(("step_error", f"{e!r}"))
                continue
        else:
            engine.check_health()
        now = time.monotonic()
        stats = None
        if now - last_stats_t >= _STATS_EVERY_S or not engine.has_work():
            current = engine.stats()
            if current != last_stats:
                stats = last_stats = current
                last_stats_t = now
        if outputs or stats is not None or engine.failed != failed_sent:
            failed_sent = engine.failed
            conn.send(("out", pack_outputs(outputs), engine.failed, stats))


def _handle(engine: Any, conn: Any, message: tuple) -> None:
    kind = message[0]
    if kind == "add":
        request = message[1]
        try:
            engine.add_request(request)
        except (InvalidRequestError, EngineFailedError) as e:  # checked in the stub: rare
            conn.send(("out", pack_outputs([RequestOutput(
                rid=request.rid, new_token_ids=[], new_text="", finished=True, error=str(e))]),
                engine.failed, None))
    elif kind == "abort":
        engine.abort(message[1])
    elif kind == "check":
        try:
            engine.check_invariant()
            verdict = None
        except AssertionError as e:
            verdict = f"{e!r}"
        conn.send(("check", verdict, engine.stats()))
