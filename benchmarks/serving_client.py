"""Shared pieces of the serving benchmarks (`serving_overhead.py`, `serving_soak.py`,
`bench_server_path.py`, ...); no benchmark here.

- `Job`: one request (a text prompt or prompt token ids, sampling parameters).
- `stream_load`: a closed-loop gRPC streaming client: `concurrency` requests in flight on ONE
  gRPC stream (requests multiplexed by id, responses read by tritonclient's stream thread), a
  finished request is replaced by the next job at once. One stream and one consumer thread keep
  the client's own CPU use low: on a 2-core machine the client shares the cores with the server.
- `engine_load`: the same closed loop on an in-process `Engine` (add_request / step).
- `RequestTimes`: with `record_times=True` both loads also keep, per job, when it was sent and
  when each response carrying tokens arrived, with its token count (`LoadStats.times`).
- `ProcTree`: RSS and CPU time of a process and all its descendants, from /proc (tritonserver
  plus its Python-backend stub processes).
- `system_busy_s`: busy CPU seconds of the whole machine (to spot other programs' load).
- `temp_repository`: a temp model repository with copies of our model folders and engine
  settings (`tests/serving/serving_helpers.write_model`).
"""

from __future__ import annotations

import os
import queue
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # mla_tools (the checkout's developer tools)
sys.path.insert(0, str(REPO / "tests" / "serving"))
from serving_helpers import read_metrics, series, write_model  # noqa: E402

__all__ = ["Job", "LoadStats", "ProcTree", "RequestTimes", "engine_load", "read_metrics",
           "series", "stream_load", "system_busy_s", "temp_repository"]


@dataclass(frozen=True)
class Job:
    """One request: a text prompt (`text_input`) or, with `prompt=None`, the prompt's token ids
    (`input_ids`, sent as INT64; in-process `GenerateRequest.input_ids`)."""

    prompt: str | None
    sampling: dict[str, Any]  # vLLM-style sampling parameters (max_tokens, temperature, seed, ...)
    input_ids: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError("Job: give exactly one of prompt and input_ids")


@dataclass
class RequestTimes:
    """One job's timeline (`time.perf_counter_ns()`; server side: arrival at tritonclient's
    stream callback). Only responses carrying tokens are listed: the server's empty final
    response and an in-process output without new tokens are not."""

    sent_ns: int  # just before the request went out (async_stream_infer / add_request)
    responses: list[tuple[int, int]] = field(default_factory=list)  # (arrival ns, tokens)


@dataclass
class LoadStats:
    requests: int = 0  # requests that ended (normally or with an error)
    errors: list[str] = field(default_factory=list)
    output_tokens: int = 0
    short: int = 0  # requests that ended normally with fewer tokens than max_tokens
    responses: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time during the run (the client / in-process engine)
    latency_s: list[float] = field(default_factory=list)
    times: dict[int, RequestTimes] = field(default_factory=dict)  # job index → its timeline
    # (filled only with record_times=True; a job never sent has no entry)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s if self.wall_s else 0.0


def _inputs(job: Job) -> list:
    """gRPC inputs of one streaming request (the e2e tests' builder)."""
    from test_triton_e2e import grpc_inputs

    ids = {} if job.input_ids is None else {"input_ids": job.input_ids}
    return grpc_inputs(job.prompt, sampling=job.sampling, exclude_input_in_output=True,
                       return_num_output_tokens=True, **ids)


def stream_load(url: str, model: str, jobs: list[Job], concurrency: int,
                timeout_s: float = 300.0, progress_every: int = 0,
                on_progress=None, record_times: bool = False,
                before_start: Callable[[], Any] | None = None,
                take: Callable[[], int | None] | None = None) -> LoadStats:
    """Run `jobs` through one gRPC stream with `concurrency` requests in flight.

    Args:
        timeout_s: give up when no response arrives for this long (s): the missing requests
            count as errors.
        progress_every: call `on_progress(done, stats)` every this many finished requests.
        record_times: fill `stats.times` (each response is stamped on tritonclient's stream
            thread as it arrives; without it the callback stamps nothing).
        before_start: called once the stream is open, before the first request (and the
            clock) starts: e.g. a barrier shared with other client processes.
        take: the index of the next job to send, None when none is left; called each time a
            slot frees (default: the jobs in order). Client processes that share one counter
            share one closed loop (`bench_server_path.client_procs_load`).
    Returns:
        LoadStats (tokens from the server's `num_output_tokens`).
    """
    import test_triton_e2e  # noqa: F401  (_inputs' builder: ~1 s to import, not on the clock)
    import tritonclient.grpc as grpcclient

    responses: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    if record_times:
        client.start_stream(callback=lambda result, error: responses.put(
            (result, error, time.perf_counter_ns())))
    else:
        client.start_stream(callback=lambda result, error: responses.put((result, error, 0)))
    stats = LoadStats()
    times = stats.times if record_times else None
    if take is None:
        order = iter(range(len(jobs)))

        def take() -> int | None:
            return next(order, None)
    if before_start is not None:
        before_start()
    live: dict[str, tuple[float, int, int]] = {}  # rid → (start, tokens so far, max_tokens)
    cpu0, t0 = time.process_time(), time.perf_counter()
    exhausted = False

    def send_next() -> None:
        nonlocal exhausted
        i = take()
        if i is None:
            exhausted = True
            return
        job = jobs[i]
        rid = str(i)
        live[rid] = (time.perf_counter(), 0, int(job.sampling.get("max_tokens", 16)))
        inputs = _inputs(job)
        if times is not None:
            times[i] = RequestTimes(time.perf_counter_ns())
        client.async_stream_infer(model, inputs, request_id=rid,
                                  enable_empty_final_response=True)

    try:
        while not exhausted and len(live) < concurrency:
            send_next()
        while live:
            try:
                result, error, arrived_ns = responses.get(timeout=timeout_s)
            except queue.Empty:
                stats.errors += [f"request {rid}: no response within {timeout_s} s"
                                 for rid in live]
                stats.requests += len(live)
                live.clear()
                break
            if error is not None:
                # tritonclient drops the request id of a stream error: retire the oldest request
                # (our adapter ends a request with exactly one error, flagged FINAL).
                stats.errors.append(str(error))
                stats.requests += 1
                live.pop(next(iter(live)))
            else:
                stats.responses += 1
                resp = result.get_response()
                rid = resp.id
                start, tokens, max_tokens = live[rid]
                n = result.as_numpy("num_output_tokens")
                n = int(n[0]) if n is not None else 0
                tokens += n
                if times is not None and n:
                    times[int(rid)].responses.append((arrived_ns, n))
                if not resp.parameters["triton_final_response"].bool_param:
                    live[rid] = (start, tokens, max_tokens)
                    continue
                del live[rid]
                stats.requests += 1
                stats.output_tokens += tokens
                stats.short += tokens < max_tokens
                stats.latency_s.append(time.perf_counter() - start)
            if not exhausted:
                send_next()
            if progress_every and on_progress and stats.requests % progress_every == 0:
                on_progress(stats.requests, stats)
    finally:
        stats.wall_s = time.perf_counter() - t0
        stats.cpu_s = time.process_time() - cpu0
        client.stop_stream(cancel_requests=bool(live))
        client.close()
    return stats


def engine_load(engine, jobs: list[Job], concurrency: int,
                record_times: bool = False,
                on_step: Callable[[float], None] | None = None) -> LoadStats:
    """The same closed loop on an in-process Engine (streaming requests, this thread steps;
    text and stop strings from an `OutputProcessor` here, as the server's front door has one).

    Args:
        record_times: fill `stats.times` (the outputs of one `engine.step()` share the time it
            returned; tokens: len(new_token_ids)). An unfinished output without text counts
            as the server counts it: no response, its tokens go with the request's next one.
        on_step: called after each step with its seconds (the step and the processing of its
            outputs), as `bench_suite.run_requests`' (e.g. `bench_suite.StepLog.on_step`).
    """
    from mla_backend.request import GenerateRequest, SamplingParams, validate_request
    from mla_backend.tokenizer.output_processor import OutputProcessor

    stats = LoadStats()
    processor = OutputProcessor(engine.tokenizer)
    times = stats.times if record_times else None
    todo = deque(enumerate(jobs))
    live: dict[str, float] = {}
    index: dict[str, int] = {}  # rid → job index (record_times only)
    held: dict[str, int] = {}  # rid → tokens made but not yet "sent" (no text yet)
    tag = f"bench-{time.monotonic_ns()}"
    cpu0, t0 = time.process_time(), time.perf_counter()

    def add_next() -> None:
        i, job = todo.popleft()
        rid = f"{tag}-{i}"
        ids = None if job.input_ids is None else list(job.input_ids)
        request = GenerateRequest(rid=rid, text=job.prompt, input_ids=ids, stream=True,
                                  sampling_params=SamplingParams.from_dict(job.sampling))
        if times is not None:
            index[rid] = i
            times[i] = RequestTimes(time.perf_counter_ns())
        ids = validate_request(request, engine.tokenizer, engine.vocab_size, engine.context_len,
                               engine.max_total_tokens)
        processor.add(rid, ids, request.sampling_params, stream=True)
        engine.submit(rid, ids, request.sampling_params, stream=True)
        live[rid] = time.perf_counter()

    while todo and len(live) < concurrency:
        add_next()
    while live:
        ts = time.perf_counter()
        outs, stopped = processor.process(engine.step())
        for rid in stopped:
            engine.abort(rid)
        if on_step is not None:
            on_step(time.perf_counter() - ts)
        now_ns = time.perf_counter_ns() if times is not None else 0
        for out in outs:
            if out.rid not in live:
                continue
            stats.output_tokens += len(out.new_token_ids)
            if not out.finished and not out.new_text:
                # as the adapter (`protocol.should_hold`): no text yet, no response; the tokens
                # go out with the next one
                held[out.rid] = held.get(out.rid, 0) + len(out.new_token_ids)
                continue
            stats.responses += 1
            tokens = len(out.new_token_ids) + held.pop(out.rid, 0)
            if times is not None and tokens:
                times[index[out.rid]].responses.append((now_ns, tokens))
            if not out.finished:
                continue
            stats.latency_s.append(time.perf_counter() - live.pop(out.rid))
            stats.requests += 1
            if out.error is not None:
                stats.errors.append(out.error)
            if todo:
                add_next()
    stats.wall_s = time.perf_counter() - t0
    stats.cpu_s = time.process_time() - cpu0
    return stats


class ProcTree:
    """A process and its descendants (found through /proc/<pid>/task/*/children)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._ticks = os.sysconf("SC_CLK_TCK")
        self._page = os.sysconf("SC_PAGE_SIZE")

    def pids(self) -> list[int]:
        out, stack = [], [self.pid]
        while stack:
            pid = stack.pop()
            out.append(pid)
            try:
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children") as f:
                        stack += [int(c) for c in f.read().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
        return out

    def rss_bytes(self) -> dict[int, int]:
        """pid → resident set size (bytes), for the live processes of the tree."""
        out = {}
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/statm") as f:
                    out[pid] = int(f.read().split()[1]) * self._page
            except (FileNotFoundError, ProcessLookupError):
                pass
        return out

    def cpu_s(self) -> float:
        """User + system CPU seconds of the live processes of the tree (threads included)."""
        total = 0
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime
            except (FileNotFoundError, ProcessLookupError):
                pass
        return total / self._ticks

    def sched_by_name(self) -> dict[str, list[float]]:
        """`sched_of` summed per program name (`name`: tritonserver, triton_python_backend_stub,
        python3 for the adapter's engine process and tensor-parallel workers)."""
        out: dict[str, list[float]] = {}
        for pid in self.pids():
            total = out.setdefault(self.name(pid), [0.0, 0.0, 0.0])
            for i, v in enumerate(sched_of(pid)):
                total[i] += v
        return out

    @staticmethod
    def name(pid: int) -> str:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            return os.path.basename(argv[0].decode(errors="replace"))
        except (FileNotFoundError, ProcessLookupError):
            return "?"


def sched_of(pid: int, tid: int | None = None) -> list[float]:
    """[CPU s, run-queue wait s, times scheduled in] of process `pid`, summed over its threads,
    or of its thread `tid` alone (/proc/<pid>/task/<tid>/schedstat; zeros for a process that is
    gone). The wait is time a thread was runnable but had no core; every time it blocks or is
    preempted it is scheduled in again. Threads that have ended are not counted."""
    total = [0.0, 0.0, 0.0]
    try:
        tids = [str(tid)] if tid is not None else os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return total
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                cpu_ns, wait_ns, slices = (int(x) for x in f.read().split()[:3])
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        total[0] += cpu_ns / 1e9
        total[1] += wait_ns / 1e9
        total[2] += slices
    return total


def system_busy_s() -> float:
    """CPU seconds the whole machine spent busy since boot (all cores, /proc/stat): the busy time
    of a run minus that of our processes is what other programs took meanwhile."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def temp_repository(root: Path, models: dict[str, tuple[str, dict[str, str]]],
                    extra_params: dict[str, dict[str, str]] | None = None) -> Path:
    """Write `name → (source model, engine parameters)` into the empty folder `root`, with
    `extra_params[name]` (adapter parameters the source config may lack); returns `root`."""
    root.mkdir(parents=True, exist_ok=True)
    for name, (source, params) in models.items():
        write_model(root, name, params, source=source,
                    extra_params=(extra_params or {}).get(name))
    return root
