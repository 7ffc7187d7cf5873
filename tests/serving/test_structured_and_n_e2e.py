"""End-to-end: structured outputs and n > 1 through a real tritonserver serving SmolLM2-135M.

The README's request (a JSON schema in `sampling_parameters`, HTTP generate) answers JSON that
validates and equals the in-process engine's text; a regex over a gRPC stream gives deltas that
concatenate to the in-process text; bad constraints (an invalid regex, a broken grammar, two
constraints at once) each fail alone with a message naming the field while a good request goes
on; `n` = 3 gives three texts per response, each the in-process engine's completion; at unload
the pools balance (nothing live, no slot held by a request).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import requests

from mla_tools.tritonserver import TritonServer

from test_triton_e2e import grpc_inputs, is_final, stream_all, text_of
from serving_helpers import write_model

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
SETTINGS = {"context_length": "512", "max_total_tokens": "4096", "max_running_requests": "8"}
TIMEOUT = 180.0
PROMPT = ("<|im_start|>user\nGive me a person as JSON with name and age.<|im_end|>\n"
          "<|im_start|>assistant\n")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured_outputs_repository")
    write_model(root, MODEL, SETTINGS, source=MODEL)
    srv = TritonServer(root, startup_timeout=300).start()
    yield srv
    srv.stop()
    log = srv.log_path.read_text(errors="replace")
    m = re.search(rf"\[mla_backend\] {MODEL}: unloaded; engine stats: ([^;]*); "
                  r"pool invariant (\w+)", log)
    assert m and m.group(2) == "ok", m
    stats = dict(kv.split("=") for kv in m.group(1).split())
    assert stats["live"] == stats["running"] == stats["waiting"] == "0"
    assert stats["protected_slots"] == "0"


@pytest.fixture(scope="module")
def in_process():
    from mla_backend.config import EngineConfig
    from mla_backend.engine import Engine
    from serving_helpers import engine_config
    from mla_tools.prepare import DEFAULT_MODEL_REPOSITORY

    config: EngineConfig = engine_config(DEFAULT_MODEL_REPOSITORY / MODEL)
    engine = Engine(config.replace(**SETTINGS))
    yield engine
    engine.close()


def _generate(server, sampling: dict) -> requests.Response:
    body = {"text_input": PROMPT, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(sampling)}
    return requests.post(f"{server.http_url}/v2/models/{MODEL}/generate", json=body,
                         timeout=TIMEOUT)


def test_json_schema_through_http_equals_in_process(server, in_process):
    from mla_backend.request import SamplingParams

    sampling = {"temperature": 0, "max_tokens": 60, "structured_outputs": {"json": SCHEMA}}
    r = _generate(server, sampling)
    assert r.status_code == 200, r.text
    text = r.json()["text_output"]
    jsonschema.validate(json.loads(text), SCHEMA)
    want = in_process.generate([PROMPT], SamplingParams.from_dict(sampling))[0]
    assert text == want.text


def test_regex_over_a_grpc_stream_equals_in_process(server, in_process):
    from mla_backend.request import SamplingParams

    sampling = {"temperature": 0, "max_tokens": 30,
                "guided_decoding": {"regex": r"\+1 [0-9]{3}-[0-9]{4}"}}
    by_rid, errors = stream_all(server.grpc_url, MODEL,
                                {"re1": grpc_inputs(PROMPT, sampling=sampling)})
    assert errors == []
    want = in_process.generate([PROMPT], SamplingParams.from_dict(sampling))[0]
    assert len(by_rid["re1"]) > 2 and text_of(by_rid["re1"]) == want.text
    assert re.fullmatch(r"\+1 [0-9]{3}-[0-9]{4}", want.text)


def test_the_grpc_example_client_sends_a_constraint(server, in_process):
    """client_examples/grpc_stream.py --sampling (README "Structured outputs")."""
    from mla_backend.request import SamplingParams

    regex = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
    extra = {"structured_outputs": {"regex": regex}}
    script = Path(__file__).resolve().parents[2] / "client_examples" / "grpc_stream.py"
    run = subprocess.run(
        [sys.executable, str(script), "--url", server.grpc_url, "--model", MODEL, "--prompt",
         PROMPT, "--max-tokens", "30", "--sampling", json.dumps(extra)],
        capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr
    want = in_process.generate([PROMPT], SamplingParams.from_dict(
        {"temperature": 0, "max_tokens": 30, **extra}))[0]
    assert run.stdout.strip() == want.text and re.fullmatch(regex, want.text)
    bad = subprocess.run([sys.executable, str(script), "--url", server.grpc_url, "--sampling",
                          "[1]"], capture_output=True, text=True, timeout=TIMEOUT)
    assert bad.returncode == 2 and "--sampling must be a JSON object" in bad.stderr


def test_the_grpc_example_client_ends_on_ctrl_c_and_on_bytes_that_are_not_utf8(server):
    """client_examples/grpc_stream.py: Ctrl-C (SIGINT) mid-stream ends it at once with exit code
    130 and cancels the request (the module's teardown checks that no slot stays held); a
    prompt of bytes that are not UTF-8 is sent as given and gets the server's error, exit 1."""
    script = Path(__file__).resolve().parents[2] / "client_examples" / "grpc_stream.py"
    proc = subprocess.Popen(
        [sys.executable, str(script), "--url", server.grpc_url, "--model", MODEL, "--prompt",
         PROMPT, "--max-tokens", "400", "--sampling", '{"ignore_eos": true}'],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.read(1), proc.stderr.read().decode()  # the first text has arrived
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
    finally:
        proc.kill()
    err = proc.stderr.read().decode()
    assert rc == 130 and "interrupted (a request in flight was cancelled)" in err, err
    bad = subprocess.run([sys.executable, str(script), "--url", server.grpc_url, "--model",
                          MODEL, "--prompt", b"\xff\xfe"], capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert bad.returncode == 1 and "text_input: not valid UTF-8" in bad.stderr, bad.stderr
    server.check_alive()


@pytest.mark.parametrize("constraint, needle", [
    ({"regex": "(unclosed"}, "structured_outputs.regex: invalid regex"),
    ({"grammar": 'root ::= "a" | '}, "structured_outputs.grammar: invalid grammar"),
    ({"regex": "a", "choice": ["b"]}, "give exactly one of"),
    ({"json": "{not json"}, "structured_outputs.json"),
    # valid JSON Schema that xgrammar would not hold the output to (constrained.schema_check)
    ({"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
     "structured_outputs.json: unsupported JSON schema: at the root: xgrammar would not hold "
     "the output to `uniqueItems`"),
])
def test_a_bad_constraint_fails_alone(server, constraint, needle):
    good = {"temperature": 0, "max_tokens": 40, "structured_outputs": {"choice": ["yes", "no"]}}
    bad = {"max_tokens": 8, "structured_outputs": constraint}
    by_rid, errors = stream_all(server.grpc_url, MODEL,
                                {"good": grpc_inputs(PROMPT, sampling=good),
                                 "bad": grpc_inputs(PROMPT, sampling=bad)})
    assert len(errors) == 1 and needle in errors[0], errors
    assert "bad" not in by_rid and text_of(by_rid["good"]) in ("yes", "no")
    r = _generate(server, {"max_tokens": 8, "structured_outputs": constraint})
    assert r.status_code == 400 and needle in r.json()["error"], r.text
    server.check_alive()


def test_n_completions_over_http_and_a_grpc_stream(server, in_process):
    """n = 3: a non-streaming HTTP request gets three texts in one response; a seeded stream
    gets three elements in every response (each completion's delta, empty when it has none),
    exactly one FINAL, and per completion the in-process engine's text."""
    from mla_backend.request import SamplingParams

    greedy = {"temperature": 0, "max_tokens": 12, "n": 3}
    r = _generate(server, greedy)
    assert r.status_code == 200, r.text
    want = in_process.generate([PROMPT], SamplingParams.from_dict(greedy))
    assert r.json()["text_output"] == [w.text for w in want]
    assert len({w.text for w in want}) == 1

    sampled = {"temperature": 1.0, "max_tokens": 16, "n": 3, "seed": 21, "ignore_eos": True}
    by_rid, errors = stream_all(server.grpc_url, MODEL, {"multi": grpc_inputs(
        PROMPT, sampling=sampled, return_num_output_tokens=True, return_finish_reason=True)})
    assert errors == []
    results = by_rid["multi"]
    texts, tokens = ["", "", ""], [0, 0, 0]
    for res in results:
        out = res.as_numpy("text_output")
        assert out is None or out.shape == (3,)
        if out is None:  # the empty final response
            continue
        for i in range(3):
            texts[i] += out[i].decode()
            tokens[i] += int(res.as_numpy("num_output_tokens")[i])
    assert sum(is_final(res) for res in results) == 1
    want = in_process.generate([PROMPT], SamplingParams.from_dict(sampled))
    assert texts == [w.text for w in want] and tokens == [16, 16, 16]
    assert len(set(texts)) == 3
    reasons = [res.as_numpy("finish_reason") for res in results]
    assert [x.decode() for x in [r for r in reasons if r is not None][-1]] == ["length"] * 3
