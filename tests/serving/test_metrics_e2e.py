"""End-to-end test of the custom metrics and the per-request log line.

A real tritonserver serves two copies of `model_repository/deepseek-v2-tiny` (small pools):
`deepseek-v2-tiny` with the repository defaults plus `LOG_REQUESTS` "true", and
`deepseek-v2-tiny-quiet` with `REPORT_CUSTOM_METRICS` "false" (and the default `LOG_REQUESTS`).
Requests go through HTTP generate and gRPC streaming; the metrics are read from the server's
metrics port (`/metrics`, Prometheus text) and compared with what the responses reported, and
with the client's own clock (time per output token: one observation per token gap; TTFT apart
from e2e for non-streaming requests). Counters and histograms are read right after a request's
last response, without waiting: they must already include it.
"""

from __future__ import annotations

import json
import queue
import re
import time

import pytest
import requests

from mla_tools.tritonserver import TritonServer

import tritonclient.grpc as grpcclient

from test_triton_e2e import Stream, grpc_inputs, is_final, scalar, stream_all
from serving_helpers import read_metrics, series, write_model

pytestmark = pytest.mark.e2e

DSV2, QUIET = "deepseek-v2-tiny", "deepseek-v2-tiny-quiet"
SETTINGS = {"context_length": "512", "max_total_tokens": "4096", "max_running_requests": "8",
            "chunked_prefill_size": "256", "max_prefill_tokens": "1024"}
EXTRA = {DSV2: {"LOG_REQUESTS": "true"}, QUIET: {"REPORT_CUSTOM_METRICS": "false"}}
TIMEOUT = 120.0
REPEATED = "The capital of France is a city that"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics_repository")
    for name in (DSV2, QUIET):
        write_model(root, name, {**SETTINGS, **EXTRA[name]})
    with TritonServer(root, startup_timeout=300) as srv:
        yield srv


def http_generate(server, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"text_input": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_num_input_tokens": True, "return_num_output_tokens": True,
            "return_cached_tokens": True}
    r = requests.post(f"{server.http_url}/v2/models/{model}/generate", json=body,
                      timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def test_custom_metrics_match_the_responses(server):
    base = read_metrics(server)
    assert series(base, "vllm:prompt_tokens_total", DSV2) in (None, 0.0)
    prompt_sum = gen_sum = cached_sum = max_tokens_sum = 0
    n_requests = 0
    for prompt, max_tokens in [(REPEATED, 6), ("One, two, three,", 1), (REPEATED, 6),
                               ("The sky is", 9)]:
        data = http_generate(server, DSV2, prompt, max_tokens)
        assert data["num_output_tokens"] == max_tokens
        prompt_sum += data["num_input_tokens"]
        gen_sum += data["num_output_tokens"]
        cached_sum += data["cached_tokens"]
        max_tokens_sum += max_tokens
        n_requests += 1
    # streaming: tokens counted over several responses
    by_rid, errors = stream_all(server.grpc_url, DSV2, {"streamed": grpc_inputs(
        prompt=REPEATED, sampling={"max_tokens": 7, "temperature": 0},
        return_num_input_tokens=True, return_num_output_tokens=True, return_cached_tokens=True)})
    assert errors == []
    results = by_rid["streamed"]
    assert len(results) > 1
    prompt_sum += scalar(results[0], "num_input_tokens")
    gen_sum += sum(scalar(r, "num_output_tokens") for r in results)
    cached_sum += scalar(results[-1], "cached_tokens")
    max_tokens_sum += 7
    n_requests += 1
    assert cached_sum > 0  # the repeated prompt was served from the radix cache

    deadline = time.monotonic() + 30
    while True:  # the flush follows the sends; gauges are read every 0.2 s
        m = read_metrics(server)
        if (series(m, "vllm:e2e_request_latency_seconds_count", DSV2) == n_requests
                and series(m, "mla_backend:num_requests_running", DSV2) == 0
                and series(m, "mla_backend:kv_cache_usage_ratio", DSV2) == 0):
            break
        assert time.monotonic() < deadline, {k: v for k, v in m.items() if "mla" in k[0]
                                             or "vllm" in k[0]}
        time.sleep(0.1)

    assert series(m, "vllm:prompt_tokens_total", DSV2, version="1") == prompt_sum
    assert series(m, "vllm:generation_tokens_total", DSV2) == gen_sum
    assert series(m, "mla_backend:prefix_cache_hit_tokens_total", DSV2) == cached_sum
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:request_params_n", "vllm:request_params_max_tokens"):
        assert series(m, f"{name}_count", DSV2) == n_requests, name
        assert series(m, f"{name}_bucket", DSV2, le="+Inf") == n_requests, name
    # one time-per-output-token observation per token after each request's first
    assert series(m, "vllm:time_per_output_token_seconds_count", DSV2) == gen_sum - n_requests
    assert series(m, "vllm:request_prompt_tokens_sum", DSV2) == prompt_sum
    assert series(m, "vllm:request_generation_tokens_sum", DSV2) == gen_sum
    assert series(m, "vllm:request_params_max_tokens_sum", DSV2) == max_tokens_sum
    assert series(m, "vllm:request_params_n_sum", DSV2) == n_requests  # n = 1 each
    assert series(m, "vllm:request_params_n_bucket", DSV2, le="1") == n_requests
    ttft_sum = series(m, "vllm:time_to_first_token_seconds_sum", DSV2)
    e2e_sum = series(m, "vllm:e2e_request_latency_seconds_sum", DSV2)
    assert 0 < ttft_sum < e2e_sum
    assert series(m, "vllm:request_generation_tokens_bucket", DSV2, le="1") == 1
    # idle: gauges back to 0, nothing retracted with this pool
    assert series(m, "mla_backend:num_requests_running", DSV2) == 0
    assert series(m, "mla_backend:num_requests_waiting", DSV2) == 0
    assert series(m, "mla_backend:kv_cache_usage_ratio", DSV2) == 0
    assert series(m, "mla_backend:num_retractions_total", DSV2) == 0


def delta(after: dict, before: dict, name: str) -> float:
    """`name`'s growth for DSV2 between two readings (an absent series counts as 0)."""
    return (series(after, name, DSV2) or 0.0) - (series(before, name, DSV2) or 0.0)


TPOT, TTFT, E2E = ("vllm:time_per_output_token_seconds", "vllm:time_to_first_token_seconds",
                   "vllm:e2e_request_latency_seconds")


def test_streaming_request_one_tpot_per_token_gap_read_at_once(server):
    """A streaming request of N tokens adds N - 1 time-per-output-token observations summing to
    its decode time; everything is in /metrics as soon as its last response arrived."""
    n = 12
    before = read_metrics(server)
    arrivals: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(
        callback=lambda result, error: arrivals.put((time.monotonic(), result, error)))
    try:
        client.async_stream_infer(
            DSV2, grpc_inputs(prompt="The sky is", sampling={
                "max_tokens": n, "min_tokens": n, "ignore_eos": True, "temperature": 0},
                return_num_input_tokens=True, return_num_output_tokens=True),
            request_id="tpot", enable_empty_final_response=True)
        got = []
        while True:
            t, r, e = arrivals.get(timeout=TIMEOUT)
            assert e is None, e
            got.append((t, r))
            if is_final(r):
                break
        after = read_metrics(server)  # at once: no sleep, no polling
    finally:
        client.stop_stream()
        client.close()
    tokens = [scalar(r, "num_output_tokens") for _, r in got]
    assert sum(tokens) == n
    client_span = got[-1][0] - got[0][0]  # the client's first → last response, s
    assert delta(after, before, f"{TPOT}_count") == n - 1
    tpot_sum = delta(after, before, f"{TPOT}_sum")
    # ≈ the engine's first → last token time, which the client sees shifted by the delivery
    # of its first and last responses: allow 50 ms of jitter either way (and half the span
    # below, for a loaded machine); a per-request average would be span / (n - 1)
    assert max(0.0, 0.5 * client_span - 0.05) < tpot_sum <= client_span + 0.05, \
        (tpot_sum, client_span, tokens)
    assert delta(after, before, "vllm:generation_tokens_total") == n
    assert delta(after, before, "vllm:prompt_tokens_total") == scalar(got[0][1],
                                                                      "num_input_tokens")
    assert delta(after, before, f"{TTFT}_count") == 1
    assert delta(after, before, f"{E2E}_count") == 1
    assert delta(after, before, "vllm:request_generation_tokens_sum") == n
    assert delta(after, before, "vllm:request_params_max_tokens_count") == 1
    assert delta(after, before, "vllm:request_params_max_tokens_sum") == n
    assert delta(after, before, "vllm:request_params_n_sum") == 1


def test_non_streaming_ttft_is_engine_time_read_at_once(server):
    """A non-streaming request's TTFT is arrival → the engine's first token, not its e2e; its
    metrics are in /metrics as soon as its response arrived."""
    before = read_metrics(server)
    t0 = time.monotonic()
    data = http_generate(server, DSV2, "One, two, three,", 10)
    took = time.monotonic() - t0
    after = read_metrics(server)  # at once: no sleep, no polling
    assert data["num_output_tokens"] == 10
    assert delta(after, before, f"{TTFT}_count") == 1
    assert delta(after, before, f"{E2E}_count") == 1
    ttft, e2e = delta(after, before, f"{TTFT}_sum"), delta(after, before, f"{E2E}_sum")
    tpot = delta(after, before, f"{TPOT}_sum")
    assert 0 < ttft < e2e <= took, (ttft, e2e, took)
    assert delta(after, before, f"{TPOT}_count") == 9
    assert 0 < tpot < e2e and ttft + tpot <= e2e + 1e-3, (ttft, tpot, e2e)
    assert delta(after, before, "vllm:generation_tokens_total") == 10
    assert delta(after, before, "vllm:prompt_tokens_total") == data["num_input_tokens"]
    assert delta(after, before, "vllm:request_params_max_tokens_sum") == 10
    assert delta(after, before, "vllm:request_params_max_tokens_count") == 1


def test_kv_usage_gauge_while_running(server):
    """During a long request the gauges show it running and a KV share strictly in (0, 1)."""
    long_job = {"max_tokens": 300, "min_tokens": 300, "ignore_eos": True, "temperature": 0}
    s = Stream(server.grpc_url)
    seen_usage, seen_running = [], []
    try:
        s.send(DSV2, grpc_inputs(sampling=long_job), "long")
        done = False
        while not done:
            r, e = s.responses.get(timeout=TIMEOUT)
            assert e is None, e
            done = r.get_response().parameters["triton_final_response"].bool_param
            m = read_metrics(server)
            seen_usage.append(series(m, "mla_backend:kv_cache_usage_ratio", DSV2))
            seen_running.append(series(m, "mla_backend:num_requests_running", DSV2))
    finally:
        s.close()
    assert max(seen_running) == 1
    assert all(u is not None and 0.0 <= u <= 1.0 for u in seen_usage)
    assert 0.0 < max(seen_usage) < 1.0


def test_metrics_off_and_request_log_lines(server):
    http_generate(server, QUIET, "Quiet prompt here", 3)
    for prompt in ("Log me once", "Log me twice"):
        http_generate(server, DSV2, prompt, 3)
    pattern = (rf"\[mla_backend\] {DSV2}: request \S+ finished \((\w+)\): "
               r"prompt_tokens=(\d+) cached_tokens=(\d+) output_tokens=(\d+)")
    deadline = time.monotonic() + 10.0  # the line is logged right after the final response
    while True:
        log = server.log_path.read_text(errors="replace")
        lines = re.findall(pattern, log)
        if len(lines) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(lines) >= 2  # one per finished request
    assert all(reason in ("length", "stop") for reason, *_ in lines)
    assert f"[mla_backend] {QUIET}: request" not in log  # LOG_REQUESTS defaults to "false"
    m = read_metrics(server)
    ours = [k for k in m if k[0].startswith(("vllm:", "mla_backend:"))]
    assert not [k for k in ours if f'model="{QUIET}"' in k[1]]  # REPORT_CUSTOM_METRICS "false"
    assert series(m, "nv_inference_request_success", QUIET) == 1  # Triton's own still counted
    assert series(m, "vllm:prompt_tokens_total", DSV2) is not None
    bad = [line for line in log.splitlines() if line.startswith("E") and "mla_backend" in line]
    assert bad == []


FAILURES = "mla_backend:request_failure_total"
REASONS = ("invalid_argument", "cancelled", "unavailable", "internal")


def test_error_responses_counted_by_reason_read_at_once(server):
    """Each request answered with an error is in `mla_backend:request_failure_total` under its
    code by the time its error arrived: refused at the door (an empty prompt, max_tokens -1) or
    by the engine (an invalid regex); a good request adds nothing. Every reason's series is
    there from the start."""
    before = read_metrics(server)
    assert all(series(before, FAILURES, DSV2, reason=r) is not None for r in REASONS)
    bad = [{"text_input": "", "max_tokens": 4},
           {"text_input": "Hello", "max_tokens": -1},
           {"text_input": "Hello", "sampling_parameters": json.dumps(
               {"max_tokens": 4, "structured_outputs": {"regex": "(unclosed"}})}]
    for body in bad:
        r = requests.post(f"{server.http_url}/v2/models/{DSV2}/generate", json=body,
                          timeout=TIMEOUT)
        assert r.status_code == 400, r.text
    after = read_metrics(server)  # at once: no sleep, no polling
    got = {r: series(after, FAILURES, DSV2, reason=r) - series(before, FAILURES, DSV2, reason=r)
           for r in REASONS}
    assert got == {"invalid_argument": 3.0, "cancelled": 0.0, "unavailable": 0.0,
                   "internal": 0.0}
    http_generate(server, DSV2, "A good request", 3)
    again = read_metrics(server)
    assert all(series(again, FAILURES, DSV2, reason=r) == series(after, FAILURES, DSV2, reason=r)
               for r in REASONS)
    assert series(again, FAILURES, QUIET, reason="invalid_argument") is None  # metrics off
