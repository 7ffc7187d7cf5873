"""`EngineClient`: the engine's one front door for servers (the Triton adapter).

It owns the edge of the engine: `add_request` checks and tokenizes a request once
(`request.validate_request`) and registers it with the one `OutputProcessor` (text, stop
strings, logprob text), which runs here, on the client's side; `get_outputs` returns the engine's
outputs through it and aborts in the engine the requests a stop string ended. The engine runs
`engine.serve_engine` (one loop body) behind a `Channel` of tuples, in one of two places:

- `ProcessClient`: a child process spawned with this environment's `python3` (it spawns the
  tensor-parallel workers itself), over a duplex pipe (`_PipeChannel`). Its own GIL is why:
  in the Python-backend stub the engine would share one GIL with the response and sender
  threads, whose per-token IPC round trips stalled its steps. With `text_process` a second
  child, the detokenizer process (`_detokenizer_main`), sits on the pipe between them and
  runs the `OutputProcessor` there, off the client's GIL: it relays every message both ways,
  registers each "add" on its way to the engine (so before any output of it), fills the text
  of the engine's outputs and aborts in the engine the requests a stop string ended. The
  client then keeps only its requests' ids (`_Registry`) and a tokenizer for `token_text`.
- `InProcessClient`: a thread of this process, over a pair of queues (`_QueueChannel`); every
  torch operation of the engine runs on that one thread.

A receiver thread of the client reads the channel and queues the outputs. If the engine's
process (or thread) ends, `failed` says so ("the engine process (pid N) exited (signal 9,
SIGKILL); the model must be reloaded") and every live request ends with that error, as for a dead
tensor-parallel worker; so does a dead detokenizer process ("the detokenizer process (pid N)
exited (...)"), after which the engine sees its pipe close and exits. If the client's process
dies, its children see their pipes close and exit.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import operator
import os
import pickle
import queue
import select
import signal
import threading
from itertools import starmap
from typing import Any

import torch

from mla_backend.config import EngineConfig
from mla_backend.engine import Channel, freeze_startup_objects, serve_engine
from mla_backend.model_executor.model_runner import resolve_device
from mla_backend.model_executor.tp_workers import how_it_ended, python_executable
from mla_backend.request import (
    EngineFailedError,
    GenerateRequest,
    InvalidRequestError,
    RequestOutput,
    validate_request,
)
from mla_backend.tokenizer import load_tokenizer
from mla_backend.tokenizer.output_processor import OutputProcessor, engine_streams

_IDLE_POLL_S = 0.1  # the receiver's wait for a message; it checks the engine is alive between (s)
_START_POLL_S = 0.5  # how often the client checks the engine is alive while it loads (s)
_CHECK_TIMEOUT_S = 30.0  # check_invariant's wait for the engine's answer (s)
_CLOSE_TIMEOUT_S = 30.0  # close() waits this long for the engine, then terminates its process (s)

# One output on the pipe: its RequestOutput's fields as a tuple, in declaration order.
_pack_output = operator.attrgetter(*(f.name for f in dataclasses.fields(RequestOutput)))


def pack_outputs(outputs: list[RequestOutput]) -> list[tuple]:
    """The pipe form of a step's outputs (plain tuples unpickle faster than dataclasses;
    `benchmarks/bench_engine_pipe.py`); `unpack_outputs` rebuilds them."""
    return list(map(_pack_output, outputs))


def unpack_outputs(rows: list[tuple]) -> list[RequestOutput]:
    """RequestOutputs from `pack_outputs` rows."""
    return list(starmap(RequestOutput, rows))


def default_torch_threads(device: str) -> int | None:
    """Torch intra-op threads for an engine on `device` when none are set: on a CPU one fewer
    than this process may use (at least 1), leaving a core to the server, the response threads
    and the clients; on a GPU None (torch's default; the host does little parallel work)."""
    if resolve_device(device).type != "cpu":
        return None
    return max(1, len(os.sched_getaffinity(0)) - 1)


class EngineStartError(RuntimeError):
    """The engine failed to start (its own load error's message, or how its process exited)."""


class _PipeChannel:
    """One end of a `multiprocessing` pipe: one pickled tuple per message ("out" messages carry
    `pack_outputs` rows), and a poll that is a single poll(2) call. `Connection.send` / `poll`
    cost more per call (`send` pickles through `ForkingPickler`, which rebuilds its dispatch
    table every call; `poll` builds a selector each time), and the engine calls them every step.

    Raises (every method): EOFError / OSError when the other end is gone.
    """

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self._poller = select.poll()
        self._poller.register(conn.fileno(), select.POLLIN)

    def send(self, message: tuple) -> None:
        if message[0] == "out":
            message = ("out", pack_outputs(message[1]), *message[2:])
        self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> tuple:
        message = pickle.loads(self.conn.recv_bytes())
        if message[0] == "out":
            message = ("out", unpack_outputs(message[1]), *message[2:])
        return message

    def poll(self, timeout_s: float) -> bool:
        return bool(self._poller.poll(math.ceil(max(timeout_s, 0.0) * 1000)))

    def close(self) -> None:
        self.conn.close()


_NOTHING = ("",)  # _QueueChannel: no message taken ahead


class _QueueChannel:
    """One end of a pair of queues between two threads of this process (`Channel`)."""

    def __init__(self, inbox: "queue.SimpleQueue[tuple]",
                 outbox: "queue.SimpleQueue[tuple]") -> None:
        self._in, self._out = inbox, outbox
        self._ahead: tuple = _NOTHING

    def send(self, message: tuple) -> None:
        self._out.put(message)

    def recv(self) -> tuple:
        if self._ahead is not _NOTHING:
            message, self._ahead = self._ahead, _NOTHING
            return message
        return self._in.get()

    def poll(self, timeout_s: float) -> bool:
        if self._ahead is not _NOTHING:
            return True
        try:
            self._ahead = (self._in.get(timeout=timeout_s) if timeout_s > 0
                           else self._in.get_nowait())
        except queue.Empty:
            return False
        return True

    def close(self) -> None:
        pass


class _Registry(OutputProcessor):
    """The client's side of an `OutputProcessor` that runs in the detokenizer process: the
    same registry of live requests (`add` refuses a live id, `forget`, `rids`, `token_text`),
    without their text state; `process` passes the outputs (their text already filled) of
    registered requests through and forgets the finished ones."""

    def add(self, rid: str, prompt_ids: Any, sampling_params: Any, stream: bool) -> None:
        self._register(rid, None)

    def process(self, outputs: Any) -> tuple[list[RequestOutput], list[str]]:
        reqs = self._reqs
        kept = [out for out in outputs if out.rid in reqs]
        for out in kept:
            if out.finished:
                self.forget(out.rid)
        return kept, []


class EngineClient:
    """The front door (module docstring); `InProcessClient` and `ProcessClient` say where the
    engine runs.

    Thread use: `add_request` / `abort` from any thread; `get_outputs` from one thread;
    `check_invariant` and `close` once that thread no longer calls `get_outputs`.

    Args:
        config: the engine configuration.
        threads: torch intra-op threads for the engine (None: `default_torch_threads`).
    Raises:
        EngineStartError: the engine could not be built (its message: bad parameters, missing
            weights, ...) or its process exited while loading.
    """

    where = "engine"  # for logs: where the engine runs
    text_process = False  # the outputs' text is made in a detokenizer process (ProcessClient)

    def __init__(self, config: EngineConfig, threads: int | None = None) -> None:
        if threads is None:
            threads = default_torch_threads(config.model.device)
        self._lock = threading.Lock()  # failed, and the live requests with it
        self._send_lock = threading.Lock()
        self._outputs: queue.SimpleQueue[list[RequestOutput]] = queue.SimpleQueue()
        self._checks: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._closed = False
        self._receiving = True
        # n > 1: a request's completions run in the engine as requests of their own
        # (`SamplingParams.sequences`): parent rid → their rids, and each one → (parent, index)
        self._children: dict[str, list[str]] = {}
        self._seq_of: dict[str, tuple[str, int]] = {}
        self.failed: str | None = None
        self._channel = self._start_engine(config, threads)
        try:
            facts = self._wait_ready()  # first: the engine's own load error names the cause
            self.tokenizer = load_tokenizer(config.model.model_path)
        except BaseException:
            self._stop_engine(5.0)
            raise
        self.processor = (_Registry if self.text_process else OutputProcessor)(self.tokenizer)
        self.vocab_size: int = facts["vocab_size"]
        self.context_len: int = facts["context_len"]
        self.max_total_tokens: int = facts["max_total_tokens"]
        self.device: str = facts["device"]
        self.torch_threads: int = facts["torch_threads"]
        self.tp_worker_pids: list[int] | None = facts["tp_worker_pids"]
        self._stats: dict[str, int] = facts["stats"]
        self._receiver = threading.Thread(target=self._receive, name="mla-engine-receiver",
                                          daemon=True)
        self._receiver.start()
        freeze_startup_objects()  # this process's start-up objects, out of the collector's way

    # ------------------------------------------------------------------ where the engine runs
    def _start_engine(self, config: EngineConfig, threads: int | None) -> Channel:
        raise NotImplementedError

    def _engine_alive(self) -> bool:
        raise NotImplementedError

    def _engine_ended(self) -> str:
        """How the engine ended, for messages ("the engine process (pid N) exited (...)")."""
        raise NotImplementedError

    def _join_engine(self, timeout_s: float) -> None:
        raise NotImplementedError

    def _kill_engine(self) -> None:
        """Stop an engine that did not stop when asked (nothing for a thread)."""

    def kill(self) -> None:
        """Stop the engine at once without asking it, its tensor-parallel workers with it: for
        a front door whose server is gone. Nothing for an engine thread (it ends with this
        process)."""

    # ------------------------------------------------------------------ start and stop
    def _wait_ready(self) -> dict[str, Any]:
        while not self._channel.poll(_START_POLL_S):
            if not self._engine_alive():
                self._join_engine(1.0)
                raise EngineStartError(f"{self._engine_ended()} while loading")
        try:
            kind, payload = self._channel.recv()
        except (EOFError, OSError):
            self._join_engine(5.0)
            raise EngineStartError(f"{self._engine_ended()} while loading") from None
        if kind == "load_error":
            self._join_engine(10.0)
            raise EngineStartError(payload)
        return payload

    def close(self) -> None:
        """Stop the engine (it aborts what is left and stops its tensor-parallel workers) and
        wait for it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_engine(_CLOSE_TIMEOUT_S)

    def _stop_engine(self, timeout_s: float) -> None:
        self._receiving = False  # the engine's exit is no failure now
        try:
            with self._send_lock:
                self._channel.send(("close",))
        except (BrokenPipeError, EOFError, OSError):
            pass
        self._join_engine(timeout_s)
        if self._engine_alive():
            self._kill_engine()
        receiver = getattr(self, "_receiver", None)
        if receiver is not None:
            receiver.join(timeout_s)
        self._channel.close()

    # ------------------------------------------------------------------ any thread
    def add_request(self, request: GenerateRequest) -> None:
        """Check and tokenize a request and hand it to the engine.

        Raises:
            InvalidRequestError: empty prompt, both/neither of text and input_ids, ids outside
                the vocab, bad sampling values, beyond the context or the pool, duplicate id,
                shutting down.
            EngineFailedError: the engine (or its process) has failed.
        """
        if self.failed is not None:
            raise EngineFailedError(self.failed)
        if self._closed:
            raise InvalidRequestError("the engine is shutting down")
        ids = validate_request(request, self.tokenizer, self.vocab_size, self.context_len,
                               self.max_total_tokens)
        sp = request.sampling_params
        seqs = sp.sequences(request.rid)
        with self._lock:  # registered before `failed` can be set without failing it too
            if self.failed is not None:
                raise EngineFailedError(self.failed)
            if request.rid in self._children or any(r in self.processor for r, _ in seqs):
                raise InvalidRequestError(f"request id {request.rid!r} is already in use")
            for seq_rid, seq_sp in seqs:
                self.processor.add(seq_rid, ids, seq_sp, request.stream)
            if len(seqs) > 1:
                self._children[request.rid] = [seq_rid for seq_rid, _ in seqs]
                for i, (seq_rid, _) in enumerate(seqs):
                    self._seq_of[seq_rid] = (request.rid, i)
        # (the detokenizer process takes the client's `stream` off the end on the way)
        message = ("add", request.rid, ids, sp, engine_streams(sp, request.stream))
        if self.text_process:
            message += (request.stream,)
        if not self._send(message):
            with self._lock:
                for seq_rid, _ in seqs:
                    self.processor.forget(seq_rid)
                    self._seq_of.pop(seq_rid, None)
                self._children.pop(request.rid, None)
            raise EngineFailedError(self.failed or "the engine is gone")

    def abort(self, rid: str) -> None:
        """Abort `rid`, all its completions (their final outputs follow from `get_outputs`;
        unknown ids are ignored)."""
        for seq_rid in self._children.get(rid) or (rid,):
            self._send(("abort", seq_rid))

    def stats(self) -> dict[str, int]:
        """The engine's counters as of its latest report (`Engine.stats`)."""
        return dict(self._stats)

    def token_text(self, token_id: int) -> str:
        """One token's text (logprobs' `decoded_token`)."""
        return self.processor.token_text(token_id)

    def _send(self, message: tuple) -> bool:
        """Send `message` to the engine; False (and `failed` set) when it is gone."""
        try:
            with self._send_lock:
                self._channel.send(message)
            return True
        except (BrokenPipeError, EOFError, OSError):
            self._engine_gone()
            return False

    def _engine_gone(self) -> None:
        """The engine ended: set `failed` and queue one error output per live request."""
        self._join_engine(1.0)
        with self._lock:
            if self.failed is None:
                self.failed = f"{self._engine_ended()}; the model must be reloaded"
            rids = self.processor.rids()
        self._outputs.put([RequestOutput(rid, [], "", True, error=self.failed) for rid in rids])

    # ------------------------------------------------------------------ receiver thread
    def _receive(self) -> None:
        """Queue the engine's outputs as they come; notice an engine that ended."""
        channel = self._channel
        while self._receiving:
            try:
                if not channel.poll(_IDLE_POLL_S):
                    if not self._engine_alive() and self._receiving:
                        self._engine_gone()
                        return
                    continue
                kind, *payload = channel.recv()
            except (EOFError, OSError):
                if self._receiving:
                    self._engine_gone()
                return
            if kind == "out":
                outputs, failed, stats = payload
                if failed is not None and self.failed is None:
                    with self._lock:
                        self.failed = failed
                if stats is not None:
                    self._stats = stats
                if outputs or failed is not None:
                    self._outputs.put(outputs)
            elif kind == "check":
                self._checks.put(tuple(payload))

    # ------------------------------------------------------------------ the consumer's thread
    def get_outputs(self, timeout_s: float) -> list[RequestOutput]:
        """Every output the engine has made since the last call (possibly several steps'),
        with text, stop strings applied (`OutputProcessor.process`); waits up to `timeout_s`
        for the first. An empty list when nothing came (check `failed`). A request with
        `n` > 1 gets outputs of each completion under its own id, told apart by `index`; each
        completion ends with its own final output."""
        try:
            batches = [self._outputs.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while True:
            try:
                batches.append(self._outputs.get_nowait())
            except queue.Empty:
                break
        raw = batches[0] if len(batches) == 1 else [o for b in batches for o in b]
        outputs, stopped = self.processor.process(raw)
        for rid in stopped:
            self._send(("abort", rid))
        if self._seq_of:
            self._name_sequences(outputs)
        return outputs

    def _name_sequences(self, outputs: list[RequestOutput]) -> None:
        """Give the outputs of a request's completions its own id and their `index`."""
        with self._lock:
            for out in outputs:
                seq = self._seq_of.get(out.rid)
                if seq is None:
                    continue
                if out.finished:
                    del self._seq_of[out.rid]
                    siblings = self._children[seq[0]]
                    siblings.remove(out.rid)
                    if not siblings:
                        del self._children[seq[0]]
                out.rid, out.index = seq

    def check_invariant(self) -> None:
        """Ask the engine to check its pools (`Engine.check_invariant`); refreshes `stats`.

        Raises:
            AssertionError: the pool invariant failed, or the engine did not answer.
            EngineFailedError: the engine is gone (nothing to check).
        """
        if not self._send(("check",)):
            raise EngineFailedError(self.failed)
        try:
            verdict, self._stats = self._checks.get(timeout=_CHECK_TIMEOUT_S)
        except queue.Empty:
            if self.failed is not None and not self._engine_alive():
                raise EngineFailedError(self.failed) from None
            raise AssertionError(f"the engine did not answer within {_CHECK_TIMEOUT_S:.0f} s"
                                 ) from None
        if verdict is not None:
            raise AssertionError(verdict)


class ProcessClient(EngineClient):
    """The engine in a child process (module docstring); `pid` is its process id. With
    `text_process`, the detokenizer process (pid `detokenizer_pid`) between them makes the
    outputs' text."""

    def __init__(self, config: EngineConfig, threads: int | None = None,
                 text_process: bool = False) -> None:
        self.text_process = text_process
        self._detok: Any = None
        super().__init__(config, threads)

    def _start_engine(self, config: EngineConfig, threads: int | None) -> Channel:
        ctx = mp.get_context("spawn")
        ctx.set_executable(python_executable())
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        # Not a daemon: the child spawns tensor-parallel workers of its own.
        self._proc = ctx.Process(target=_child_main, args=(child_conn, config, threads),
                                 name="mla-engine", daemon=False)
        self._proc.start()
        child_conn.close()
        self.pid: int = self._proc.pid
        self.where = f"engine process pid {self.pid}"
        if self.text_process:
            front_conn, detok_conn = ctx.Pipe(duplex=True)
            self._detok = ctx.Process(
                target=_detokenizer_main,
                args=(detok_conn, parent_conn, config.model.model_path),
                name="mla-detokenizer", daemon=True)
            self._detok.start()
            detok_conn.close()
            parent_conn.close()  # the detokenizer's now: the engine sees EOF when it ends
            parent_conn = front_conn
            self.detokenizer_pid: int = self._detok.pid
            self.where += f", detokenizer process pid {self.detokenizer_pid}"
        return _PipeChannel(parent_conn)

    def _engine_alive(self) -> bool:
        return self._proc.is_alive() and (self._detok is None or self._detok.is_alive())

    def _engine_ended(self) -> str:
        engine = f"the engine process (pid {self.pid}) exited ({how_it_ended(self._proc.exitcode)})"
        detok = self._detok
        if detok is None or detok.exitcode is None:
            return engine
        # a detokenizer that failed (not one that ended after the engine did) is the cause
        if detok.exitcode != 0 or self._proc.exitcode is None:
            return (f"the detokenizer process (pid {detok.pid}) exited "
                    f"({how_it_ended(detok.exitcode)})")
        return engine

    def _join_engine(self, timeout_s: float) -> None:
        self._proc.join(timeout_s)
        if self._detok is not None:
            self._detok.join(min(timeout_s, 1.0))

    def kill(self) -> None:
        self._receiving = False  # the engine's exit is no failure now
        try:
            # the engine leads a process group of its own (_own_session), its workers in it
            os.killpg(self.pid, signal.SIGKILL)
        except OSError:  # setsid was refused: no such group
            self._proc.kill()
        if self._detok is not None:
            self._detok.kill()

    def _kill_engine(self) -> None:
        for proc in (self._proc, self._detok):
            if proc is None or not proc.is_alive():
                continue
            proc.terminate()
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)


class InProcessClient(EngineClient):
    """The engine on a thread of this process (module docstring)."""

    def _start_engine(self, config: EngineConfig, threads: int | None) -> Channel:
        to_engine: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        from_engine: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=_engine_thread_main,
            args=(_QueueChannel(to_engine, from_engine), config, threads),
            name="mla-engine", daemon=True)
        self._thread.start()
        self.where = "engine thread of this process"
        return _QueueChannel(from_engine, to_engine)

    def _engine_alive(self) -> bool:
        return self._thread.is_alive()

    def _engine_ended(self) -> str:
        return "the engine thread ended"

    def _join_engine(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


def make_client(config: EngineConfig, in_process: bool = False,
                threads: int | None = None, text_process: bool = False) -> EngineClient:
    """An `InProcessClient` (in_process) or a `ProcessClient` for `config`, with a detokenizer
    process when `text_process`."""
    if in_process:
        return InProcessClient(config, threads)
    return ProcessClient(config, threads, text_process=text_process)


def _engine_thread_main(channel: _QueueChannel, config: EngineConfig,
                        threads: int | None) -> None:
    if threads is not None:
        torch.set_num_threads(threads)
    serve_engine(channel, config)


def _child_main(conn: Any, config: EngineConfig, threads: int | None) -> None:
    """Entry point of the engine process."""
    # Ctrl-C reaches the whole process group; the client decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _own_session()
    if threads is not None:
        torch.set_num_threads(threads)
    channel = _PipeChannel(conn)
    try:
        serve_engine(channel, config)
    finally:
        channel.close()


def _detokenizer_main(front_conn: Any, engine_conn: Any, model_path: str) -> None:
    """Entry point of the detokenizer process (module docstring): relay messages between the
    client (`front_conn`) and the engine (`engine_conn`) until either end is gone; the engine's
    outputs get their text here (`OutputProcessor.process`). It loads the tokenizer once the
    engine is ready, so that an engine's load error reaches the client first; a tokenizer that
    fails to load is the client's load error. Its start-up objects are frozen out of the garbage
    collector's way, as the engine's and the stub's are (`engine.freeze_startup_objects`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as the engine: the client decides
    front, engine = _PipeChannel(front_conn), _PipeChannel(engine_conn)
    try:
        first = engine.recv()
        if first[0] == "ready":
            try:
                processor = OutputProcessor(load_tokenizer(model_path))
            except Exception as e:  # noqa: BLE001 - the client's load fails with this message
                front.send(("load_error", f"the detokenizer process could not load the "
                                          f"tokenizer of {model_path}: {e}"))
                return
        front.send(first)
        if first[0] != "ready":
            return
        freeze_startup_objects()  # torch and transformers out of the full collections' way
        # Messages to the engine go through a thread of their own: this one may block sending
        # a step's outputs to the client, and must never block on an engine that is itself
        # blocked sending the next ones here.
        to_engine: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        threading.Thread(target=_forward, args=(to_engine, engine), name="mla-to-engine",
                         daemon=True).start()
        poller = select.poll()
        poller.register(front_conn.fileno(), select.POLLIN)
        poller.register(engine_conn.fileno(), select.POLLIN)
        engine_fd = engine_conn.fileno()
        while True:
            for fd, _ in poller.poll():
                if fd == engine_fd:
                    message = engine.recv()
                    if message[0] == "out":
                        outputs, stopped = processor.process(message[1])
                        front.send(("out", outputs, *message[2:]))
                        for rid in stopped:
                            to_engine.put(("abort", rid))
                    else:
                        front.send(message)
                    continue
                message = front.recv()
                if message[0] == "add":
                    _, rid, ids, sp, _streams, stream = message
                    for seq_rid, seq_sp in sp.sequences(rid):
                        processor.forget(seq_rid)  # (the client refuses a live id)
                        processor.add(seq_rid, ids, seq_sp, stream)
                    message = message[:5]
                to_engine.put(message)
    except (EOFError, OSError):  # one end is gone: so is this relay (its pipes close)
        pass


def _forward(messages: "queue.SimpleQueue[tuple]", channel: _PipeChannel) -> None:
    """The detokenizer process's sender to the engine: `messages` in order, until the pipe
    is gone."""
    try:
        while True:
            channel.send(messages.get())
    except (EOFError, OSError):
        pass


def _own_session() -> None:
    """Move this process into a session of its own (setsid), hence into a scheduling group of
    its own where Linux groups processes by session (`autogroup`: kernel.sched_autogroup_enabled
    = 1 and the process in the root cpu cgroup, as on our CPU VMs; inside a container's cgroup it
    changes nothing). There the CPU scheduler weighs the engine against tritonserver, the stub and
    the clients as one group against another, instead of one thread against each of their
    threads: with per-token streaming their threads wake many times per decode step, and on a
    machine with few cores those wake-ups preempted the engine. Signals of the terminal's session
    no longer reach this process, which is what we want: the client decides when it stops
    (closing the pipe or sending ("close",)). No-op where setsid is refused."""
    try:
        os.setsid()
    except OSError:  # already a session or group leader
        pass


__all__ = ["EngineClient", "EngineStartError", "InProcessClient", "ProcessClient",
           "default_torch_threads", "make_client", "pack_outputs", "unpack_outputs"]
