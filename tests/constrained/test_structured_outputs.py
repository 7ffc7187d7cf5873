"""Structured outputs, logit_bias and allowed_token_ids through the engine (`Engine.generate`, a
tiny random DeepSeek-V2 with SmolLM2's tokenizer, CPU): every output of a JSON-schema request
validates (jsonschema) and every regex output matches (Python's `re`), greedy and sampled, mixed in
one batch with unconstrained requests whose outputs stay as they are alone; the overlap schedule
gives the serial outputs, also with every mask filled on the fill thread, whose failure fails its
batch alone; `choice` gives one of the choices; a bad regex fails its request alone
with INVALID_ARGUMENT's flag; the pools balance after each run."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_backend.config import EngineConfig
from mla_backend.constrained import grammar, manager
from mla_backend.engine import Engine
from mla_backend.request import FinishReason, GenerateRequest, SamplingParams

from constrained_helpers import regexes, schemas

PROMPTS = ["Once upon a time", "The answer is", "Tom and Lily went to the park. They"]
_settings = settings(max_examples=6, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture,
                                            HealthCheck.too_slow])


@pytest.fixture(scope="module")
def model_dir(tiny_deepseek_factory):
    return tiny_deepseek_factory(seed=1, hidden_size=128, num_hidden_layers=3)


def _engine(path: str, overlap: str = "false", **kw) -> Engine:
    return Engine(EngineConfig.create(model_path=path, dtype="float32", device="cpu",
                                      overlap_schedule=overlap, **kw))


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = _engine(model_dir)
    yield eng
    eng.close()


def _sp(spec: dict | None = None, seed: int | None = None, **kw) -> SamplingParams:
    d: dict = {"max_tokens": 160, "temperature": 0.0 if seed is None else 0.9, **kw}
    if seed is not None:
        d["seed"] = seed
    if spec is not None:
        d["structured_outputs"] = spec
    return SamplingParams.from_dict(d)


def _loads(text: str):
    # strict=False: xgrammar 0.2.9 may let a bounded string hold raw control characters
    # (tests/constrained/test_constrained_grammar.py pins that upstream bug)
    return json.loads(text, strict=False)


@_settings
@given(schema=schemas, regex=regexes, seed=st.integers(0, 1000))
def test_constrained_outputs_follow_their_constraint_and_leave_others_alone(engine, schema,
                                                                            regex, seed):
    free = [_sp(), _sp(seed=seed)]
    alone = engine.generate(PROMPTS[:2], free)
    cases = [_sp({"json": schema}), _sp({"json": schema}, seed=seed),
             _sp({"regex": regex}), _sp({"regex": regex}, seed=seed + 1)]
    got = engine.generate(PROMPTS[:2] + [PROMPTS[2]] * 4, free + cases)
    assert [r.token_ids for r in got[:2]] == [r.token_ids for r in alone]
    for r in got[2:]:
        assert r.error is None and r.finish_reason == FinishReason.STOP, r
    for r in got[2:4]:
        jsonschema.validate(_loads(r.text), schema)
    for r in got[4:]:
        assert re.fullmatch(regex, r.text), (regex, r.text)
    engine.check_invariant()


@pytest.mark.parametrize("background_from", [manager.BACKGROUND_MIN_ROWS, 1],
                         ids=["fill-default", "fill-on-its-thread"])
def test_overlap_schedule_gives_the_serial_outputs(model_dir, engine, monkeypatch,
                                                   background_from):
    # background_from 1: every batch's masks are filled on the fill thread while the engine
    # thread goes on (`GrammarManager.start_masks`)
    monkeypatch.setattr(manager, "BACKGROUND_MIN_ROWS", background_from)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                               "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["name", "n"]}
    sps = [_sp({"json": schema}), _sp(), _sp({"regex": "[a-z]{3,8}( [0-9]+)?"}, seed=4),
           _sp({"choice": ["yes", "no", "maybe"]}, seed=2)]
    prompts = PROMPTS + [PROMPTS[0]]
    serial = engine.generate(prompts, sps)
    overlapped = _engine(model_dir, overlap="true")
    try:
        assert overlapped.overlap
        got = overlapped.generate(prompts, sps)
        overlapped.check_invariant()
    finally:
        overlapped.close()
    assert [(r.token_ids, r.text) for r in got] == [(r.token_ids, r.text) for r in serial]
    jsonschema.validate(_loads(serial[0].text), schema)
    assert serial[3].text in ("yes", "no", "maybe")


def test_the_one_pass_greedy_kernel_with_masks_gives_the_torch_paths_outputs(model_dir,
                                                                             monkeypatch):
    # greedy constrained rows sampled by `greedy_with_logprob` with the grammar bitmasks (the
    # default on CUDA; here under triton's interpreter) against the torch path's masked logits,
    # with the masks filled on the fill thread under the overlap schedule
    import mla_kernels.sampling as sampling_mod

    monkeypatch.setattr(manager, "BACKGROUND_MIN_ROWS", 1)
    kernel, masked_calls = sampling_mod.greedy_with_logprob, []

    def recorded(x, *args, **kw):
        masked_calls.append("bitmask" in kw)
        return kernel(x, *args, **kw)

    monkeypatch.setattr(sampling_mod, "greedy_with_logprob", recorded)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "ok": {"type": "boolean"}},
              "required": ["name", "ok"]}
    sps = [_sp({"json": schema}), _sp(), _sp({"regex": "[a-z]{3,8}( [0-9]+)?"}),
           _sp({"choice": ["yes", "no", "maybe"]})]
    prompts = PROMPTS + [PROMPTS[0]]
    outs = {}
    for fused in (False, True):
        eng = _engine(model_dir, overlap="true")
        try:
            eng.sampler.fused_greedy = fused
            outs[fused] = eng.generate(prompts, sps)
            eng.check_invariant()
        finally:
            eng.close()
    assert [(r.token_ids, r.text) for r in outs[True]] == \
        [(r.token_ids, r.text) for r in outs[False]]
    assert masked_calls.count(True) > 10  # (the kernel ran only with fused_greedy on)
    jsonschema.validate(_loads(outs[True][0].text), schema)
    assert outs[True][3].text in ("yes", "no", "maybe")


def test_a_failed_fill_on_the_fill_thread_fails_its_batch_alone(model_dir, monkeypatch):
    # the fill thread's error reaches the batch whose masks it filled, as a launch error does;
    # the engine serves the next requests and its pools balance
    monkeypatch.setattr(manager, "BACKGROUND_MIN_ROWS", 1)
    real_fill = grammar.BitmaskFiller.fill
    calls = {"n": 0, "failed": 0}

    def failing_fill(self, states, bitmask):
        calls["n"] += 1
        # the first fill of both requests' rows on the fill thread (a decode step's)
        if (len(states) == 2 and not calls["failed"]
                and threading.current_thread().name.startswith("grammar-fill")):
            calls["failed"] += 1
            raise RuntimeError("fill failed on purpose")
        return real_fill(self, states, bitmask)

    monkeypatch.setattr(grammar.BitmaskFiller, "fill", failing_fill)
    eng = _engine(model_dir, overlap="true")
    try:
        sps = [_sp({"regex": "[a-z]{20,40}"}), _sp({"regex": "[0-9]{20,40}"})]
        got = eng.generate(PROMPTS[:2], sps)
        assert all(r.finish_reason == FinishReason.ABORT for r in got), got
        assert all("fill failed on purpose" in (r.error or "") for r in got), got
        eng.check_invariant()
        again = eng.generate(PROMPTS[:2], sps)
        assert [r.error for r in again] == [None, None]
        assert re.fullmatch("[a-z]{20,40}", again[0].text)
        assert re.fullmatch("[0-9]{20,40}", again[1].text)
        eng.check_invariant()
    finally:
        eng.close()
    assert calls["failed"] == 1 and calls["n"] > 3


def test_choice_gives_one_of_the_choices(engine):
    choices = ["red", "green", "blue sky", "é"]
    got = engine.generate([PROMPTS[0]] * 4, [_sp({"choice": choices})] +
                          [_sp({"guided_choice": choices}, seed=s) for s in range(3)])
    assert all(r.text in choices and r.finish_reason == FinishReason.STOP for r in got)


def test_a_bad_regex_fails_its_request_alone(engine):
    got = engine.generate(PROMPTS[:3], [_sp(), _sp({"regex": "(unclosed"}),
                                        _sp({"json": {"type": "object"}})])
    assert got[0].error is None and got[2].error is None
    assert got[1].finish_reason == FinishReason.ABORT and got[1].token_ids == []
    assert got[1].error.startswith("structured_outputs.regex: invalid regex")
    engine.check_invariant()
    assert engine.stats()["live"] == 0


def test_the_invalid_flag_reaches_the_output(engine):
    engine.add_request(GenerateRequest(rid="bad", text="x", sampling_params=_sp(
        {"grammar": 'root ::= "a" | '})))
    outs = []
    deadline = time.monotonic() + 60
    while not outs:
        assert time.monotonic() < deadline, "no output for the bad grammar"
        outs = [o for o in engine.step() if o.rid == "bad"]
    assert outs[0].finished and outs[0].invalid_request
    assert outs[0].error.startswith("structured_outputs.grammar: invalid grammar")


def test_a_grammar_with_no_allowed_token_is_the_requests_error(engine):
    """allowed_token_ids that rule out every token the choice can start with: the request
    ends with the dead-end error flagged as the client's (INVALID_ARGUMENT at the adapter),
    its neighbour is served."""
    tok = engine.tokenizer
    allowed = tok.encode(" banana", add_special_tokens=False)[:1]
    got = engine.generate(PROMPTS[:2], [_sp({"choice": ["red", "green"]},
                                            allowed_token_ids=allowed), _sp(max_tokens=4)])
    assert got[0].finish_reason == FinishReason.ABORT and got[0].token_ids == []
    assert "no token the request allows fits its grammar" in got[0].error
    assert got[1].error is None and len(got[1].token_ids) == 4
    engine.add_request(GenerateRequest(rid="dead", text="x", sampling_params=_sp(
        {"choice": ["red"]}, allowed_token_ids=allowed)))
    outs: list = []
    deadline = time.monotonic() + 60
    while not outs:
        assert time.monotonic() < deadline, "no output for the dead end"
        outs = [o for o in engine.step() if o.rid == "dead"]
    assert outs[0].finished and outs[0].invalid_request
    engine.check_invariant()


def test_logit_bias_and_allowed_token_ids(engine):
    tok = engine.tokenizer
    target = tok.encode(" banana", add_special_tokens=False)[0]
    biased = engine.generate([PROMPTS[0]], _sp(logit_bias={str(target): 100.0},
                                               max_tokens=4))[0]
    assert biased.token_ids == [target] * 4
    allowed = tok.encode(" a b c", add_special_tokens=False)
    for seed in (None, 3):
        got = engine.generate([PROMPTS[1]], _sp(seed=seed, allowed_token_ids=allowed,
                                                max_tokens=12, ignore_eos=True))[0]
        assert len(got.token_ids) == 12 and set(got.token_ids) <= set(allowed)
    engine.check_invariant()


def test_request_field_errors_name_the_field():
    for d, needle in [({"structured_outputs": {"json": {}, "regex": "a"}}, "exactly one"),
                      ({"guided_decoding": "{not json"}, "guided_decoding"),
                      ({"structured_outputs": {"regex": "a"}, "min_tokens": 1}, "min_tokens"),
                      ({"logit_bias": {"x": 1}}, "logit_bias"),
                      ({"allowed_token_ids": []}, "allowed_token_ids")]:
        with pytest.raises(ValueError, match=needle):
            SamplingParams.from_dict(d)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingParams.from_dict({"logit_bias": {"99999999": 1}}).verify(1000)
