"""End-to-end bad-input matrix (issue 5): malformed requests against a real tritonserver.

One server per module serving `deepseek-v2-tiny` with a small context (512 tokens) and a smaller KV
pool (384 slots), so "prompt + max_tokens beyond the context" and "can never fit the pool" are both
cheap to trigger. Every case of `CASES` is sent on one raw gRPC stream (`ModelStreamInfer` with
`triton_enable_empty_final_response`, so the FINAL flag of each response is visible even for errors)
and must be answered by exactly one response: an error whose message names the field, flagged
FINAL. Our model answers INVALID_ARGUMENT; wrong dtypes/shapes and unknown tensors are rejected by
Triton's own frontend before the model sees them (its messages name the input too).

Meanwhile greedy good requests run on other streams; their text must equal a baseline run of the
same requests. At the end the server is stopped and the adapter's unload line must report a
balanced pool (`pool invariant ok`, nothing live, running or waiting).
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.grpc import _utils as grpc_utils
from tritonclient.grpc import service_pb2_grpc

from mla_tools.tritonserver import TritonServer
from serving_helpers import write_model

pytestmark = pytest.mark.e2e

MODEL = "deepseek-v2-tiny"
SETTINGS = {"context_length": "512", "max_total_tokens": "384", "max_running_requests": "4",
            "chunked_prefill_size": "256", "max_prefill_tokens": "512"}
VOCAB = json.loads((Path(__file__).resolve().parents[2] / "checkpoints" / MODEL
                    / "config.json").read_text())["vocab_size"]  # the shipped model's
TIMEOUT = 120.0
PROMPT = "The capital of France is"
GOOD_PROMPTS = ["The capital of France is", "One, two, three,", "The sky is"]
GOOD_SAMPLING: dict[str, Any] = {"max_tokens": 8, "temperature": 0}
# Strings for numbers and booleans are accepted: "false" is False.
GOOD_STRINGS: dict[str, Any] = {"max_tokens": "8", "temperature": "0", "ignore_eos": "false",
                                "top_k": "-1", "skip_special_tokens": "true"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_inputs_repository")
    write_model(root, MODEL, SETTINGS)
    with TritonServer(root, startup_timeout=300) as srv:
        yield srv


# ------------------------------------------------------------------------------------ tensors
def tensor(name: str, value: Any, dtype: str | None = None) -> grpcclient.InferInput:
    """A gRPC input; `dtype` None infers BYTES / BOOL / INT64 / FP32 from the numpy kind."""
    arr = np.asarray(value)
    if arr.dtype.kind in "US":
        arr = np.array([v.encode() for v in arr.reshape(-1)], dtype=np.object_).reshape(arr.shape)
    dtype = dtype or {"O": "BYTES", "b": "BOOL", "i": "INT64", "f": "FP32"}[arr.dtype.kind]
    arr = arr.astype({"BYTES": np.object_, "BOOL": np.bool_, "INT64": np.int64,
                      "INT32": np.int32, "FP32": np.float32}[dtype])
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    t.numpy_value = arr  # for `http_body`
    return t


def text_in(s: str | bytes = PROMPT) -> grpcclient.InferInput:
    return tensor("text_input", np.array([s.encode() if isinstance(s, str) else s],
                                         dtype=np.object_))


def sp(value: dict | str | bytes) -> grpcclient.InferInput:
    raw = json.dumps(value) if isinstance(value, dict) else value
    raw = raw.encode() if isinstance(raw, str) else raw
    return tensor("sampling_parameters", np.array([raw], dtype=np.object_))


def stream_on() -> grpcclient.InferInput:
    return tensor("stream", [True])


def ok(**sampling: Any) -> list[grpcclient.InferInput]:
    """A streaming request with `sampling` merged into a valid max_tokens 4."""
    return [text_in(), stream_on(), sp({"max_tokens": 4, **sampling})]


BOOL_INPUTS = ["stream", "exclude_input_in_output", "return_finish_reason",
               "return_num_input_tokens", "return_num_output_tokens", "return_logprobs",
               "return_cumulative_logprob", "return_cached_tokens"]

# (name, inputs, request parameters or None, text the error message must contain)
CASES: list[tuple[str, list, dict | None, str]] = [
    ("missing_text_input", [stream_on(), sp({"max_tokens": 4})], None, "text_input"),
    ("empty_text_input", [text_in(""), stream_on()], None, "text_input"),
    ("non_utf8_text_input", [text_in(b"\xff\xfe\x80"), stream_on()], None, "text_input"),
    ("text_input_int64", [tensor("text_input", [1]), stream_on()], None, "text_input"),
    ("text_input_two_elements", [tensor("text_input", ["a", "b"]), stream_on()], None,
     "text_input"),
    ("input_ids_fp32", [tensor("input_ids", [1.0, 2.0]), stream_on()], None, "input_ids"),
    ("input_ids_int32", [tensor("input_ids", [1, 2], "INT32"), stream_on()], None, "input_ids"),
    ("input_ids_bytes", [tensor("input_ids", ["1 2"]), stream_on()], None, "input_ids"),
    ("input_ids_empty", [tensor("input_ids", np.zeros(0, np.int64)), stream_on()], None,
     "input_ids"),
    ("input_ids_negative", [tensor("input_ids", [5, -1]), stream_on()], None, "input_ids"),
    ("input_ids_out_of_vocab", [tensor("input_ids", [5, VOCAB]), stream_on()], None,
     "input_ids"),
    ("text_input_and_input_ids", [text_in(), tensor("input_ids", [5, 6]), stream_on()], None,
     "input_ids"),
    ("sampling_parameters_bool", [text_in(), tensor("sampling_parameters", [True])], None,
     "sampling_parameters"),
    ("sampling_parameters_two_elements",
     [text_in(), tensor("sampling_parameters", ["{}", "{}"])], None, "sampling_parameters"),
    ("sampling_parameters_non_utf8", [text_in(), stream_on(), sp(b'{"max_tokens": "\xff"}')],
     None, "sampling_parameters"),
    ("malformed_json", [text_in(), stream_on(), sp('{"max_tokens": 4')], None,
     "sampling_parameters"),
    ("json_array", [text_in(), stream_on(), sp("[1, 2]")], None, "sampling_parameters"),
    ("json_string", [text_in(), stream_on(), sp('"max_tokens"')], None, "sampling_parameters"),
    ("json_null", [text_in(), stream_on(), sp("null")], None, "sampling_parameters"),
    ("json_int_of_5000_digits", [text_in(), stream_on(), sp('{"seed": ' + "9" * 5000 + "}")],
     None, "sampling_parameters: malformed JSON"),
    ("json_nested_1500_deep", [text_in(), stream_on(), sp('{"a":' * 1500 + "1" + "}" * 1500)],
     None, "sampling_parameters: JSON nested too deeply"),
    ("unknown_key", ok(bogus_key=1), None, "bogus_key"),
    ("unknown_input_tensor", [text_in(), stream_on(), tensor("bogus_input", [1])], None,
     "bogus_input"),
    ("max_tokens_list", ok(max_tokens=[4]), None, "max_tokens"),
    ("max_tokens_bool", ok(max_tokens=True), None, "max_tokens"),
    ("max_tokens_fraction", ok(max_tokens=2.5), None, "max_tokens"),
    ("max_tokens_word", ok(max_tokens="ten"), None, "max_tokens"),
    ("max_tokens_zero", ok(max_tokens=0), None, "max_tokens"),
    ("max_tokens_negative", ok(max_tokens=-3), None, "max_tokens"),
    ("max_tokens_huge", ok(max_tokens=10**12), None, "max_tokens"),
    ("temperature_word", ok(temperature="warm"), None, "temperature"),
    ("temperature_negative", ok(temperature=-0.5), None, "temperature"),
    ("top_p_zero", ok(top_p=0), None, "top_p"),
    ("top_p_above_one", ok(top_p=1.5), None, "top_p"),
    ("top_k_zero", ok(top_k=0), None, "top_k"),
    ("top_k_vocab", ok(top_k=VOCAB), None, "top_k"),
    ("min_p_negative", ok(min_p=-0.1), None, "min_p"),
    ("min_p_above_one", ok(min_p=1.5), None, "min_p"),
    ("n_too_many", ok(n=65), None, "n"),
    ("ignore_eos_word", ok(ignore_eos="maybe"), None, "ignore_eos"),
    ("stop_ints", ok(stop=[1, 2]), None, "stop"),
    ("stop_with_null", ok(stop=["a", None]), None, "stop"),
    ("stop_token_ids_out_of_vocab", ok(stop_token_ids=[VOCAB + 5]), None, "stop_token_ids"),
    ("logprobs_too_many", ok(logprobs=21), None, "logprobs"),
    ("min_tokens_above_max", ok(min_tokens=9), None, "min_tokens"),
    ("beyond_context", ok(max_tokens=600), None, "context length"),
    ("never_fits_pool", ok(max_tokens=450), None, "KV pool"),
    ("long_prompt_never_fits_pool", [tensor("input_ids", [7] * 400), stream_on()], None,
     "KV pool"),
    ("stream_with_echo", [text_in(), stream_on(), tensor("exclude_input_in_output", [False])],
     None, "exclude_input_in_output"),
    ("parameters_max_tokens_word", [text_in(), stream_on()], {"max_tokens": "many"},
     "max_tokens"),
    ("parameters_unknown_key", [text_in(), stream_on()], {"bogus_param": "1"}, "bogus_param"),
    ("parameters_top_p_string_out_of_range", [text_in(), stream_on()], {"top_p": "2"}, "top_p"),
]
# Wrong dtypes/shapes and unknown tensors: Triton's frontend checks them against config.pbtxt.
FRONTEND_CASES = {"text_input_int64", "text_input_two_elements", "input_ids_fp32",
                  "input_ids_int32", "input_ids_bytes", "sampling_parameters_bool",
                  "sampling_parameters_two_elements", "unknown_input_tensor"}
for _name in BOOL_INPUTS:  # wrong dtype and wrong shape for every BOOL switch
    CASES.append((f"{_name}_int64", [text_in(), tensor(_name, [1])], None, _name))
    CASES.append((f"{_name}_two_elements", [text_in(), tensor(_name, [True, False])], None, _name))
    FRONTEND_CASES |= {f"{_name}_int64", f"{_name}_two_elements"}


# ----------------------------------------------------------------------------- raw gRPC stream
class RawStream:
    """A `ModelStreamInfer` stream that keeps each response's error and FINAL flag."""

    def __init__(self, url: str):
        self.channel = grpc.insecure_channel(url)
        self.requests: queue.Queue = queue.Queue()
        self.responses: queue.Queue = queue.Queue()
        stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self._call = stub.ModelStreamInfer(iter(self.requests.get, None))
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for r in self._call:
                self.responses.put(r)
        except grpc.RpcError as e:  # the stream was closed
            self.responses.put(e)

    def send(self, inputs: list, rid: str, parameters: dict | None = None) -> None:
        req = grpc_utils._get_inference_request(
            model_name=MODEL, inputs=inputs, model_version="", request_id=rid, outputs=None,
            sequence_id=0, sequence_start=False, sequence_end=False, priority=0, timeout=None,
            parameters=parameters)
        req.parameters["triton_enable_empty_final_response"].bool_param = True
        self.requests.put(req)

    def close(self) -> None:
        self.requests.put(None)
        self._call.cancel()
        self.channel.close()


def is_final(r) -> bool:
    return r.infer_response.parameters["triton_final_response"].bool_param


def run_good(url: str, tag: str, results: dict[str, str]) -> None:
    """The greedy good requests on their own tritonclient stream; rid → streamed text."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for i, prompt in enumerate(GOOD_PROMPTS):
            inputs = [text_in(prompt), stream_on()]
            if i == len(GOOD_PROMPTS) - 1:  # no tensor: request parameters, values as strings
                params = GOOD_STRINGS
            else:
                inputs.append(sp(GOOD_SAMPLING))
                params = None
            client.async_stream_infer(MODEL, inputs, request_id=f"{tag}{i}", parameters=params,
                                      enable_empty_final_response=True)
        done, texts, finals = 0, {}, {}
        while done < len(GOOD_PROMPTS):
            result, error = responses.get(timeout=TIMEOUT)
            assert error is None, f"good request failed: {error}"
            resp = result.get_response()
            out = result.as_numpy("text_output")
            texts[resp.id] = texts.get(resp.id, "") + (out[0].decode() if out is not None else "")
            if resp.parameters["triton_final_response"].bool_param:
                finals[resp.id] = finals.get(resp.id, 0) + 1
                done += 1
        assert all(n == 1 for n in finals.values()) and len(finals) == len(GOOD_PROMPTS)
        results.update(texts)
    finally:
        client.stop_stream()
        client.close()


def http_body(inputs: list, params: dict | None) -> dict | None:
    """The same request as a JSON body for the HTTP generate endpoint (None: not expressible)."""
    body: dict[str, Any] = dict(params or {})
    for t in inputs:
        arr = t.numpy_value
        if t.datatype() == "BYTES":
            try:
                body[t.name()] = arr.reshape(-1)[0].decode("utf-8")
            except UnicodeDecodeError:
                return None
        elif t.datatype() == "BOOL":
            body[t.name()] = bool(arr.reshape(-1)[0])
        else:
            body[t.name()] = [int(v) for v in arr.reshape(-1)]
    return body


# ------------------------------------------------------------------------------------ tests
def test_case_names_are_distinct():
    names = [c[0] for c in CASES]
    assert len(names) == len(set(names)) and len(names) >= 30


def test_bad_input_matrix_with_concurrent_good_requests(server):
    baseline: dict[str, str] = {}
    run_good(server.grpc_url, "g", baseline)
    assert len(baseline) == len(GOOD_PROMPTS) and all(baseline.values())

    concurrent: list[dict[str, str]] = [{}, {}]
    failures: list[BaseException] = []

    def good(tag: str, into: dict[str, str]) -> None:
        try:
            run_good(server.grpc_url, tag, into)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failures.append(e)

    threads = [threading.Thread(target=good, args=("g", concurrent[0])),
               threading.Thread(target=good, args=("g", concurrent[1]))]
    for t in threads:
        t.start()
    s = RawStream(server.grpc_url)
    got: dict[str, tuple[str, bool, str]] = {}
    try:
        for name, inputs, params, _ in CASES:
            t0 = time.monotonic()
            s.send(inputs, name, params)
            r = s.responses.get(timeout=TIMEOUT)
            assert not isinstance(r, grpc.RpcError), f"{name}: stream failed: {r}"
            # rejected at once: never queued behind the good requests
            assert time.monotonic() - t0 < 5.0, f"{name}: took {time.monotonic() - t0:.1f}s"
            got[name] = (r.error_message, is_final(r), r.infer_response.id)
        time.sleep(0.5)
        assert s.responses.empty(), "a bad request got more than one response"
    finally:
        s.close()
    for t in threads:
        t.join(TIMEOUT)
    assert failures == []
    for name, _, _, field in CASES:
        message, final, rid = got[name]
        assert rid == name
        assert field in message, f"{name}: {message!r} does not name {field!r}"
        if name in FRONTEND_CASES:  # Triton rejected it; the model never saw it (no FINAL flag)
            assert f"for model '{MODEL}'" in message or f"model '{MODEL}' expects" in message
            assert not final
        else:  # our model: one error response flagged FINAL
            assert final, f"{name}: error response not flagged FINAL"
    assert concurrent[0] == baseline and concurrent[1] == baseline


def test_model_errors_are_invalid_argument_over_http(server):
    """HTTP shows the status code that the gRPC stream hides: INVALID_ARGUMENT is 400."""
    checked = 0
    for name, inputs, params, field in CASES:
        body = http_body(inputs, params)
        if name in FRONTEND_CASES or body is None:
            continue
        r = requests.post(f"{server.http_url}/v2/models/{MODEL}/generate", json=body,
                          timeout=TIMEOUT)
        assert r.status_code == 400, f"{name}: {r.status_code} {r.text}"
        assert field in r.json()["error"], f"{name}: {r.text}"
        checked += 1
    assert checked >= 30


def test_no_leak_at_unload(server):
    server.check_alive()
    server.stop()
    log = server.log_path.read_text(errors="replace")
    bad = [line for line in log.splitlines() if line.startswith("E")
           and ("triton_model.py" in line or "responder.py" in line)]
    assert bad == []
    m = re.search(rf"\[mla_backend\] {MODEL}: unloaded; engine stats: ([^;]*); "
                  r"pool invariant (\w+)", log)
    assert m, "no unload line"
    stats = {k: int(v) for k, v in (kv.split("=") for kv in m.group(1).split())}
    assert m.group(2) == "ok"
    assert stats["live"] == stats["running"] == stats["waiting"] == 0
    assert stats["protected_slots"] == 0
    assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"] == 384
