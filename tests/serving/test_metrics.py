"""Unit tests of the custom metrics' values (`mla_backend.serving.metrics`) and of the responder's
accounting (`Responder._account_batch`), without tritonserver.

A fake `triton_python_backend_utils` module records every metric family, metric and IPC call
(`increment` / `observe` / `set`) and every response sent, in one event list, so the tests check
exact observations and their order against the responses.
"""

from __future__ import annotations

import importlib
import queue
import sys
import threading
import time
import types

import pytest

from mla_backend.request import FinishReason, RequestOutput, SamplingParams
from mla_backend.serving.metrics import (
    E2E_BUCKETS,
    FAILURE_REASONS,
    N_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    FinishedRequest,
    MetricsRecorder,
    token_buckets,
    token_gaps,
)
from mla_backend.serving.protocol import OutputOptions


# ------------------------------------------------------------------------------ a fake pb_utils
class FakePb(types.ModuleType):
    """The parts of `triton_python_backend_utils` the responder and the recorder use; `events`
    holds ("observe" | "increment" | "set", metric name, value) and ("send", rid, flags)."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    def __init__(self) -> None:
        super().__init__("triton_python_backend_utils")
        self.events: list[tuple] = []
        self.families: dict[str, dict] = {}
        pb = self

        class MetricFamily:
            COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

            def __init__(self, name, description, kind):
                self.name = name
                pb.families[name] = {"description": description, "kind": kind}

            def Metric(self, labels, buckets=None):  # noqa: N802 - the stub's name
                extra = {k: v for k, v in labels.items() if k not in ("model", "version")}
                if extra:  # a labelled series of its own: "name{k=v}"
                    pb.families[self.name].setdefault("series", []).append(labels)
                    return FakeMetric(pb, self.name + "{" + ",".join(
                        f"{k}={v}" for k, v in sorted(extra.items())) + "}")
                pb.families[self.name].update(labels=labels, buckets=buckets)
                return FakeMetric(pb, self.name)

        class TritonError:
            UNAVAILABLE, INTERNAL, CANCELLED, INVALID_ARG = "UNAVAILABLE", "INTERNAL", \
                "CANCELLED", "INVALID_ARG"

            def __init__(self, message, code):
                self.message, self.code = message, code

        class InferenceResponse:
            def __init__(self, output_tensors, error=None):
                self.output_tensors, self.error = output_tensors, error

        class Tensor:
            def __init__(self, name, array):
                self.name, self.array = name, array

        self.MetricFamily = MetricFamily
        self.TritonError = TritonError
        self.InferenceResponse = InferenceResponse
        self.Tensor = Tensor

    def values(self, op: str, name: str) -> list[float]:
        return [v for o, n, v in self.events if o == op and n == name]


class FakeMetric:
    def __init__(self, pb: FakePb, name: str) -> None:
        self.pb, self.name = pb, name

    def increment(self, value):
        self.pb.events.append(("increment", self.name, value))

    def observe(self, value):
        self.pb.events.append(("observe", self.name, value))

    def set(self, value):
        self.pb.events.append(("set", self.name, value))


class FakeSender:
    def __init__(self, pb: FakePb, rid: str) -> None:
        self.pb, self.rid = pb, rid
        self.finals = threading.Event()
        self.responses: list[tuple] = []  # (response, flags)

    def send(self, response, flags=0):
        self.pb.events.append(("send", self.rid, flags))
        self.responses.append((response, flags))
        if flags:
            self.finals.set()

    def is_cancelled(self):
        return False


class FakeClient:
    """The response thread's view of the engine: batches of outputs put by the test."""

    failed = None

    def __init__(self) -> None:
        self.batches: queue.Queue[list[RequestOutput]] = queue.Queue()

    def get_outputs(self, timeout_s: float) -> list[RequestOutput]:
        try:
            return self.batches.get(timeout=timeout_s)
        except queue.Empty:
            return []

    def stats(self):
        return {"running": 0, "waiting": 0, "total_slots": 10, "free_slots": 10,
                "evictable_slots": 0, "retractions": 0}

    def abort(self, rid):
        pass

    def token_text(self, token_id):
        return ""


class Logger:
    def __init__(self) -> None:
        self.errors: list[str] = []
        self.infos: list[str] = []

    def log_error(self, msg):
        self.errors.append(msg)

    def log_info(self, msg):
        self.infos.append(msg)


HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
              "vllm:request_generation_tokens", "vllm:request_params_n",
              "vllm:request_params_max_tokens")
TPOT = "vllm:time_per_output_token_seconds"
TTFT = "vllm:time_to_first_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"


# ------------------------------------------------------------------------------ pure functions
def vllm_build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's `build_1_2_5_buckets`, restated."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


def test_token_buckets_are_vllms():
    for max_len in (1, 2, 4, 5, 99, 100, 512, 4096, 131072):
        assert token_buckets(max_len) == [float(v) for v in vllm_build_1_2_5_buckets(max_len)]
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    with pytest.raises(ValueError):
        token_buckets(0)


def test_token_gaps_per_output():
    # the output with the first token: k − 1 gaps over first → last
    assert token_gaps(None, 10.0, 10.0, 1) == (0.0, 0)
    gap, count = token_gaps(None, 10.0, 10.3, 4)
    assert count == 3 and gap == pytest.approx(0.1)
    # later outputs: k gaps over previous token → last
    gap, count = token_gaps(10.3, 10.0, 10.5, 1)
    assert count == 1 and gap == pytest.approx(0.2)
    gap, count = token_gaps(10.5, 10.0, 11.1, 3)
    assert count == 3 and gap == pytest.approx(0.2)
    assert token_gaps(10.5, 10.0, 11.0, 0) == (0.0, 0)  # no token: no gap
    assert token_gaps(10.5, 10.0, 10.4, 2) == (0.0, 2)  # a clock step back counts as 0


# ------------------------------------------------------------------------------ MetricsRecorder
def test_recorder_families_names_kinds_buckets():
    pb = FakePb()
    MetricsRecorder(pb, "m", "3", max_model_len=512)
    f = pb.families
    failures = f.pop("mla_backend:request_failure_total")
    assert failures["kind"] == "counter"
    assert FAILURE_REASONS == ("invalid_argument", "cancelled", "unavailable", "internal")
    assert failures["series"] == [{"model": "m", "version": "3", "reason": r}
                                  for r in FAILURE_REASONS]
    assert all(v["labels"] == {"model": "m", "version": "3"} for v in f.values())
    assert f["vllm:prompt_tokens_total"]["kind"] == "counter"
    assert f["vllm:generation_tokens_total"]["kind"] == "counter"
    assert all(f[name]["kind"] == "histogram" for name in HISTOGRAMS)
    assert f[TTFT]["buckets"] == TTFT_BUCKETS
    assert f[TPOT]["buckets"] == TPOT_BUCKETS
    assert f[E2E]["buckets"] == E2E_BUCKETS
    assert f["vllm:request_params_n"]["buckets"] == N_BUCKETS == [1, 2, 5, 10, 20]
    for name in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:request_params_max_tokens"):
        assert f[name]["buckets"] == [1, 2, 5, 10, 20, 50, 100, 200, 500], name
    assert f["vllm:request_params_max_tokens"]["description"] == \
        "Histogram of the max_tokens request parameter."
    assert f["vllm:request_params_n"]["description"] == "Histogram of the n request parameter."
    assert {name for name, v in f.items() if v["kind"] == "gauge"} == {
        "mla_backend:num_requests_running", "mla_backend:num_requests_waiting",
        "mla_backend:kv_cache_usage_ratio"}
    assert pb.events == []  # creating the families sends nothing else


def test_recorder_buffers_then_flushes_exact_values():
    pb = FakePb()
    rec = MetricsRecorder(pb, "m", "1", max_model_len=512)
    rec.on_output(7, 1)
    rec.on_first_token(0.25)
    rec.on_token_gaps(0.0, 0)  # nothing
    rec.on_output(0, 3)
    rec.on_token_gaps(0.05, 3)
    rec.on_finished(FinishedRequest(prompt_tokens=7, generation_tokens=4, cached_tokens=2,
                                    e2e_s=0.5, max_tokens=16, n=1))
    rec.on_finished(FinishedRequest(prompt_tokens=3, generation_tokens=0, cached_tokens=0,
                                    e2e_s=0.1))  # max_tokens unknown: not observed
    rec.set_engine_stats({"running": 2, "waiting": 1, "total_slots": 100, "free_slots": 50,
                          "evictable_slots": 25, "retractions": 3})
    assert pb.events == []  # buffered only
    rec.flush()
    assert pb.values("increment", "vllm:prompt_tokens_total") == [7]
    assert pb.values("increment", "vllm:generation_tokens_total") == [4]
    assert pb.values("observe", TTFT) == [0.25]
    assert pb.values("observe", TPOT) == [0.05, 0.05, 0.05]
    assert pb.values("observe", E2E) == [0.5, 0.1]
    assert pb.values("observe", "vllm:request_prompt_tokens") == [7.0, 3.0]
    assert pb.values("observe", "vllm:request_generation_tokens") == [4.0, 0.0]
    assert pb.values("observe", "vllm:request_params_n") == [1.0, 1.0]
    assert pb.values("observe", "vllm:request_params_max_tokens") == [16.0]
    assert pb.values("increment", "mla_backend:prefix_cache_hit_tokens_total") == [2]
    assert pb.values("set", "mla_backend:num_requests_running") == [2.0]
    assert pb.values("set", "mla_backend:num_requests_waiting") == [1.0]
    assert pb.values("set", "mla_backend:kv_cache_usage_ratio") == [0.25]
    assert pb.values("increment", "mla_backend:num_retractions_total") == [3]
    # a second flush sends only what changed
    n_events = len(pb.events)
    rec.flush()
    assert len(pb.events) == n_events
    rec.set_engine_stats({"running": 2, "waiting": 0, "total_slots": 100, "free_slots": 50,
                          "evictable_slots": 25, "retractions": 5})
    rec.flush()
    assert pb.events[n_events:] == [("set", "mla_backend:num_requests_waiting", 0.0),
                                    ("increment", "mla_backend:num_retractions_total", 2)]
    rec.close()
    rec.close()  # idempotent
    assert not hasattr(rec, "tpot")


def test_count_failure_increments_its_reason_at_once():
    pb = FakePb()
    rec = MetricsRecorder(pb, "m", "1", max_model_len=512)
    rec.count_failure("invalid_argument")
    rec.count_failure("invalid_argument")
    rec.count_failure("cancelled")
    name = "mla_backend:request_failure_total"
    assert pb.events == [("increment", f"{name}{{reason=invalid_argument}}", 1),
                         ("increment", f"{name}{{reason=invalid_argument}}", 1),
                         ("increment", f"{name}{{reason=cancelled}}", 1)]
    rec.count_failure("unavailable", 5)
    assert pb.events[-1] == ("increment", f"{name}{{reason=unavailable}}", 5)
    with pytest.raises(KeyError):
        rec.count_failure("timeout")
    rec.close()
    assert not hasattr(rec, "failures")


# ------------------------------------------------------------------------------ the responder
@pytest.fixture
def fake_pb(monkeypatch):
    """The fake pb module in place of the stub's, and a freshly imported responder module."""
    pb = FakePb()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    monkeypatch.delitem(sys.modules, "mla_backend.serving.responder", raising=False)
    responder = importlib.import_module("mla_backend.serving.responder")
    # no periodic flush: only the flush before final responses (and the last one, at stop)
    monkeypatch.setattr(responder, "_METRICS_FLUSH_S", 1e9)
    yield pb, responder
    sys.modules.pop("mla_backend.serving.responder", None)


class Harness:
    def __init__(self, pb: FakePb, responder_module, stream_interval: int = 1) -> None:
        self.pb = pb
        self.client = FakeClient()
        self.logger = Logger()
        self.metrics = MetricsRecorder(pb, "m", "1", max_model_len=512)
        self.responder = responder_module.Responder(
            self.client, self.logger, "m", self.metrics, num_senders=2,
            stream_interval=stream_interval,
            log_requests=True, on_fatal=lambda message: None)
        self.senders: dict[str, FakeSender] = {}
        self.number = 0

    def register(self, rid: str, stream: bool, max_tokens: int = 16, n: int = 1,
                 options: OutputOptions | None = None) -> float:
        """Register `rid`; returns its arrival time (s, monotonic)."""
        sender = self.senders[rid] = FakeSender(self.pb, rid)
        live = self.responder.register(rid, sender, options or OutputOptions(stream=stream),
                                       self.number,
                                       sampling=SamplingParams(max_new_tokens=max_tokens, n=n))
        self.number += 1
        live.accepted = True
        return live.arrival

    def feed(self, *outputs: RequestOutput) -> None:
        """One `get_outputs` batch."""
        self.client.batches.put(list(outputs))

    def wait_final(self, rid: str) -> None:
        assert self.senders[rid].finals.wait(10.0), f"no FINAL for {rid}"

    def stop(self) -> list[tuple]:
        self.responder.stop()
        assert self.logger.errors == []
        return self.pb.events


def out(rid: str, n_tokens: int, total: int, first: float | None, last: float | None,
        finished: bool = False, prompt: int = 5) -> RequestOutput:
    return RequestOutput(rid=rid, new_token_ids=list(range(n_tokens)), new_text="x" * n_tokens,
                         finished=finished,
                         finish_reason=FinishReason.LENGTH if finished else None,
                         num_input_tokens=prompt, num_output_tokens=total,
                         first_token_time=first, last_token_time=last)


def test_streaming_request_one_gap_per_token_before_coalescing(fake_pb):
    pb, responder = fake_pb
    h = Harness(pb, responder)
    t = h.register("s", stream=True, max_tokens=9)
    f = t + 0.5  # the engine's first token
    h.feed(out("s", 1, 1, f, f))
    # two outputs in one batch (coalesced into one response): each keeps its own gaps
    h.feed(out("s", 1, 2, f, f + 0.1), out("s", 2, 4, f, f + 0.3))
    h.feed(out("s", 1, 5, f, f + 0.35, finished=True))
    h.wait_final("s")
    events = h.stop()
    assert pb.values("observe", TPOT) == pytest.approx([0.1, 0.1, 0.1, 0.05])  # N − 1 = 4
    assert sum(pb.values("observe", TPOT)) == pytest.approx(0.35)  # engine last − first token
    assert pb.values("observe", TTFT) == pytest.approx([0.5])  # engine first token − arrival
    (e2e,) = pb.values("observe", E2E)
    assert e2e >= 0.0
    assert sum(pb.values("increment", "vllm:generation_tokens_total")) == 5
    assert sum(pb.values("increment", "vllm:prompt_tokens_total")) == 5  # once per request
    assert pb.values("observe", "vllm:request_generation_tokens") == [5.0]
    assert pb.values("observe", "vllm:request_params_max_tokens") == [9.0]
    assert pb.values("observe", "vllm:request_params_n") == [1.0]
    # the coalesced batch went out as one response: 3 responses in all, the last FINAL
    assert [e for e in events if e[0] == "send"] == [("send", "s", 0), ("send", "s", 0),
                                                     ("send", "s", 1)]
    (line,) = h.logger.infos
    assert "output_tokens=5 ttft_s=0.5000 tpot_s=0.0875" in line


def test_non_streaming_request_spreads_its_time_and_ttft_is_engine_time(fake_pb):
    pb, responder = fake_pb
    h = Harness(pb, responder)
    t = h.register("n", stream=False, max_tokens=4)
    h.feed(out("n", 4, 4, t + 0.2, t + 0.5, finished=True))  # one output of 4 tokens
    h.wait_final("n")
    h.stop()
    assert pb.values("observe", TPOT) == pytest.approx([0.1, 0.1, 0.1])
    assert pb.values("observe", TTFT) == pytest.approx([0.2])  # not arrival → final output
    (e2e,) = pb.values("observe", E2E)
    assert 0.0 <= e2e <= time.monotonic() - t  # adapter arrival → final output (real time)
    assert pb.values("observe", "vllm:request_params_max_tokens") == [4.0]


def test_first_output_with_several_tokens_then_one(fake_pb):
    pb, responder = fake_pb
    h = Harness(pb, responder)
    t = h.register("c", stream=True)
    h.feed(out("c", 3, 3, t + 1.0, t + 1.2))
    h.feed(out("c", 1, 4, t + 1.0, t + 1.5, finished=True))
    h.wait_final("c")
    h.stop()
    assert pb.values("observe", TPOT) == pytest.approx([0.1, 0.1, 0.3])
    assert pb.values("observe", TTFT) == pytest.approx([1.0])


def test_metrics_flushed_before_the_final_response(fake_pb):
    """With no periodic flush, each request's metrics are still in before its FINAL is sent; an
    unfinished request's tokens wait for a later flush."""
    pb, responder = fake_pb
    h = Harness(pb, responder)
    ta = h.register("a", stream=True)
    tb = h.register("b", stream=True)
    h.feed(out("a", 1, 1, ta + 0.1, ta + 0.1), out("b", 1, 1, tb + 0.1, tb + 0.1))
    h.feed(out("a", 1, 2, ta + 0.1, ta + 0.2, finished=True), out("b", 1, 2, tb + 0.1, tb + 0.3))
    h.wait_final("a")
    before_stop = list(pb.events)
    h.feed(out("b", 1, 3, tb + 0.1, tb + 0.4, finished=True))
    h.wait_final("b")
    events = h.stop()
    final_a = before_stop.index(("send", "a", 1))
    e2e_at = [i for i, e in enumerate(before_stop) if e[:2] == ("observe", E2E)]
    assert len(e2e_at) == 1 and e2e_at[0] < final_a  # a's e2e observed before its FINAL
    # one flush for that round: the tokens of both rounds, a's and b's
    assert ("increment", "vllm:generation_tokens_total", 4) in before_stop[:final_a]
    assert pb.values("observe", TPOT) == pytest.approx([0.1, 0.2, 0.1])
    final_b = events.index(("send", "b", 1))
    assert len([i for i, e in enumerate(events[:final_b]) if e[:2] == ("observe", E2E)]) == 2


def test_outputs_without_engine_times_fall_back_to_adapter_time(fake_pb):
    pb, responder = fake_pb
    h = Harness(pb, responder)
    h.register("x", stream=True)
    h.feed(out("x", 1, 1, None, None))
    h.feed(out("x", 2, 3, None, None, finished=True))
    h.wait_final("x")
    h.stop()
    gaps = pb.values("observe", TPOT)
    assert len(gaps) == 2 and all(g >= 0 for g in gaps)
    (ttft,) = pb.values("observe", TTFT)
    assert 0 <= ttft <= pb.values("observe", E2E)[0]


def test_error_output_is_not_accounted(fake_pb):
    pb, responder = fake_pb
    h = Harness(pb, responder)
    t = h.register("e", stream=True)
    h.feed(out("e", 1, 1, t + 0.1, t + 0.1))
    h.feed(RequestOutput(rid="e", new_token_ids=[], new_text="", finished=True,
                         error="engine failed"))
    h.wait_final("e")
    h.stop()
    assert pb.values("observe", E2E) == []  # an errored request is not a finished one
    assert pb.values("observe", TTFT) == pytest.approx([0.1])
    assert sum(pb.values("increment", "vllm:generation_tokens_total")) == 1


FAILURE = "mla_backend:request_failure_total"


def test_every_error_response_is_counted_by_its_code_before_it_is_sent(fake_pb):
    """Engine errors (INTERNAL), an invalid request the engine refused (INVALID_ARG), the
    engine's failure (UNAVAILABLE) and a request refused at the door (`reject`): one
    increment each, labelled by the code, before the response; a request that ends well
    counts nothing."""
    pb, responder = fake_pb
    h = Harness(pb, responder)
    h.register("ok", stream=False)
    h.register("bad", stream=True)
    h.register("inv", stream=False)
    h.feed(out("ok", 2, 2, None, None, finished=True),
           RequestOutput(rid="bad", new_token_ids=[], new_text="", finished=True,
                         error="engine step failed"),
           RequestOutput(rid="inv", new_token_ids=[], new_text="", finished=True,
                         error="structured_outputs: bad", invalid_request=True))
    for rid in ("ok", "bad", "inv"):
        h.wait_final(rid)
    door = FakeSender(pb, "door")
    h.responder.reject(door, "the model is shutting down", pb.TritonError.UNAVAILABLE)
    events = h.stop()
    counted = {e[1]: i for i, e in enumerate(events) if e[0] == "increment"
               and e[1].startswith(FAILURE)}
    assert len([e for e in events if e[0] == "increment" and e[1].startswith(FAILURE)]) == 3
    sends = {e[1]: i for i, e in enumerate(events) if e[0] == "send"}
    assert "ok" in sends
    # each count (one reason per request here) precedes its request's response
    for rid, reason in {"bad": "internal", "inv": "invalid_argument",
                        "door": "unavailable"}.items():
        assert counted[f"{FAILURE}{{reason={reason}}}"] < sends[rid], rid
    assert door.responses[0][0].error.code == pb.TritonError.UNAVAILABLE


def test_cancelled_and_unloaded_requests_are_counted(fake_pb, monkeypatch):
    pb, responder = fake_pb
    monkeypatch.setattr(responder, "_CANCEL_POLL_S", 0.0)
    h = Harness(pb, responder)
    h.register("c", stream=True)
    h.register("u", stream=True)
    h.senders["c"].is_cancelled = lambda: True
    h.wait_final("c")
    events = h.stop()  # "u" never got an output: unloaded
    assert h.senders["c"].responses[-1][0].error.code == pb.TritonError.CANCELLED
    assert h.senders["u"].responses[-1][0].error.code == pb.TritonError.UNAVAILABLE
    counted = [e[1] for e in events if e[0] == "increment" and e[1].startswith(FAILURE)]
    assert sorted(counted) == [FAILURE + "{reason=cancelled}", FAILURE + "{reason=unavailable}"]


def test_a_response_that_cannot_be_built_ends_its_request_with_one_error(fake_pb, monkeypatch):
    """Building a response raises (here: for "x" only): "x" is aborted in the engine and gets
    one INTERNAL error as its FINAL, counted; later outputs of "x" are dropped; "y" is served."""
    pb, responder = fake_pb
    real = responder.build_outputs

    def build(out, *args):
        if out.rid == "x":
            raise RuntimeError("no text for this token")
        return real(out, *args)

    monkeypatch.setattr(responder, "build_outputs", build)
    h = Harness(pb, responder)
    aborted = []
    h.client.abort = aborted.append
    h.register("x", stream=True)
    h.register("y", stream=True)
    h.feed(out("x", 1, 1, None, None), out("y", 1, 1, None, None))
    h.wait_final("x")
    h.feed(out("x", 1, 2, None, None, finished=True), out("y", 1, 2, None, None, finished=True))
    h.wait_final("y")
    responder_log = list(h.logger.errors)
    h.logger.errors.clear()  # (Harness.stop asserts no other error was logged)
    events = h.stop()
    (only,) = h.senders["x"].responses
    assert only[1] == 1 and only[0].error.code == pb.TritonError.INTERNAL
    assert "preparing a response failed" in only[0].error.message
    assert aborted == ["x"]
    assert [r[1] for r in h.senders["y"].responses] == [0, 1]
    assert [e[1] for e in events if e[0] == "increment" and e[1].startswith(FAILURE)] == [
        FAILURE + "{reason=internal}"]
    assert len(responder_log) == 1 and "x" in responder_log[0]
