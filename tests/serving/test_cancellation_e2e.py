"""End-to-end cancellation tests on a real tritonserver (issue 5).

One server for the module over a temp repository holding one deepseek-v2-tiny copy, `dsv2-cancel`:
max_running_requests 1 (a second request waits QUEUED behind a running one), a 1024-slot KV
pool, context 512, and 8-token prefill chunks (a ~450-token prompt takes ~55 engine steps to
prefill, so it is still PREFILLING for a while after it arrives).

Each test cancels a request in one phase, then checks what must hold after any cancellation:

- the server log shows `request <rid>#N was cancelled by the client; aborted` exactly once for
  it (the adapter's response thread polls `is_cancelled()` of up to 16 live requests every
  0.1 s, round robin → `Engine.abort`);
- the model's gauges on the metrics port (`mla_backend:num_requests_running` / `..._waiting` /
  `mla_backend:kv_cache_usage_ratio`) return to 0: its request slot, KV slots and radix-tree locks
  came back (cached-but-evictable slots count as free);
- a following greedy request returns the text of an in-process `Engine` with the same settings.

Phases (best effort: the engine's phase is not observable from outside, only bounded):
- decoding: cancelled after a few streamed deltas (tokens exist, so it is past prefill);
- queued: cancelled once the `waiting` gauge reads 1 while a long request holds the only slot;
- prefilling: a fresh ~450-token prompt cancelled as soon as the `kv` gauge shows it holding
  slots while no token has streamed, i.e. during its ~55 prefill chunks (the gauge is refreshed
  every 0.2 s; on a much faster host it could already be decoding; the checks still hold);
- HTTP: the client closes a `generate_stream` response after its first event.
The last test stops the server: the model logs `pool invariant ok` with no live request.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import requests

from mla_backend.config import EngineConfig
from mla_backend.request import SamplingParams
from mla_tools.tritonserver import TritonServer

from test_triton_e2e import Stream, grpc_inputs, is_final, text_of
from serving_helpers import IDLE, gauges, wait_gauges, write_model

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "model_repository" / "deepseek-v2-tiny"
MODEL = "dsv2-cancel"
SETTINGS = {"context_length": "512", "max_total_tokens": "1024", "max_running_requests": "1",
            "chunked_prefill_size": "8", "max_prefill_tokens": "8"}
PROMPT = "The capital of France is"
CHECK_TOKENS = 8
LONG_TOKENS = 450  # ~10 ms a token in-process: several seconds of decoding
LONG_JOB = {"max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0}
TIMEOUT = 120.0
SETTLE_S = 30.0  # how long gauges / log lines may take to show a cancellation


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("cancel_repository")
    write_model(root, MODEL, SETTINGS)
    with TritonServer(root, startup_timeout=300) as srv:
        yield srv


_ENGINE: list = []


def baseline(prompt: str, max_tokens: int) -> str:
    """Greedy text of `prompt` alone on an in-process Engine with the served model's settings."""
    from mla_backend.engine import Engine

    if not _ENGINE:
        _ENGINE.append(Engine(EngineConfig.create(model_path=str(SRC / "weights"), **SETTINGS)))
    sp = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return _ENGINE[0].generate([prompt], sp)[0].text


def _long_prompt(tag: str) -> str:
    """A fresh (radix-cache-cold) prompt of ~450 tokens; `tag` makes it unique."""
    words = ["cat", "dog", "tree", "car", "lamp", "boat"]
    return f"[{tag}] " + " ".join(f"item {i} is a {words[i % 6]}" for i in range(75))


def abort_lines(server: TritonServer, rid: str = r"\S+") -> list[str]:
    log = server.log_path.read_text(errors="replace")
    return re.findall(rf"{MODEL}: request ({rid}) was cancelled by the client; aborted", log)


def wait_abort(server: TritonServer, rid: str) -> None:
    """Until the abort line of request id `rid` shows; then it must be there exactly once."""
    deadline = time.monotonic() + SETTLE_S
    while not abort_lines(server, rf"{re.escape(rid)}#\d+"):
        assert time.monotonic() < deadline, f"no abort logged for {rid}"
        time.sleep(0.1)


def assert_clean_after(server: TritonServer, rid: str | None) -> None:
    """Gauges back to 0, abort logged once (if `rid`), a greedy request gives the baseline."""
    wait_gauges(server, MODEL, IDLE, SETTLE_S)
    if rid is not None:
        time.sleep(0.5)  # a duplicate abort would be logged within a few cancel polls
        assert len(abort_lines(server, rf"{re.escape(rid)}#\d+")) == 1
    s = Stream(server.grpc_url)
    try:
        s.send(MODEL, grpc_inputs(PROMPT, sampling={"max_tokens": CHECK_TOKENS, "temperature": 0,
                                                    "ignore_eos": True}), "check")
        by_rid, errors = s.collect(1)
    finally:
        s.close()
    assert errors == []
    assert [is_final(r) for r in by_rid["check"]].count(True) == 1
    assert text_of(by_rid["check"]) == baseline(PROMPT, CHECK_TOKENS)
    wait_gauges(server, MODEL, IDLE, SETTLE_S)


# ------------------------------------------------------------------------------------ tests
def test_idle_gauges_and_baseline(server):
    assert_clean_after(server, None)
    assert abort_lines(server) == []


def test_cancel_while_decoding(server):
    s = Stream(server.grpc_url)
    try:
        s.send(MODEL, grpc_inputs(PROMPT, sampling=LONG_JOB), "decode")
        for _ in range(5):  # 5 deltas streamed: prefill is over, it is decoding
            r, e = s.responses.get(timeout=TIMEOUT)
            assert e is None, e
            assert not is_final(r)
    finally:
        s.close(cancel=True)
    wait_abort(server, "decode")
    assert_clean_after(server, "decode")


def test_cancel_while_queued_leaves_the_running_request_unchanged(server):
    expected = baseline("Once upon a time", LONG_TOKENS)
    first, second = Stream(server.grpc_url), Stream(server.grpc_url)
    try:
        first.send(MODEL, grpc_inputs("Once upon a time", sampling=LONG_JOB), "running")
        r, e = first.responses.get(timeout=TIMEOUT)  # "running" holds the only request slot
        assert e is None, e
        second.send(MODEL, grpc_inputs(PROMPT, sampling=LONG_JOB), "queued")
        wait_gauges(server, MODEL, {"running": 1.0, "waiting": 1.0}, SETTLE_S)
        second.close(cancel=True)
        wait_abort(server, "queued")
        by_rid, errors = first.collect(1)
    finally:
        first.close()
    assert errors == []
    results = [r] + by_rid["running"]
    assert [is_final(x) for x in results].count(True) == 1 and is_final(results[-1])
    assert text_of(results) == expected
    assert abort_lines(server, r"running#\d+") == []
    assert_clean_after(server, "queued")


def test_cancel_many_at_once(server):
    """24 requests (1 running, 23 queued) cancelled by one stop_stream(cancel_requests=True):
    more than one round of cancellation polls (at most 16 requests per round), each request
    aborted exactly once, everything released."""
    rids = [f"many{i}" for i in range(24)]
    s = Stream(server.grpc_url)
    try:
        for rid in rids:
            s.send(MODEL, grpc_inputs(f"{PROMPT} {rid}", sampling=LONG_JOB), rid)
        wait_gauges(server, MODEL, {"running": 1.0, "waiting": 23.0}, SETTLE_S)
    finally:
        s.close(cancel=True)
    for rid in rids:
        wait_abort(server, rid)
    assert_clean_after(server, None)
    for rid in rids:
        assert len(abort_lines(server, rf"{re.escape(rid)}#\d+")) == 1, rid


def test_cancel_during_chunked_prefill(server):
    prompt, max_tokens = _long_prompt("prefill"), 48
    baseline(PROMPT, 1)  # builds the in-process engine (its tokenizer counts the prompt)
    n_prompt = len(_ENGINE[0].tokenizer(prompt).input_ids)
    assert n_prompt >= 400 and n_prompt + max_tokens <= 512, n_prompt  # 50+ chunks of 8
    s = Stream(server.grpc_url)
    try:
        s.send(MODEL, grpc_inputs(prompt, sampling={"max_tokens": max_tokens, "temperature": 0,
                                                    "ignore_eos": True}), "prefill")
        deadline = time.monotonic() + SETTLE_S
        # KV slots held and no token yet: its prefill chunks are running (best effort, see the
        # module doc; the engine is known to hold it, so the cancel must reach Engine.abort).
        while gauges(server, MODEL)["kv"] <= 0.0 and s.responses.empty():
            assert time.monotonic() < deadline, "the long prompt never started prefilling"
            time.sleep(0.05)
        if not s.responses.empty():  # a (much) faster host: already decoding
            r, e = s.responses.get_nowait()
            assert e is None, e
            assert not is_final(r)
    finally:
        s.close(cancel=True)
    wait_abort(server, "prefill")
    assert_clean_after(server, "prefill")


def test_http_disconnect_on_generate_stream(server):
    before = len(abort_lines(server))
    body = {"text_input": PROMPT, "stream": True, **LONG_JOB}
    with requests.post(f"{server.http_url}/v2/models/{MODEL}/generate_stream", json=body,
                       stream=True, timeout=TIMEOUT) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines(decode_unicode=True):
            if line.startswith("data:"):
                assert "error" not in json.loads(line[5:])
                break  # first event: close the connection mid-stream
    deadline = time.monotonic() + SETTLE_S
    while len(abort_lines(server)) == before:
        assert time.monotonic() < deadline, "the HTTP disconnect was not seen as a cancellation"
        time.sleep(0.1)
    assert_clean_after(server, None)
    assert len(abort_lines(server)) == before + 1


def test_unload_pool_invariant_and_no_adapter_errors(server):
    server.stop()
    log = server.log_path.read_text(errors="replace")
    lines = re.findall(rf"\[mla_backend\] {re.escape(MODEL)}: unloaded; engine stats: "
                       r"([^;]*); pool invariant (\w+)", log)
    assert len(lines) == 1, lines
    stats_text, verdict = lines[0]
    assert verdict == "ok"
    stats = {k: int(v) for k, v in (kv.split("=") for kv in stats_text.split())}
    assert stats["live"] == stats["running"] == stats["waiting"] == 0
    assert stats["protected_slots"] == 0
    assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"] == 1024
    bad = [ln for ln in log.splitlines() if ln.startswith("E")
           and ("triton_model.py" in ln or "responder.py" in ln)]
    assert bad == []
    assert len(abort_lines(server)) == 4 + 24  # one per cancelled request (24 at once above)
