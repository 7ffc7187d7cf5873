"""Jump-forward through the engine (`Engine.generate`, a tiny random DeepSeek-V2 with SmolLM2's
tokenizer, CPU, fp32): a grammar that forces long runs of tokens (digits: one token each in
SmolLM2's vocabulary) gives the same tokens, text and finish reason with jump-forward as
without, serial and overlapped, with the radix cache and without, in a batch with unconstrained
and sampled requests; the forced tokens are appended (counted) and computed in fewer forward
passes (counted); stop token ids and max_tokens inside a forced run end the request where
token-by-token decoding does; requests whose logprobs the client reads or whose sampling is
seeded never jump; an abort while a request waits for its jump leaks nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mla_backend.config import EngineConfig
from mla_backend.engine import Engine
from mla_backend.forward_batch import ForwardMode
from mla_backend.request import FinishReason, GenerateRequest, SamplingParams

# forced: the start (joins the prefill), the run after the first free word (one extend step)
# and, once the second word is done, the end (appended with the stop token: no step at all)
FORCED = r"0123-4567-8901-2345 for [a-z]{2,8}\. Ref 99887766554433 by [a-z]{2,6}\."
PROMPTS = ["Once upon a time", "The answer is", "Tom and Lily went to the park. They"]


@pytest.fixture(scope="module")
def model_dir(tiny_deepseek_factory):
    return tiny_deepseek_factory(seed=1, hidden_size=128, num_hidden_layers=3)


def _engine(path: str, jump: int, overlap: str = "false", radix: bool = True) -> Engine:
    eng = Engine(EngineConfig.create(model_path=path, dtype="float32", device="cpu",
                                     overlap_schedule=overlap, enable_radix_cache=radix,
                                     jump_forward_min_tokens=jump))
    eng.forwards = []  # the forward passes, by mode
    forward = eng.runner.forward

    def counted(fb):
        eng.forwards.append(fb.forward_mode)
        return forward(fb)

    eng.runner.forward = counted
    return eng


def _sp(spec: dict | None = None, **kw) -> SamplingParams:
    d: dict = {"max_tokens": 64, "temperature": 0.0, **kw}
    if spec is not None:
        d["structured_outputs"] = spec
    return SamplingParams.from_dict(d)


def _run(path: str, jump: int, params: list[SamplingParams], prompts: list[str], **kw):
    eng = _engine(path, jump, **kw)
    try:
        got = eng.generate(prompts, params)
        eng.check_invariant()
        assert eng.stats()["running"] == 0 and eng.stats()["live"] == 0
        return [(r.token_ids, r.text, r.finish_reason, r.error) for r in got], eng
    finally:
        eng.close()


@pytest.mark.parametrize("overlap,radix", [("false", True), ("true", True), ("true", False)])
def test_long_forced_runs_are_equal_with_and_without_jump_forward(model_dir, overlap, radix):
    params = [_sp({"regex": FORCED}), _sp(), _sp({"regex": FORCED}),
              _sp({"json": {"type": "object", "properties": {"id": {"enum": [12345678901]}},
                            "required": ["id"]}}),
              _sp({"regex": FORCED}, temperature=0.8)]  # sampled without a seed: still valid
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[1]]
    plain, eng0 = _run(model_dir, 0, params[:4], prompts[:4], overlap=overlap, radix=radix)
    jumped, eng1 = _run(model_dir, 4, params, prompts, overlap=overlap, radix=radix)
    assert jumped[:4] == plain
    for _, text, reason, error in (jumped[0], jumped[2], jumped[4]):  # the FORCED requests
        assert error is None and reason == FinishReason.STOP
        assert text.startswith("0123-4567-8901-2345 for ") and \
            ". Ref 99887766554433 by " in text and text.endswith("."), text
    assert jumped[3][1] == '{"id": 12345678901}'
    assert eng0.stats()["jump_forward_tokens"] == 0 and eng0.scheduler.num_jumps == 0
    # the 19 tokens of "0123-4567-8901-2345 " (and more) join the prefills; of "Ref
    # 99887766554433 by " (after ". ": at least 15 forced tokens) all but the first 4 or 5 (the
    # look ahead waits for 4 forced tokens in a row) are extended in one step, per request
    assert eng1.stats()["jump_forward_tokens"] >= 3 * (19 + 10)
    assert eng1.scheduler.num_jumps >= 3


def test_jumps_take_fewer_forward_passes(model_dir):
    params = [_sp({"regex": FORCED})] * 3
    plain, eng0 = _run(model_dir, 0, params, PROMPTS)
    jumped, eng1 = _run(model_dir, 4, params, PROMPTS)
    assert jumped == plain
    # the forced prefix joins the prefill and the run after the first word, all but its first
    # 4 tokens, is one EXTEND: at least 19 + 10 decode steps fewer (the requests decode together)
    decodes0 = eng0.forwards.count(ForwardMode.DECODE)
    decodes1 = eng1.forwards.count(ForwardMode.DECODE)
    assert decodes1 <= decodes0 - 29, (eng0.forwards, eng1.forwards)
    assert len(eng1.forwards) < len(eng0.forwards) - 25


def test_stop_token_ids_and_max_tokens_inside_a_forced_run(model_dir, tokenizer):
    seven = tokenizer.encode("7", add_special_tokens=False)
    assert len(seven) == 1
    params = [_sp({"regex": FORCED}, stop_token_ids=seven),  # stops at the "7" of "4567"
              _sp({"regex": FORCED}, max_tokens=10),  # ends inside the forced prefix
              _sp({"regex": FORCED}, max_tokens=30)]  # ends inside the run after the word
    plain, _ = _run(model_dir, 0, params, PROMPTS)
    jumped, eng = _run(model_dir, 1, params, PROMPTS)
    assert jumped == plain
    assert jumped[0][1] == "0123-456" and jumped[0][2] == FinishReason.STOP
    assert len(jumped[1][0]) == 10 and jumped[1][2] == FinishReason.LENGTH
    assert len(jumped[2][0]) == 30 and jumped[2][2] == FinishReason.LENGTH
    assert eng.stats()["jump_forward_tokens"] > 0


def test_no_jumps_where_the_output_or_its_logprobs_could_change(model_dir):
    seeded = _sp({"regex": FORCED}, temperature=0.9, seed=7)
    logprobs = _sp({"regex": FORCED}, logprobs=2)
    read = replace(_sp({"regex": FORCED}), logprobs_returned=True)  # return_cumulative_logprob
    plain, _ = _run(model_dir, 0, [seeded, logprobs, read], PROMPTS)
    jumped, eng = _run(model_dir, 1, [seeded, logprobs, read], PROMPTS)
    assert jumped == plain
    assert eng.stats()["jump_forward_tokens"] == 0 and eng.scheduler.num_jumps == 0


def test_abort_while_a_request_waits_for_its_jump_leaks_nothing(model_dir):
    eng = _engine(model_dir, 1)
    try:
        eng.add_request(GenerateRequest(rid="a", text=PROMPTS[0], sampling_params=_sp(
            {"regex": FORCED})))
        eng.add_request(GenerateRequest(rid="b", text=PROMPTS[1], sampling_params=_sp()))
        finals = {}
        for _ in range(200):
            for out in eng.step():
                if out.finished:
                    finals[out.rid] = out
            if eng.scheduler.jumping:
                break
        assert [r.rid for r in eng.scheduler.jumping] == ["a"]
        eng.abort("a")
        while eng.has_work():
            for out in eng.step():
                if out.finished:
                    finals[out.rid] = out
        assert finals["a"].finish_reason == FinishReason.ABORT
        assert finals["b"].finish_reason is not None
        eng.check_invariant()
        stats = eng.stats()
        assert stats["running"] == 0 and stats["live"] == 0 and not eng.scheduler.jumping
        assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]
    finally:
        eng.close()


def test_a_forced_text_longer_than_one_jump(model_dir):
    from mla_backend.engine import JUMP_MAX_TOKENS

    digits = "0123456789" * (JUMP_MAX_TOKENS // 10 + 5)  # one token each
    params = [_sp({"regex": digits + " [a-z]{1,3}"}, max_tokens=len(digits) + 8)]
    plain, _ = _run(model_dir, 0, params, PROMPTS[:1], overlap="true")
    jumped, eng = _run(model_dir, 4, params, PROMPTS[:1], overlap="true")
    assert jumped == plain and plain[0][1].startswith(digits + " ")
    # the first JUMP_MAX_TOKENS join the prefill, the rest after 4 (5 with a token in flight)
    # decoded ones, in a second jump
    assert len(digits) - 5 <= eng.stats()["jump_forward_tokens"] <= len(digits)
    assert eng.scheduler.num_jumps == 1
