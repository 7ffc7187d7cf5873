"""`EngineClient` (the engine's front door for servers) against an in-process `Engine`, without
tritonserver, for each place the engine runs (`ProcessClient`: a child process, its outputs'
text made in the client or in a detokenizer process; `InProcessClient`: a thread): the same
greedy and seeded outputs with text and stop strings, bad requests refused at once in the
caller, aborts, counters and the pool invariant from the engine, a load error's message, the
engine or detokenizer process killed mid-request, and no process left behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from mla_backend.client import EngineStartError, InProcessClient, ProcessClient
from mla_backend.client.engine_client import pack_outputs, unpack_outputs
from mla_backend.config import EngineConfig
from mla_backend.engine import Engine, EngineFailedError, InvalidRequestError
from mla_backend.request import FinishReason, GenerateRequest, RequestOutput, SamplingParams

REPO = Path(__file__).resolve().parents[2]
WEIGHTS = REPO / "model_repository" / "deepseek-v2-tiny" / "weights"
SETTINGS = {"context_length": "256", "max_total_tokens": "2048", "max_running_requests": "8",
            "chunked_prefill_size": "128", "max_prefill_tokens": "256"}
PROMPTS = ["Once upon a time, in a small village by the sea,", "The lighthouse keeper said",
           "Tom and Lily went to the park. They"]
WAIT_S = 120.0


def _config(**over: str) -> EngineConfig:
    return EngineConfig.create(model_path=str(WEIGHTS), **{**SETTINGS, **over})


def _sampling(i: int) -> SamplingParams:
    if i % 2:  # seeded sampling must not depend on the process either
        return SamplingParams(max_new_tokens=12 + i, temperature=0.8, top_p=0.9, seed=100 + i,
                              ignore_eos=True)
    return SamplingParams(max_new_tokens=12 + i, temperature=0.0, ignore_eos=True)


def _reference(requests: list[GenerateRequest]) -> dict[str, tuple[list[int], str, object]]:
    """rid → (token ids, text, finish reason) from an in-process `Engine.generate`."""
    engine = Engine(_config())
    try:
        results = engine.generate([r.text for r in requests],
                                  [r.sampling_params for r in requests])
    finally:
        engine.close()
    return {r.rid: (res.token_ids, res.text, res.finish_reason)
            for r, res in zip(requests, results)}


def _run(client, requests: list[GenerateRequest]) -> dict[str, tuple[list[int], str, object]]:
    """Add `requests`, read outputs until each has finished: rid → (token ids, text, reason)."""
    for request in requests:
        client.add_request(request)
    got: dict[str, list] = {r.rid: [[], "", None] for r in requests}
    done: set[str] = set()
    deadline = time.monotonic() + WAIT_S
    while len(done) < len(requests):
        assert time.monotonic() < deadline, f"unfinished: {set(got) - done}"
        for out in client.get_outputs(0.1):
            assert out.rid not in done, "an output after the final one"
            assert out.error is None, out.error
            got[out.rid][0] += out.new_token_ids
            got[out.rid][1] += out.new_text
            if out.finished:
                got[out.rid][2] = out.finish_reason
                done.add(out.rid)
    return {rid: tuple(v) for rid, v in got.items()}


def _settle(client, seconds: float = 10.0) -> dict[str, int]:
    """The engine's counters once no request is live or running there."""
    deadline = time.monotonic() + seconds
    while client.stats()["live"] or client.stats()["running"]:
        assert time.monotonic() < deadline, client.stats()
        assert client.get_outputs(0.1) == []
    return client.stats()


@pytest.fixture(scope="module", params=["process", "detokenizer", "thread"])
def client(request):
    threads = torch.get_num_threads()
    if request.param == "thread":
        c = InProcessClient(_config(), threads=1)
    else:
        c = ProcessClient(_config(), threads=1, text_process=request.param == "detokenizer")
        assert c.text_process == (request.param == "detokenizer")
    yield c
    c.close()
    torch.set_num_threads(threads)


def _requests(tag: str) -> list[GenerateRequest]:
    """The prompts, streaming, and two more: a stop string (found by the client's output
    processor, which then aborts the request in the engine) and a non-streaming request."""
    return [GenerateRequest(rid=f"{tag}{i}", text=p, sampling_params=_sampling(i), stream=True)
            for i, p in enumerate(PROMPTS)] + [
        GenerateRequest(rid=f"{tag}stop", text=PROMPTS[0], stream=True, sampling_params=(
            SamplingParams(max_new_tokens=24, temperature=0.0, stop=(" I s",)))),
        GenerateRequest(rid=f"{tag}whole", text=PROMPTS[1], stream=False,
                        sampling_params=SamplingParams(max_new_tokens=9, temperature=0.0))]


def test_outputs_equal_the_in_process_engine(client):
    want = _reference(_requests("a"))
    got = _run(client, _requests("a"))
    assert got == want
    assert all(len(got[f"a{i}"][0]) == 12 + i for i in range(len(PROMPTS)))
    assert got["astop"][2] == FinishReason.STOP and got["awhole"][1]
    assert len(got["astop"][0]) < 24  # the stop string ended it
    assert client.context_len == 256 and client.max_total_tokens == 2048
    assert client.failed is None
    # The engine's counters arrive with its outputs: every slot free or held by the radix cache
    # (evictable), none by a request (the one a stop string ended was aborted there).
    stats = _settle(client)
    assert stats["total_slots"] == 2048, stats
    assert stats["free_slots"] + stats["evictable_slots"] == 2048 and stats["protected_slots"] == 0
    assert stats["evictable_slots"] > 0, stats  # the prompts went into the tree
    assert len(client.processor) == 0  # its per-request state went with the final outputs


def test_the_engine_loop_counts_its_steps(client):
    """`engine.LoopTimes` in the counters: one step and one output per token of a lone
    streaming greedy request (its prefill makes the first), their time, and no more steps once
    it has ended: the wait after it counts as idle."""
    client.check_invariant()  # fresh counters come with the answer
    before = client.stats()
    sp = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    _run(client, [GenerateRequest(rid="loop", text=PROMPTS[0], sampling_params=sp,
                                  stream=True)])
    client.check_invariant()
    after = client.stats()
    assert after["loop_steps"] - before["loop_steps"] == 10, (before, after)
    assert after["loop_outputs"] - before["loop_outputs"] == 10, (before, after)
    assert after["loop_step_ms"] > before["loop_step_ms"]
    time.sleep(0.3)
    client.check_invariant()
    later = client.stats()
    assert later["loop_steps"] == after["loop_steps"]
    assert later["loop_idle_ms"] - after["loop_idle_ms"] >= 200, (after, later)


def test_a_stop_string_ends_a_non_streaming_request_early(client):
    """Non-streaming with a stop string: the engine still sends every step's tokens (the
    output processor needs them to find the string), the client gets one output, cut there."""
    sp = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True, stop=(" I s",))
    want = _reference([GenerateRequest(rid="s", text=PROMPTS[0], sampling_params=sp)])["s"]
    client.add_request(GenerateRequest(rid="s", text=PROMPTS[0], sampling_params=sp))
    outs: list[RequestOutput] = []
    deadline = time.monotonic() + WAIT_S
    while not outs:
        assert time.monotonic() < deadline
        outs += client.get_outputs(0.1)
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == FinishReason.STOP
    assert (outs[0].new_token_ids, outs[0].new_text) == want[:2]
    assert outs[0].num_output_tokens == len(want[0]) < 200
    _settle(client)
    client.check_invariant()


def test_bad_requests_are_refused_in_the_caller(client):
    too_long = SamplingParams(max_new_tokens=250)
    cases = [
        (GenerateRequest(rid="b0", text=""), "text_input"),
        (GenerateRequest(rid="b1", input_ids=[1, 10**9]), "outside the vocabulary"),
        (GenerateRequest(rid="b2", text=PROMPTS[0], sampling_params=too_long), "context length"),
        (GenerateRequest(rid="b3", text="x", input_ids=[1]), "exactly one"),
    ]
    for request, needle in cases:
        with pytest.raises(InvalidRequestError, match=needle):
            client.add_request(request)
    # A prompt far beyond the context is refused by its length, before tokenizing (the message
    # counts characters); one just beyond it is tokenized and refused by its token count.
    with pytest.raises(InvalidRequestError, match=r"8000000 characters, at least \d+ tokens"):
        client.add_request(GenerateRequest(rid="b4", text="a " * 4_000_000))
    ctx = client.context_len
    with pytest.raises(InvalidRequestError, match=r"prompt \(\d+ tokens\) \+ max_tokens"):
        client.add_request(GenerateRequest(rid="b5", text="a " * (ctx + 10)))
    long = SamplingParams(max_new_tokens=200, ignore_eos=True)
    client.add_request(GenerateRequest(rid="dup", text=PROMPTS[1], sampling_params=long))
    with pytest.raises(InvalidRequestError, match="already in use"):
        client.add_request(GenerateRequest(rid="dup", text=PROMPTS[1]))
    client.abort("dup")
    reasons = {}
    deadline = time.monotonic() + WAIT_S
    while "dup" not in reasons:
        assert time.monotonic() < deadline
        for out in client.get_outputs(0.1):
            if out.finished:
                reasons[out.rid] = out.finish_reason
    assert reasons == {"dup": FinishReason.ABORT}
    client.check_invariant()  # the pools balance after the refusals and the abort
    # The id is free again once its request has ended.
    assert _run(client, [GenerateRequest(rid="dup", text=PROMPTS[1])])["dup"][2] is not None


def test_load_error_carries_the_engine_message(tmp_path):
    missing = tmp_path / "no-such-weights"
    for make in (ProcessClient, InProcessClient,
                 lambda *a, **k: ProcessClient(*a, **k, text_process=True)):
        with pytest.raises(EngineStartError, match=str(missing)):
            make(EngineConfig.create(model_path=str(missing), **SETTINGS), threads=1)


def test_killed_engine_process_fails_live_and_new_requests():
    ep = ProcessClient(_config(), threads=1)
    try:
        long = SamplingParams(max_new_tokens=200, ignore_eos=True)
        ep.add_request(GenerateRequest(rid="victim", text=PROMPTS[0], sampling_params=long,
                                       stream=True))
        seen = []
        while not seen:  # running: a first token came back
            seen += ep.get_outputs(0.1)
        os.kill(ep.pid, signal.SIGKILL)
        message = (f"the engine process (pid {ep.pid}) exited (signal 9, SIGKILL); the model "
                   "must be reloaded")
        errors = []
        deadline = time.monotonic() + WAIT_S
        while not errors:
            assert time.monotonic() < deadline, "the dead child was not noticed"
            errors = [o for o in ep.get_outputs(0.1) if o.error is not None]
        assert [(o.rid, o.error, o.finished) for o in errors] == [("victim", message, True)]
        assert len(ep.processor) == 0  # its state went with the error
        assert ep.failed == message
        with pytest.raises(EngineFailedError, match="must be reloaded"):
            ep.add_request(GenerateRequest(rid="late", text=PROMPTS[1]))
        with pytest.raises(EngineFailedError):
            ep.check_invariant()
        assert ep.get_outputs(0.2) == []  # one error per request, nothing after it
    finally:
        ep.close()
    assert not ep._proc.is_alive()


def _first_output(client, rid: str) -> None:
    """Add a long streaming request and wait for its first output (it is running)."""
    long = SamplingParams(max_new_tokens=200, ignore_eos=True)
    client.add_request(GenerateRequest(rid=rid, text=PROMPTS[0], sampling_params=long,
                                       stream=True))
    deadline = time.monotonic() + WAIT_S
    while not client.get_outputs(0.1):
        assert time.monotonic() < deadline


def _errors(client) -> list[tuple[str, str, bool]]:
    """The error outputs that come next, as (rid, error, finished)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        assert time.monotonic() < deadline, "the dead child was not noticed"
        errors = [(o.rid, o.error, o.finished) for o in client.get_outputs(0.1)
                  if o.error is not None]
        if errors:
            return errors


@pytest.mark.parametrize("victim", ["detokenizer", "engine"])
def test_killed_child_of_a_client_with_a_detokenizer_process(victim):
    """Either process killed mid-request: the live request ends with an error naming the dead
    process, later requests are refused, and the other process ends by itself (its pipe
    closed)."""
    ep = ProcessClient(_config(), threads=1, text_process=True)
    try:
        _first_output(ep, "victim")
        pid = ep.detokenizer_pid if victim == "detokenizer" else ep.pid
        os.kill(pid, signal.SIGKILL)
        message = (f"the {victim} process (pid {pid}) exited (signal 9, SIGKILL); the model "
                   "must be reloaded")
        assert _errors(ep) == [("victim", message, True)]
        assert len(ep.processor) == 0 and ep.failed == message
        with pytest.raises(EngineFailedError, match="must be reloaded"):
            ep.add_request(GenerateRequest(rid="late", text=PROMPTS[1]))
        other = ep._proc if victim == "detokenizer" else ep._detok
        other.join(WAIT_S)
        assert other.exitcode == 0
        assert ep.get_outputs(0.2) == []
    finally:
        ep.close()


def test_close_stops_the_engine_and_detokenizer_processes():
    ep = ProcessClient(_config(), threads=1, text_process=True)
    ep.add_request(GenerateRequest(rid="left", text=PROMPTS[2],
                                   sampling_params=SamplingParams(max_new_tokens=200)))
    ep.close()  # with a request still running
    assert ep._proc.exitcode == 0 and ep._detok.exitcode == 0
    assert not ep._receiver.is_alive() and ep.failed is None


def test_close_stops_the_child():
    ep = ProcessClient(_config(), threads=1)
    pid = ep.pid
    ep.add_request(GenerateRequest(rid="left", text=PROMPTS[2],
                                   sampling_params=SamplingParams(max_new_tokens=200)))
    ep.close()  # with a request still running
    assert ep._proc.exitcode == 0 and not ep._receiver.is_alive()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(InvalidRequestError, match="shutting down"):
        ep.add_request(GenerateRequest(rid="after", text=PROMPTS[0]))


def test_close_stops_the_engine_thread():
    threads = torch.get_num_threads()
    client = InProcessClient(_config(), threads=1)
    try:
        client.add_request(GenerateRequest(rid="left", text=PROMPTS[2],
                                           sampling_params=SamplingParams(max_new_tokens=200)))
    finally:
        client.close()  # with a request still running
        torch.set_num_threads(threads)
    assert not client._thread.is_alive() and not client._receiver.is_alive()
    assert client.failed is None


def test_child_leads_its_own_session_and_exits_when_the_stub_is_gone():
    """The engine process is a session (and process group) of its own, so a kill of
    tritonserver's process group does not reach it; it must end by itself once the client's end
    of the pipe is gone (the stub killed), with a request still running."""
    ep = ProcessClient(_config(), threads=1)
    try:
        assert os.getsid(ep.pid) == ep.pid and os.getpgid(ep.pid) == ep.pid
        assert os.getsid(ep.pid) != os.getsid(0)
        long = SamplingParams(max_new_tokens=200, ignore_eos=True)
        ep.add_request(GenerateRequest(rid="orphan", text=PROMPTS[0], sampling_params=long,
                                       stream=True))
        while not ep.get_outputs(0.1):  # running: its first output came back
            pass
        ep._receiving = False  # as if the stub were gone: nobody reads, the pipe closes
        ep._receiver.join(5.0)
        ep._channel.close()  # no ("close",): the pipe just closes, as when the stub dies
        ep._proc.join(WAIT_S)
        assert ep._proc.exitcode == 0
    finally:
        ep.close()


@pytest.mark.gpu
def test_cuda_engine_process_equals_in_process():
    """On a GPU (CUDA graphs, the overlap schedule, the triton backend by default): the child
    process owns CUDA, the caller never touches it, and the outputs equal an in-process engine's."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    config = EngineConfig.create(model_path=str(REPO / "checkpoints" / "deepseek-v2-tiny"),
                                 device="cuda", dtype="bfloat16", **SETTINGS)
    # Greedy only: in bf16 a request that reaches the child a step later lands in another
    # batch, and seeded sampling may then tell the difference.
    greedy = SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True)
    requests = [GenerateRequest(rid=f"g{i}", text=p, sampling_params=greedy, stream=True)
                for i, p in enumerate(PROMPTS)]
    engine = Engine(config)
    try:
        want = {r.rid: (res.token_ids, res.text, res.finish_reason) for r, res in
                zip(requests, engine.generate(PROMPTS, greedy))}
    finally:
        engine.close()
    ep = ProcessClient(config)
    try:
        assert ep.device.startswith("cuda")
        got = _run(ep, requests)
        ep.check_invariant()
    finally:
        ep.close()
    assert got == want


def test_outputs_cross_the_pipe_field_for_field():
    """`pack_outputs` / `unpack_outputs` (the pipe's form) keep every RequestOutput field,
    each set to a value other than its default, through pickling."""
    import dataclasses
    import pickle

    outs = [RequestOutput(rid="a", new_token_ids=[5, 6], new_text="xy", finished=True,
                          finish_reason=FinishReason.STOP, num_input_tokens=3,
                          num_output_tokens=7, cached_tokens=2, new_logprobs=[{5: -0.5}],
                          new_token_logprobs=[-0.5], cumulative_logprob=-1.25, error="boom",
                          first_token_time=1.5, last_token_time=2.5, invalid_request=True,
                          index=3),
            RequestOutput(rid="b", new_token_ids=[], new_text="", finished=False)]
    defaults = RequestOutput(rid="", new_token_ids=[], new_text="", finished=False)
    for f in dataclasses.fields(RequestOutput):
        assert getattr(outs[0], f.name) != getattr(defaults, f.name), f.name
    back = unpack_outputs(pickle.loads(pickle.dumps(pack_outputs(outs))))
    assert back == outs


def test_logprobs_and_stop_strings_equal_with_the_detokenizer_process():
    """A greedy request with top logprobs and one a stop string ends, through a client that
    makes the text itself and one with a detokenizer process: the same outputs, field for field
    (token ids, text, logprobs, finish), increment by increment, and the same `token_text`."""
    sps = {"lp": SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2),
           "st": SamplingParams(max_new_tokens=24, temperature=0.0, stop=(" I s",))}
    got = {}
    for text_process in (False, True):
        ep = ProcessClient(_config(), threads=1, text_process=text_process)
        try:
            rows: dict[str, list] = {rid: [] for rid in sps}
            for rid, sp in sps.items():
                ep.add_request(GenerateRequest(rid=rid, text=PROMPTS[0], sampling_params=sp,
                                               stream=True))
            deadline = time.monotonic() + WAIT_S
            while not all(r and r[-1][-1] for r in rows.values()):
                assert time.monotonic() < deadline
                for o in ep.get_outputs(0.1):
                    rows[o.rid].append((o.new_token_ids, o.new_text, o.new_logprobs,
                                        o.new_token_logprobs, o.num_output_tokens,
                                        o.finish_reason, o.error, o.finished))
            texts = [ep.token_text(t) for t, _ in rows["lp"][0][2][0].items()]
            got[text_process] = (rows, texts)
            _settle(ep)
            ep.check_invariant()
        finally:
            ep.close()
    assert got[True] == got[False]
    rows, texts = got[True]
    assert all(len(r[2][0]) >= 2 for r in rows["lp"]) and all(texts)
    assert rows["st"][-1][5] == FinishReason.STOP and sum(len(r[0]) for r in rows["st"]) < 24
