"""Unit tests of `mla_backend.serving.protocol` with plain numpy arrays (no tritonserver)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mla_backend.config import ConfigError, EngineConfig
from mla_backend.request import FinishReason, RequestOutput
from mla_backend.serving.protocol import (
    ADAPTER_PARAMETERS,
    OutputOptions,
    ProtocolError,
    build_outputs,
    coalesce,
    logprobs_json,
    merge_outputs,
    merge_run,
    parse_request,
    should_hold,
)


def s(text: str) -> np.ndarray:
    return np.array([text.encode()], dtype=np.object_)


def b(value: bool) -> np.ndarray:
    return np.array([value], dtype=np.bool_)


# ------------------------------------------------------------------------------------ parsing
def test_defaults_text_prompt():
    p = parse_request({"text_input": s("Hello")}, None, "r1")
    r = p.request
    assert (r.rid, r.text, r.input_ids, r.stream) == ("r1", "Hello", None, False)
    assert r.sampling_params.max_new_tokens == 16
    assert r.sampling_params.temperature == 1.0
    # non-streaming without exclude_input_in_output echoes the prompt
    assert p.options == OutputOptions(stream=False, echo=True)


def test_sampling_parameters_tensor_with_string_values():
    sp = json.dumps({"max_tokens": "100", "min_tokens": "3", "temperature": "0",
                     "ignore_eos": "false", "stop": ["\n\n", "END"], "seed": 7})
    p = parse_request({"text_input": s("x"), "sampling_parameters": s(sp)}, None, "r")
    got = p.request.sampling_params
    assert got.max_new_tokens == 100 and got.min_new_tokens == 3
    assert got.temperature == 0.0 and got.ignore_eos is False
    assert got.stop == ("\n\n", "END") and got.seed == 7


def test_request_parameters_used_only_without_tensor():
    params = json.dumps({"max_tokens": 5, "temperature": "0.5", "ignore_eos": "true"})
    p = parse_request({"text_input": s("x")}, params, "r")
    assert p.request.sampling_params.max_new_tokens == 5
    assert p.request.sampling_params.temperature == 0.5
    assert p.request.sampling_params.ignore_eos is True
    # the tensor wins and the two are never merged: max_tokens falls back to the default 16
    p = parse_request({"text_input": s("x"), "sampling_parameters": s('{"top_k": 4}')},
                      params, "r")
    assert p.request.sampling_params.max_new_tokens == 16
    assert p.request.sampling_params.temperature == 1.0
    assert p.request.sampling_params.top_k == 4


def test_request_parameters_as_dict_and_reserved_keys_ignored():
    params = {"max_tokens": "3", "triton_enable_empty_final_response": True, "priority": 0}
    p = parse_request({"text_input": s("x")}, params, "r")
    assert p.request.sampling_params.max_new_tokens == 3


def test_input_ids_int32_and_int64():
    for dtype in (np.int32, np.int64):
        p = parse_request({"input_ids": np.array([1, 2, 3], dtype=dtype)}, None, "r")
        assert p.request.input_ids == [1, 2, 3] and p.request.text is None
        assert all(type(t) is int for t in p.request.input_ids)


def test_stream_and_echo_rules():
    p = parse_request({"text_input": s("x"), "stream": b(True)}, None, "r")
    assert p.options.stream and not p.options.echo and p.request.stream
    p = parse_request({"text_input": s("x"), "stream": b(True),
                       "exclude_input_in_output": b(True)}, None, "r")
    assert not p.options.echo
    p = parse_request({"text_input": s("x"), "exclude_input_in_output": b(True)}, None, "r")
    assert not p.options.echo
    p = parse_request({"text_input": s("x"), "exclude_input_in_output": b(False)}, None, "r")
    assert p.options.echo
    with pytest.raises(ProtocolError, match="exclude_input_in_output"):
        parse_request({"text_input": s("x"), "stream": b(True),
                       "exclude_input_in_output": b(False)}, None, "r")


def test_return_flags():
    p = parse_request({"text_input": s("x"), "return_finish_reason": b(True),
                       "return_num_output_tokens": b(True), "return_cached_tokens": b(False)},
                      None, "r")
    o = p.options
    assert o.return_finish_reason and o.return_num_output_tokens
    assert not (o.return_cached_tokens or o.return_logprobs or o.return_num_input_tokens
                or o.return_cumulative_logprob)
    assert not p.request.sampling_params.logprobs_returned
    # a client that reads logprobs: the engine must compute each token's (no jump-forward)
    for flag in ("return_logprobs", "return_cumulative_logprob"):
        p = parse_request({"text_input": s("x"), flag: b(True)}, None, "r")
        assert p.request.sampling_params.logprobs_returned


@pytest.mark.parametrize(
    "inputs, params, field",
    [
        ({}, None, "text_input"),
        ({"text_input": s("")}, None, "text_input"),
        ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, None, "text_input"),
        ({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}, None, "text_input"),
        ({"text_input": s("x"), "input_ids": np.array([1], dtype=np.int64)}, None, "input_ids"),
        ({"input_ids": np.array([], dtype=np.int64)}, None, "input_ids"),
        ({"input_ids": np.array([1, -2], dtype=np.int64)}, None, "input_ids"),
        ({"input_ids": np.array([1.0], dtype=np.float32)}, None, "input_ids"),
        ({"text_input": s("x"), "sampling_parameters": s("{not json")}, None,
         "sampling_parameters"),
        ({"text_input": s("x"), "sampling_parameters": s("[1, 2]")}, None, "sampling_parameters"),
        ({"text_input": s("x"), "sampling_parameters": s('{"max_tokenz": 3}')}, None,
         "max_tokenz"),
        ({"text_input": s("x"), "sampling_parameters": s('{"max_tokens": 0}')}, None,
         "max_tokens"),
        ({"text_input": s("x"), "sampling_parameters": s('{"temperature": "hot"}')}, None,
         "temperature"),
        ({"text_input": s("x"), "sampling_parameters": s('{"ignore_eos": "maybe"}')}, None,
         "ignore_eos"),
        ({"text_input": s("x")}, '{"max_tokens": -1}', "max_tokens"),
        ({"text_input": s("x")}, '{"bogus": 1}', "bogus"),
        ({"text_input": s("x")}, "[]", "parameters"),
        ({"text_input": s("x"), "stream": np.array([1], dtype=np.int32)}, None, "stream"),
        ({"text_input": s("x"), "extra": s("y")}, None, "extra"),
    ],
)
def test_invalid_requests_name_the_field(inputs, params, field):
    with pytest.raises(ProtocolError, match=field):
        parse_request(inputs, params, "r")


DEEP = '{"a":' * 1500 + "1" + "}" * 1500  # deeper than Python's JSON decoder recurses


@pytest.mark.parametrize("raw, message", [
    ('{"seed": ' + "9" * 5000 + "}", "sampling_parameters: malformed JSON"),
    (DEEP, "sampling_parameters: JSON nested too deeply"),
    # the constraint as a JSON string: decoded by the sampling parameters' own checks
    (json.dumps({"structured_outputs": '{"json": ' + DEEP + "}"}),
     "sampling_parameters: nested too deeply"),
])
def test_json_the_decoder_cannot_take_is_the_clients_error(raw, message):
    """An integer of more digits than Python converts and JSON nested past the recursion
    limit are INVALID_ARGUMENT (ProtocolError) naming the field, not an internal error."""
    with pytest.raises(ProtocolError, match=message):
        parse_request({"text_input": s("x"), "sampling_parameters": s(raw)}, None, "r")


# ------------------------------------------------------------------------------------ outputs
def out(**kw) -> RequestOutput:
    base = dict(rid="r", new_token_ids=[5, 6], new_text=" world", finished=False,
                num_input_tokens=3, num_output_tokens=4, cached_tokens=2,
                cumulative_logprob=-1.5)
    base.update(kw)
    return RequestOutput(**base)


def txt(arr: np.ndarray) -> str:
    assert arr.dtype == np.object_ and arr.shape == (1,)
    return arr[0].decode()


def test_build_outputs_text_only_by_default():
    t = build_outputs(out(), OutputOptions(stream=True))
    assert list(t) == ["text_output"] and txt(t["text_output"]) == " world"


def test_build_outputs_non_streaming_echo_and_all_fields():
    opts = OutputOptions(stream=False, echo=True, return_finish_reason=True,
                         return_num_input_tokens=True, return_num_output_tokens=True,
                         return_cumulative_logprob=True, return_logprobs=True,
                         return_cached_tokens=True)
    o = out(finished=True, finish_reason=FinishReason.LENGTH, num_output_tokens=2)
    t = build_outputs(o, opts, prefix="Hello")
    assert txt(t["text_output"]) == "Hello world"
    assert txt(t["finish_reason"]) == "length"
    assert t["num_input_tokens"].dtype == np.uint32 and t["num_input_tokens"].tolist() == [3]
    assert t["num_output_tokens"].tolist() == [2]
    assert t["cumulative_logprob"].dtype == np.float32
    assert t["cumulative_logprob"].tolist() == [-1.5]
    assert txt(t["logprobs"]) == "null"  # the request did not ask for "logprobs"
    assert t["cached_tokens"].dtype == np.uint32 and t["cached_tokens"].tolist() == [2]


def test_build_outputs_streaming_counts_tokens_of_this_response():
    opts = OutputOptions(stream=True, echo=False, return_finish_reason=True,
                         return_num_output_tokens=True)
    t = build_outputs(out(num_output_tokens=9), opts, prefix="ignored")
    assert txt(t["text_output"]) == " world"
    assert txt(t["finish_reason"]) == "None"
    assert t["num_output_tokens"].tolist() == [2]
    t = build_outputs(out(new_token_ids=[], new_text="", finished=True,
                          finish_reason=FinishReason.ABORT), opts)
    assert txt(t["finish_reason"]) == "abort" and t["num_output_tokens"].tolist() == [0]


def test_logprobs_json_ranks_and_decoded_tokens():
    o = out(new_logprobs=[{5: -0.1, 9: -2.0}, {6: -3.0, 1: -0.5, 2: -1.0}])
    got = json.loads(logprobs_json(o, decode=lambda t: f"<{t}>"))
    assert got == [
        {"5": {"logprob": -0.1, "rank": 1, "decoded_token": "<5>"},
         "9": {"logprob": -2.0, "rank": 2, "decoded_token": "<9>"}},
        {"6": {"logprob": -3.0, "rank": 3, "decoded_token": "<6>"},
         "1": {"logprob": -0.5, "rank": 1, "decoded_token": "<1>"},
         "2": {"logprob": -1.0, "rank": 2, "decoded_token": "<2>"}},
    ]
    t = build_outputs(o, OutputOptions(stream=True, return_logprobs=True))
    assert len(json.loads(txt(t["logprobs"]))) == 2


def test_merge_and_hold_streaming_increments():
    opts = OutputOptions(stream=True)
    held = out(new_token_ids=[7], new_text="", num_output_tokens=1, new_logprobs=[{7: -0.2}],
               new_token_logprobs=[-0.2], cumulative_logprob=-0.2)
    assert should_hold(held, opts)
    assert not should_hold(held, OutputOptions(stream=False))
    assert not should_hold(out(new_text="", finished=True), opts)
    nxt = out(new_token_ids=[8], new_text="é", num_output_tokens=2, new_logprobs=[{8: -0.3}],
              new_token_logprobs=[-0.3], cumulative_logprob=-0.5, finished=True,
              finish_reason=FinishReason.STOP)
    m = merge_outputs(held, nxt)
    assert m.new_token_ids == [7, 8] and m.new_text == "é"
    assert m.new_logprobs == [{7: -0.2}, {8: -0.3}] and m.new_token_logprobs == [-0.2, -0.3]
    assert (m.num_output_tokens, m.cumulative_logprob, m.finished, m.finish_reason) == (
        2, -0.5, True, FinishReason.STOP)
    assert merge_outputs(None, nxt) is nxt


def test_coalesce_merges_each_requests_increments_in_order():
    a1 = out(rid="a", new_token_ids=[1], new_text="A1", num_output_tokens=1)
    b1 = out(rid="b", new_token_ids=[5], new_text="B1", num_output_tokens=1)
    a2 = out(rid="a", new_token_ids=[2], new_text="A2", num_output_tokens=2)
    b2 = out(rid="b", new_token_ids=[6], new_text="B2", num_output_tokens=2, finished=True,
             finish_reason=FinishReason.LENGTH)
    a3 = out(rid="a", new_token_ids=[3], new_text="A3", num_output_tokens=3)
    merged = coalesce([a1, b1, a2, b2, a3])
    assert [(m.rid, m.new_text, m.new_token_ids, m.finished) for m in merged] == [
        ("a", "A1A2A3", [1, 2, 3], False), ("b", "B1B2", [5, 6], True)]
    assert merged[0].num_output_tokens == 3 and merged[1].finish_reason == FinishReason.LENGTH
    assert coalesce([a1]) == [a1] and coalesce([]) == []


def test_a_run_of_increments_merges_as_pairwise_merges_do():
    """`merge_run` of three increments (logprobs on the middle one only, the last finished):
    ids, text and logprobs concatenate, the rest is the last one's; a run of one is that output
    itself."""
    o1 = out(new_token_ids=[1, 2], new_text="ab", num_output_tokens=2, cumulative_logprob=-0.1)
    o2 = out(new_token_ids=[3], new_text="", num_output_tokens=3, new_logprobs=[{3: -0.2}],
             new_token_logprobs=[-0.2], cumulative_logprob=-0.3)
    o3 = out(new_token_ids=[4], new_text="cd", num_output_tokens=4, cumulative_logprob=-0.7,
             finished=True, finish_reason=FinishReason.LENGTH)
    m = merge_run([o1, o2, o3])
    assert (m.new_token_ids, m.new_text, m.new_logprobs, m.new_token_logprobs) == (
        [1, 2, 3, 4], "abcd", [{3: -0.2}], [-0.2])
    assert (m.num_output_tokens, m.cumulative_logprob, m.finished, m.finish_reason) == (
        4, -0.7, True, FinishReason.LENGTH)
    assert m is o1  # extended in place
    assert merge_run([o2]) is o2
    assert merge_run([out(new_token_ids=[1]), out(new_token_ids=[2])]).new_logprobs is None


def test_coalesce_keeps_errors_and_finals_separate():
    a1 = out(rid="a", new_token_ids=[1], new_text="A1", num_output_tokens=1)
    err = out(rid="a", new_token_ids=[], new_text="", finished=True, error="boom")
    late = out(rid="a", new_token_ids=[2], new_text="A2", num_output_tokens=2)
    merged = coalesce([a1, err, late])
    assert [(m.new_text, m.error) for m in merged] == [("A1", None), ("", "boom"), ("A2", None)]
    done = out(rid="b", new_token_ids=[4], new_text="B", num_output_tokens=1, finished=True)
    again = out(rid="b", new_token_ids=[5], new_text="C", num_output_tokens=2)
    assert [m.new_text for m in coalesce([done, again])] == ["B", "C"]


def test_instance_layout_for_tensor_parallel():
    from mla_backend.serving.protocol import check_instance_layout

    for kind in ("GPU", "CPU", "MODEL", None):
        check_instance_layout(kind, 1)  # every kind serves TP 1
    check_instance_layout("MODEL", 2)
    check_instance_layout("CPU", 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 .*KIND_MODEL"):
        check_instance_layout("GPU", 2)


def test_vllm_backend_error_texts():
    """Clients of the vLLM backend match on its texts: streaming with echo, and lora_name."""
    with pytest.raises(ProtocolError) as e:
        parse_request({"text_input": s("x"), "stream": b(True),
                       "exclude_input_in_output": b(False)}, None, "r")
    assert str(e.value) == ("Error generating stream: When streaming, "
                            "`exclude_input_in_output` = False is not allowed.")
    with pytest.raises(ProtocolError, match="LoRA feature is not enabled."):
        parse_request({"text_input": s("x"),
                       "sampling_parameters": s('{"lora_name": "adapter-1"}')}, None, "r")


def test_a_vllm_backend_config_with_its_health_check_parameter_loads():
    params = {k: {"string_value": v} for k, v in
              {"model_path": "weights", "ENABLE_VLLM_HEALTH_CHECK": "true"}.items()}
    config = EngineConfig.from_parameters(params, base_dir="/models/m",
                                          ignore=ADAPTER_PARAMETERS)
    assert config.model.model_path == "/models/m/weights"
    with pytest.raises(ConfigError, match="ENABLE_VLLM_HEALTH_CHECK"):
        EngineConfig.from_parameters(params, base_dir="/models/m")
