"""End-to-end tests: a real tritonserver serving our model folders through the Python backend.

One server per module, on free ports, over a temp model repository holding copies of
`model_repository/<model>/{config.pbtxt,1/model.py}` with small engine settings and `model_path`
pointing at the real weights folders. Outputs are compared with an in-process `Engine` built with
the same settings (greedy decoding: identical text).

Models in the temp repository:
- `smollm2-135m-instruct`, `deepseek-v2-tiny`: the repository models with small pools;
- `deepseek-v2-tiny-one`: deepseek-v2-tiny with max_running_requests 1 and a 640-slot KV pool, so
  a cancelled request whose request slot or KV slots leaked would starve the next request.
"""

from __future__ import annotations

import csv
import json
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from mla_backend.config import EngineConfig
from mla_backend.request import SamplingParams
from mla_tools.tritonserver import TritonServer
from serving_helpers import read_metrics, series, write_model

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SMOL, DSV2, DSV2_ONE = "smollm2-135m-instruct", "deepseek-v2-tiny", "deepseek-v2-tiny-one"
SETTINGS = {
    SMOL: {"context_length": "512", "max_total_tokens": "2048", "max_running_requests": "4",
           "chunked_prefill_size": "256", "max_prefill_tokens": "1024"},
    DSV2: {"context_length": "512", "max_total_tokens": "4096", "max_running_requests": "8",
           "chunked_prefill_size": "256", "max_prefill_tokens": "1024"},
    DSV2_ONE: {"context_length": "512", "max_total_tokens": "640", "max_running_requests": "1",
               "chunked_prefill_size": "256", "max_prefill_tokens": "1024"},
}
SOURCE = {SMOL: SMOL, DSV2: DSV2, DSV2_ONE: DSV2}
PROMPT = "The capital of France is"
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def model_repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("model_repository")
    for name, src in SOURCE.items():
        write_model(root, name, SETTINGS[name], source=src)
    return root


@pytest.fixture(scope="module")
def server(model_repo):
    with TritonServer(model_repo, startup_timeout=300) as srv:
        yield srv


_ENGINES: dict[str, object] = {}


def reference(model: str, prompt: str, max_tokens: int) -> tuple[str, list[int]]:
    """Greedy text and token ids from an in-process Engine with the server's settings."""
    from mla_backend.engine import Engine

    if model not in _ENGINES:
        cfg = EngineConfig.create(
            model_path=str(REPO / "model_repository" / SOURCE[model] / "weights"),
            **SETTINGS[model])
        _ENGINES[model] = Engine(cfg)
    engine = _ENGINES[model]
    res = engine.generate([prompt], SamplingParams(max_new_tokens=max_tokens, temperature=0.0))
    return res[0].text, res[0].token_ids


# -------------------------------------------------------------------------------- gRPC helpers
def _tensor(name: str, value) -> grpcclient.InferInput:
    arr = np.asarray(value)
    if arr.dtype.kind in "US":
        arr = np.array([v.encode() for v in arr.reshape(-1)], dtype=np.object_)
    dtype = {"O": "BYTES", "b": "BOOL", "i": "INT64"}[arr.dtype.kind]
    if dtype == "INT64":
        arr = arr.astype(np.int64)
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def grpc_inputs(prompt: str | None = PROMPT, sampling: dict | None = None, **switches):
    inputs = []
    if prompt is not None:
        inputs.append(_tensor("text_input", [prompt]))
    inputs.append(_tensor("stream", [True]))
    if sampling is not None:
        inputs.append(_tensor("sampling_parameters", [json.dumps(sampling)]))
    for name, value in switches.items():
        inputs.append(_tensor(name, value if name == "input_ids" else [value]))
    return inputs


class Stream:
    """One gRPC stream; responses (result, error) collected in arrival order."""

    def __init__(self, url: str):
        self.client = grpcclient.InferenceServerClient(url)
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def send(self, model: str, inputs, rid: str, parameters: dict | None = None) -> None:
        self.client.async_stream_infer(model, inputs, request_id=rid, parameters=parameters,
                                       enable_empty_final_response=True)

    def collect(self, n_requests: int) -> tuple[dict[str, list], list[str]]:
        """Until `n_requests` requests ended (FINAL or error): rid → results, error messages."""
        by_rid: dict[str, list] = {}
        errors: list[str] = []
        done = 0
        while done < n_requests:
            r, e = self.responses.get(timeout=TIMEOUT)
            if e is not None:
                errors.append(str(e))
                done += 1
                continue
            rid = r.get_response().id
            by_rid.setdefault(rid, []).append(r)
            if is_final(r):
                done += 1
        return by_rid, errors

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def stream_all(url: str, model: str, requests: dict) -> tuple[dict[str, list], list[str]]:
    """Send each request (rid → its inputs) on one new gRPC stream and wait until all ended:
    `Stream.collect`'s rid → results and error messages."""
    stream = Stream(url)
    try:
        for rid, inputs in requests.items():
            stream.send(model, inputs, rid)
        return stream.collect(len(requests))
    finally:
        stream.close()


def is_final(r) -> bool:
    return r.get_response().parameters["triton_final_response"].bool_param


def text_of(results) -> str:
    return "".join(r.as_numpy("text_output")[0].decode() for r in results
                   if r.as_numpy("text_output") is not None)


def scalar(r, name):
    v = r.as_numpy(name)
    return None if v is None else (v[0].decode() if v.dtype == np.object_ else v[0].item())


# ------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("model", [DSV2, SMOL])
def test_grpc_stream_matches_engine_with_one_final(server, model):
    expected, ids = reference(model, PROMPT, 8)
    s = Stream(server.grpc_url)
    try:
        s.send(model, grpc_inputs(sampling={"max_tokens": 8, "temperature": 0},
                                  return_finish_reason=True, return_num_output_tokens=True,
                                  return_num_input_tokens=True), "a")
        by_rid, errors = s.collect(1)
        time.sleep(0.3)
        assert s.responses.empty(), "a response arrived after FINAL"
    finally:
        s.close()
    assert errors == []
    results = by_rid["a"]
    finals = [is_final(r) for r in results]
    assert finals[-1] and finals.count(True) == 1
    assert text_of(results) == expected
    assert sum(scalar(r, "num_output_tokens") for r in results) == len(ids) == 8
    assert [scalar(r, "finish_reason") for r in results][-1] == "length"
    assert all(scalar(r, "finish_reason") == "None" for r in results[:-1])
    assert all(r.as_numpy("text_output")[0] != b"" for r in results[:-1])
    assert scalar(results[0], "num_input_tokens") == len(reference_ids(model, PROMPT))


def reference_ids(model: str, prompt: str) -> list[int]:
    return list(_ENGINES[model].tokenizer(prompt).input_ids)


def test_grpc_request_parameters_and_input_ids(server):
    expected, _ = reference(DSV2, PROMPT, 6)
    ids = reference_ids(DSV2, PROMPT)
    s = Stream(server.grpc_url)
    try:
        # no sampling_parameters tensor: request parameters (strings coerced) are used
        s.send(DSV2, grpc_inputs(), "params", parameters={"max_tokens": "6", "temperature": "0"})
        s.send(DSV2, grpc_inputs(prompt=None, input_ids=ids,
                                 sampling={"max_tokens": 6, "temperature": 0}), "ids")
        by_rid, errors = s.collect(2)
    finally:
        s.close()
    assert errors == []
    assert text_of(by_rid["params"]) == expected
    assert text_of(by_rid["ids"]) == expected


def test_http_generate_and_generate_stream(server):
    expected, ids = reference(DSV2, PROMPT, 10)
    url = f"{server.http_url}/v2/models/{DSV2}"
    body = {"text_input": PROMPT, "max_tokens": 10, "temperature": 0,
            "return_finish_reason": True, "return_num_output_tokens": True,
            "return_cached_tokens": True}
    r = requests.post(f"{url}/generate", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["text_output"] == PROMPT + expected  # non-streaming echoes the prompt
    assert data["finish_reason"] == "length" and data["num_output_tokens"] == 10
    r = requests.post(f"{url}/generate", json={**body, "exclude_input_in_output": True},
                      timeout=TIMEOUT)
    assert r.json()["text_output"] == expected
    assert r.json()["cached_tokens"] > 0  # same prompt again: served from the radix cache

    events = []
    with requests.post(f"{url}/generate_stream", json={**body, "stream": True}, stream=True,
                       timeout=TIMEOUT) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines(decode_unicode=True):
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    assert all("error" not in e for e in events)
    assert "".join(e["text_output"] for e in events) == expected
    assert [e["finish_reason"] for e in events] == ["None"] * (len(events) - 1) + ["length"]
    assert sum(e["num_output_tokens"] for e in events) == 10


@pytest.mark.parametrize(
    "body, field",
    [
        ({"text_input": ""}, "text_input"),
        ({"text_input": "hi", "max_tokens": 0}, "max_tokens"),
        ({"text_input": "hi", "bogus": 1}, "bogus"),
        ({"text_input": "hi", "sampling_parameters": "{oops"}, "sampling_parameters"),
        ({"text_input": "hi", "sampling_parameters": "[1]"}, "sampling_parameters"),
        ({"text_input": "hi", "temperature": "warm"}, "temperature"),
        ({"text_input": "hi", "stream": True, "exclude_input_in_output": False},
         "exclude_input_in_output"),
        ({"text_input": "hi", "input_ids": [1, 2]}, "input_ids"),
        ({"input_ids": [1, 10**9]}, "input_ids"),
        ({"text_input": "hi " * 600}, "context"),  # prompt longer than context_length 512
        ({"text_input": "hi", "max_tokens": 600}, "max_tokens"),
    ],
)
def test_http_bad_requests_are_invalid_argument(server, body, field):
    r = requests.post(f"{server.http_url}/v2/models/{DSV2}/generate", json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]


def test_bad_request_fails_alone_among_concurrent_good_ones(server):
    expected, _ = reference(DSV2, PROMPT, 8)
    s = Stream(server.grpc_url)
    try:
        for i in range(3):
            s.send(DSV2, grpc_inputs(sampling={"max_tokens": 8, "temperature": 0}), f"good{i}")
            if i == 1:
                s.send(DSV2, grpc_inputs(sampling={"max_tokens": 8, "top_p": 7}), "bad")
        by_rid, errors = s.collect(4)
    finally:
        s.close()
    assert len(errors) == 1 and "top_p" in errors[0]
    assert sorted(by_rid) == ["good0", "good1", "good2"]
    for results in by_rid.values():
        assert text_of(results) == expected
        assert [is_final(r) for r in results].count(True) == 1


def test_logprobs_and_cumulative_logprob(server):
    s = Stream(server.grpc_url)
    try:
        s.send(DSV2, grpc_inputs(sampling={"max_tokens": 5, "temperature": 0, "logprobs": 2},
                                 return_logprobs=True, return_cumulative_logprob=True,
                                 return_num_output_tokens=True), "lp")
        by_rid, errors = s.collect(1)
    finally:
        s.close()
    assert errors == []
    total, chosen_sum = 0, 0.0
    for r in by_rid["lp"]:
        entries = json.loads(scalar(r, "logprobs"))
        assert len(entries) == scalar(r, "num_output_tokens")
        for entry in entries:
            best = max(entry.values(), key=lambda c: c["logprob"])
            assert best["rank"] == 1  # greedy: the chosen token is the top candidate
            chosen_sum += best["logprob"]
            assert all(c["logprob"] <= 0.0 for c in entry.values())
        total += len(entries)
    assert total == 5
    assert scalar(by_rid["lp"][-1], "cumulative_logprob") == pytest.approx(chosen_sum, abs=1e-4)


def test_cancellation_frees_the_request_and_its_slots(server):
    long_job = {"max_tokens": 480, "min_tokens": 480, "ignore_eos": True, "temperature": 0}
    s = Stream(server.grpc_url)
    got = 0
    try:
        s.send(DSV2_ONE, grpc_inputs(sampling=long_job), "long")
        while got < 100:  # the request now holds > 100 KV slots and the only request slot
            r, e = s.responses.get(timeout=TIMEOUT)
            assert e is None, e
            assert not is_final(r)
            got += 1
    finally:
        s.close(cancel=True)
    deadline = time.monotonic() + 30
    pattern = re.compile(rf"{DSV2_ONE}: request long#\d+ was cancelled by the client; aborted")
    while not pattern.search(server.log_path.read_text(errors="replace")):
        assert time.monotonic() < deadline, "the adapter did not see the cancellation"
        time.sleep(0.1)
    # With 1 request slot and 640 KV slots, this can only run if the cancelled one was freed.
    s = Stream(server.grpc_url)
    try:
        s.send(DSV2_ONE, grpc_inputs(sampling=long_job, return_num_output_tokens=True), "next")
        by_rid, errors = s.collect(1)
    finally:
        s.close()
    assert errors == []
    assert sum(scalar(r, "num_output_tokens") for r in by_rid["next"]) == 480


def test_load_example_concurrent_streams(server):
    import importlib.util

    spec = importlib.util.spec_from_file_location("load", REPO / "client_examples" / "load.py")
    load = importlib.util.module_from_spec(spec)
    sys.modules["load"] = load  # dataclasses look their module up there
    spec.loader.exec_module(load)
    res = load.run_load(server.grpc_url, DSV2, num_requests=6, concurrency=3, max_tokens=8)
    assert res.errors == []
    assert res.requests == 6 and res.output_tokens == 6 * 8


def test_load_example_ends_on_ctrl_c(server):
    """client_examples/load.py: SIGINT while its streams run cancels their requests and exits
    with code 130 at once (its threads would otherwise run every request to the end)."""
    import signal
    import subprocess

    script = REPO / "client_examples" / "load.py"

    def running() -> float:
        return series(read_metrics(server), "mla_backend:num_requests_running", DSV2) or 0

    deadline = time.monotonic() + 60
    while running():  # the earlier tests' requests are gone (the gauge has caught up)
        assert time.monotonic() < deadline
        time.sleep(0.1)
    proc = subprocess.Popen([sys.executable, str(script), "--url", server.grpc_url, "--model",
                             DSV2, "--requests", "60", "--concurrency", "3", "--max-tokens",
                             "480"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60  # until its streams are open and generating
        while running() < 1:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        t = time.monotonic()
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t
    finally:
        proc.kill()
    assert proc.returncode == 130 and "the requests in flight were cancelled" in err, err
    assert took < 10, took


def _settled_counters(server, model: str) -> tuple[float, float, float, float]:
    """(Triton's request successes, failures, our finished requests, generated tokens) once the
    model is idle and its counters stopped moving."""
    deadline = time.monotonic() + 60
    last = None
    while True:
        m = read_metrics(server)
        now = (series(m, "nv_inference_request_success", model) or 0.0,
               sum(v for (n, lab), v in m.items()
                   if n == "nv_inference_request_failure" and f'model="{model}"' in lab),
               series(m, "vllm:e2e_request_latency_seconds_count", model) or 0.0,
               series(m, "vllm:generation_tokens_total", model) or 0.0)
        idle = (series(m, "mla_backend:num_requests_running", model) == 0
                and series(m, "mla_backend:num_requests_waiting", model) == 0)
        if idle and now == last:
            return now
        assert time.monotonic() < deadline, f"{model} did not settle: {now}"
        last = now
        time.sleep(0.5)


def test_perf_analyzer_concurrency_sweep(server, tmp_path):
    """client_examples/perf_sweep.sh (perf_analyzer, gRPC streaming, concurrency 1, 3, 5, 7)
    completes with zero errors: every level measured, and every request the server took ended
    normally with all 32 tokens (Triton counts a request that our model answered with an error as
    a success, so the check is success count == our finished count, tokens == 32 x finished)."""
    assert shutil.which("perf_analyzer"), "perf_analyzer missing (./build.sh setup installs it)"
    script = REPO / "client_examples" / "perf_sweep.sh"
    inputs = json.loads((REPO / "client_examples" / "perf_input.json").read_text())["data"]
    tokens = {int(json.loads(d["sampling_parameters"][0])["max_tokens"]) for d in inputs}
    assert len(tokens) == 1
    tokens_per_request = tokens.pop()
    before = _settled_counters(server, DSV2)
    proc = subprocess.run(["bash", str(script), DSV2, server.grpc_url, str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "rror" not in out, out
    with open(tmp_path / "perf.csv", newline="") as f:
        rows = {int(r["Concurrency"]): r for r in csv.DictReader(f)}
    assert sorted(rows) == [1, 3, 5, 7], out  # a level that failed to measure has no row
    assert all(float(r["Inferences/Second"]) > 0 for r in rows.values())

    after = _settled_counters(server, DSV2)
    success, failures, finished, generated = (a - b for a, b in zip(after, before))
    assert failures == 0
    assert finished == success > 0
    assert generated == tokens_per_request * finished

    # Every recorded request got responses, and each distinct input (one greedy, one seeded)
    # streamed the same text every time, at every concurrency.
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert [e["experiment"]["value"] for e in profile["experiments"]] == [1, 3, 5, 7]
    texts: dict[str, set[str]] = {}
    n_requests = 0
    for experiment in profile["experiments"]:
        for r in experiment["requests"]:
            assert r["response_timestamps"], r["request_inputs"]
            text = "".join(o["text_output"] for o in r["response_outputs"])
            texts.setdefault(r["request_inputs"]["sampling_parameters"], set()).add(text)
            n_requests += 1
    assert n_requests <= success
    assert len(texts) == len(inputs)
    assert all(len(v) == 1 and "" not in v for v in texts.values()), texts


def test_concurrent_http_streams_threads(server):
    """Several HTTP streams at once through the response thread: each gets its own text."""
    prompts = ["One, two, three,", "The sky is", PROMPT]
    expected = {p: reference(DSV2, p, 6)[0] for p in prompts}
    got: dict[str, str] = {}

    def run(p: str) -> None:
        body = {"text_input": p, "stream": True, "max_tokens": 6, "temperature": 0}
        text = ""
        with requests.post(f"{server.http_url}/v2/models/{DSV2}/generate_stream", json=body,
                           stream=True, timeout=TIMEOUT) as resp:
            for line in resp.iter_lines(decode_unicode=True):
                if line.startswith("data:"):
                    text += json.loads(line[5:])["text_output"]
        got[p] = text

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert got == expected


def test_no_adapter_errors_in_server_log(server):
    log = server.log_path.read_text(errors="replace")
    assert "[mla_backend] deepseek-v2-tiny: loaded" in log
    bad = [line for line in log.splitlines()
           if line.startswith("E") and ("triton_model.py" in line or "responder.py" in line)]
    assert bad == []
    server.check_alive()


def test_pools_balanced_at_unload(server):
    """Stop the server: each model's finalize logs its engine counters and pool invariant."""
    server.stop()
    log = server.log_path.read_text(errors="replace")
    for model in SOURCE:
        m = re.search(rf"\[mla_backend\] {re.escape(model)}: unloaded; engine stats: ([^;]*); "
                      r"pool invariant (\w+)", log)
        assert m, f"no unload line for {model}"
        stats = {k: int(v) for k, v in (kv.split("=") for kv in m.group(1).split())}
        verdict = m.group(2)
        assert verdict == "ok"
        assert stats["live"] == stats["running"] == stats["waiting"] == 0
        assert stats["protected_slots"] == 0
        assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]
        assert stats["total_slots"] == int(SETTINGS[model]["max_total_tokens"])
