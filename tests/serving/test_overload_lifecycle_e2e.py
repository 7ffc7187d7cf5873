"""End-to-end overload and model-lifecycle tests on a real tritonserver (issue 5).

One server per module (explicit model control) over a temp repository of deepseek-v2-tiny copies
(`model_repository/deepseek-v2-tiny/{config.pbtxt,1/model.py}`, absolute `model_path`):

- `dsv2-overload`: a 256-slot KV pool, 8 request slots, context 256, GIL_SWITCH_INTERVAL_MS 0.5
  (its stub's `sys.setswitchinterval`, named in its load log line). 12 prompts x 64 greedy tokens
  (about 4x the pool) sent at once must all finish through queueing and retraction, with the text
  of an unloaded run (an in-process `Engine` with the same settings, one request at a time).
- `dsv2-two`: `instance_group` count 2 (two engines, two stub processes).
- `dsv2-noweights`, `dsv2-badint`, `dsv2-tp3`, `dsv2-badinterval`, `dsv2-badthreads`,
  `dsv2-badsenders`, `dsv2-badswitch`, `dsv2-baddetok`: not loaded at start; loading them
  through the repository API must fail with a message naming the missing path / the bad key /
  the impossible head split (8 heads on 3 ranks) / the adapter parameter STREAM_INTERVAL "0" /
  INTRA_OP_THREAD_COUNT "many" / RESPONSE_SENDER_THREADS "0" / GIL_SWITCH_INTERVAL_MS "0" /
  DETOKENIZER_PROCESS "true" with ENGINE_PROCESS "false".
- `dsv2-tp2`: `tensor_parallel_size` 2 — the instance spawns one CPU worker rank (gloo); loaded
  through the API it streams the same greedy text as the TP 1 engine, and unloads cleanly.
The last test stops the server: every instance logs `pool invariant ok` at unload.
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from mla_backend.config import EngineConfig
from mla_backend.request import SamplingParams
from mla_tools.tritonserver import TritonServer

from test_triton_e2e import Stream, grpc_inputs, is_final, scalar, text_of
from serving_helpers import read_metrics, series, write_model

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "model_repository" / "deepseek-v2-tiny"
OVER, TWO = "dsv2-overload", "dsv2-two"
NOWEIGHTS, BADINT, TP3, TP2 = "dsv2-noweights", "dsv2-badint", "dsv2-tp3", "dsv2-tp2"
BADINTERVAL, BADTHREADS, BADSENDERS = "dsv2-badinterval", "dsv2-badthreads", "dsv2-badsenders"
BADSWITCH = "dsv2-badswitch"
BADDETOK = "dsv2-baddetok"
MISSING = "/nonexistent/mla-backend-weights-xyz"
SETTINGS = {
    OVER: {"context_length": "256", "max_total_tokens": "256", "max_running_requests": "8",
           "chunked_prefill_size": "128", "max_prefill_tokens": "256"},
    TWO: {"context_length": "512", "max_total_tokens": "1024", "max_running_requests": "4",
          "chunked_prefill_size": "256", "max_prefill_tokens": "512"},
}
BAD = {NOWEIGHTS: {"model_path": MISSING}, BADINT: {"max_total_tokens": "abc"},
       TP3: {"tensor_parallel_size": "3"}}
PROMPTS = [f"Story {i}: once upon a time, the {w}" for i, w in enumerate(
    ["fox", "king", "river", "robot", "garden", "storm", "violin", "lantern", "whale",
     "mountain", "clock", "desert"])]
OVER_TOKENS = 64
JOB = {"max_tokens": OVER_TOKENS, "ignore_eos": True, "temperature": 0}
TIMEOUT = 300.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lifecycle_repository")
    write_model(root, OVER, SETTINGS[OVER], extra_params={"GIL_SWITCH_INTERVAL_MS": "0.5"})
    write_model(root, TWO, SETTINGS[TWO], instances=2)
    for name, params in BAD.items():
        write_model(root, name, {**SETTINGS[TWO], **params})
    write_model(root, BADINTERVAL, SETTINGS[TWO], extra_params={"STREAM_INTERVAL": "0"})
    write_model(root, BADTHREADS, SETTINGS[TWO], extra_params={"INTRA_OP_THREAD_COUNT": "many"})
    write_model(root, BADSENDERS, SETTINGS[TWO], extra_params={"RESPONSE_SENDER_THREADS": "0"})
    write_model(root, BADSWITCH, SETTINGS[TWO], extra_params={"GIL_SWITCH_INTERVAL_MS": "0"})
    write_model(root, BADDETOK, SETTINGS[TWO], extra_params={"ENGINE_PROCESS": "false",
                                                             "DETOKENIZER_PROCESS": "true"})
    write_model(root, TP2, {**SETTINGS[TWO], "tensor_parallel_size": "2"})
    with TritonServer(root, model_control_mode="explicit", load_models=[OVER, TWO],
                      wait_models=[OVER, TWO], startup_timeout=300) as srv:
        yield srv


_ENGINES: dict[str, object] = {}


def baseline(model: str, prompt: str, sampling: SamplingParams) -> str:
    """Greedy text of `prompt` alone on an in-process Engine with `model`'s settings."""
    from mla_backend.engine import Engine

    if model not in _ENGINES:
        _ENGINES[model] = Engine(EngineConfig.create(model_path=str(SRC / "weights"),
                                                     **SETTINGS[model]))
    return _ENGINES[model].generate([prompt], sampling)[0].text


def _retractions(server: TritonServer, model: str) -> int:
    value = series(read_metrics(server), "mla_backend:num_retractions_total", model)
    return 0 if value is None else int(value)


def _run_all(server: TritonServer, model: str, prompts: list[str], sampling: dict):
    """All prompts at once, each on its own gRPC stream; returns (rid → results, errors)."""
    streams = [Stream(server.grpc_url) for _ in prompts]
    by_rid: dict[str, list] = {}
    errors: list[str] = []
    try:
        for i, (s, p) in enumerate(zip(streams, prompts)):
            s.send(model, grpc_inputs(p, sampling=sampling, return_num_output_tokens=True), f"r{i}")
        for s in streams:
            got, errs = s.collect(1)
            by_rid.update(got)
            errors += errs
    finally:
        for s in streams:
            s.close()
    return by_rid, errors


# ------------------------------------------------------------------------------------ tests
def test_overload_completes_with_unloaded_outputs_and_retracts(server):
    sp = SamplingParams(max_new_tokens=OVER_TOKENS, temperature=0.0, ignore_eos=True)
    expected = [baseline(OVER, p, sp) for p in PROMPTS]
    engine = _ENGINES[OVER]
    demand = sum(len(engine.tokenizer(p).input_ids) + OVER_TOKENS for p in PROMPTS)
    assert demand >= 3.5 * int(SETTINGS[OVER]["max_total_tokens"])  # really overloaded
    assert _retractions(server, OVER) == 0
    log = server.log_path.read_text(errors="replace")
    assert re.search(rf"\[mla_backend\] {OVER}: loaded .* GIL switch interval 0\.5 ms;", log)

    by_rid, errors = _run_all(server, OVER, PROMPTS, JOB)
    assert errors == []
    assert sorted(by_rid) == sorted(f"r{i}" for i in range(len(PROMPTS)))
    for i, want in enumerate(expected):
        results = by_rid[f"r{i}"]
        assert [is_final(r) for r in results].count(True) == 1 and is_final(results[-1])
        assert sum(scalar(r, "num_output_tokens") for r in results) == OVER_TOKENS
        assert text_of(results) == want, f"prompt {i}: streamed text differs from unloaded run"

    deadline = time.monotonic() + 60  # the adapter flushes metrics from its engine loop
    while _retractions(server, OVER) == 0:
        assert time.monotonic() < deadline, "no retraction observed under 4x overload"
        time.sleep(0.5)


def test_bad_models_fail_to_load_naming_the_cause(server):
    """Eight failing loads at once (each spawns a stub); each error names its cause."""
    needles = {NOWEIGHTS: MISSING, BADINT: "max_total_tokens",
               TP3: "tensor parallel size 3 does not divide num_attention_heads=8",
               BADINTERVAL: "STREAM_INTERVAL", BADTHREADS: "INTRA_OP_THREAD_COUNT",
               BADSENDERS: "parameter RESPONSE_SENDER_THREADS: expected an integer >= 1",
               BADSWITCH: "parameter GIL_SWITCH_INTERVAL_MS: expected a number of ms in (0, 100]",
               BADDETOK: "DETOKENIZER_PROCESS \"true\" needs ENGINE_PROCESS \"true\""}

    def load(model: str) -> requests.Response:
        return requests.post(f"{server.http_url}/v2/repository/models/{model}/load", json={},
                             timeout=TIMEOUT)

    with ThreadPoolExecutor(len(needles)) as pool:
        replies = dict(zip(needles, pool.map(load, needles)))
    states = server.model_states()
    for model, needle in needles.items():
        r = replies[model]
        assert r.status_code != 200, r.text
        assert needle in r.json()["error"], (model, r.text)
        assert states[model][0] == "UNAVAILABLE"
        ready = requests.get(f"{server.http_url}/v2/models/{model}/ready", timeout=30)
        assert ready.status_code != 200
    server.check_alive()


def test_tensor_parallel_2_serves_like_tp1_and_unloads(server):
    url = f"{server.http_url}/v2/repository/models/{TP2}"
    r = requests.post(f"{url}/load", json={}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    prompts = PROMPTS[:4]
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [baseline(TWO, p, sp) for p in prompts]  # same settings at TP 1
    by_rid, errors = _run_all(server, TP2, prompts,
                              {"max_tokens": 12, "ignore_eos": True, "temperature": 0})
    assert errors == []
    assert [text_of(by_rid[f"r{i}"]) for i in range(len(prompts))] == expected
    r = requests.post(f"{url}/unload", json={}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60
    pattern = rf"\[mla_backend\] {TP2}: unloaded; engine stats: [^;]*; pool invariant ok"
    while not re.search(pattern, server.log_path.read_text(errors="replace")):
        assert time.monotonic() < deadline, "the TP 2 instance did not unload cleanly"
        time.sleep(0.2)


def test_two_instances_serve_concurrent_requests(server):
    log = server.log_path.read_text(errors="replace")
    assert log.count(f"[mla_backend] {TWO}: loaded") == 2
    # INTRA_OP_THREAD_COUNT "auto" on a CPU: one torch thread fewer than the cores (at least 1)
    want = max(1, len(os.sched_getaffinity(0)) - 1)
    assert len(re.findall(rf"\[mla_backend\] {TWO}: loaded .* torch intra-op threads {want}\b",
                          log)) == 2
    prompts = PROMPTS[:8]
    job = {"max_tokens": 12, "ignore_eos": True, "temperature": 0}
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [baseline(TWO, p, sp) for p in prompts]
    by_rid, errors = _run_all(server, TWO, prompts, job)
    assert errors == []
    for i, want in enumerate(expected):
        results = by_rid[f"r{i}"]
        assert [is_final(r) for r in results].count(True) == 1
        assert text_of(results) == want
    # Still healthy: the good models serve after the failed loads.
    assert server.model_states()[OVER][0] == "READY"


def test_unload_drains_every_instance(server):
    server.stop()
    log = server.log_path.read_text(errors="replace")
    for model, instances in ((OVER, 1), (TWO, 2)):
        lines = re.findall(rf"\[mla_backend\] {re.escape(model)}: unloaded; engine stats: "
                           r"([^;]*); pool invariant (\w+)", log)
        assert len(lines) == instances, f"{model}: {lines}"
        for stats_text, verdict in lines:
            assert verdict == "ok"
            stats = {k: int(v) for k, v in (kv.split("=") for kv in stats_text.split())}
            assert stats["live"] == stats["running"] == stats["waiting"] == 0
            assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]
    for model in (*BAD, BADINTERVAL, BADTHREADS, BADSENDERS):
        assert f"[mla_backend] {model}: unloaded" not in log
