"""`SamplingParams.from_dict` (request parsing) and `SamplingParams.verify` (vocab checks)."""

from __future__ import annotations

import dataclasses

import pytest

from mla_backend.request import MAX_LOGPROBS, SamplingParams


def test_empty_and_none_give_defaults() -> None:
    assert SamplingParams.from_dict({}) == SamplingParams()
    assert SamplingParams.from_dict(None) == SamplingParams()
    assert SamplingParams().max_new_tokens == 16


def test_all_fields_native_types() -> None:
    p = SamplingParams.from_dict({
        "max_tokens": 100, "min_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
        "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": -0.5,
        "frequency_penalty": 2, "seed": 1234, "stop": ["###", "\n\n"], "stop_token_ids": [7, 9],
        "ignore_eos": True, "include_stop_str_in_output": True, "skip_special_tokens": False,
        "logprobs": 3, "n": 1,
    })
    assert p == SamplingParams(
        max_new_tokens=100, min_new_tokens=5, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
        repetition_penalty=1.1, presence_penalty=-0.5, frequency_penalty=2.0, seed=1234,
        stop=("###", "\n\n"), stop_token_ids=(7, 9), ignore_eos=True,
        include_stop_str_in_output=True, skip_special_tokens=False, logprobs=3, n=1,
    )
    assert isinstance(p.frequency_penalty, float)


def test_string_values_are_coerced() -> None:
    # genai-perf / Triton request parameters send strings.
    p = SamplingParams.from_dict({
        "max_tokens": "100", "min_tokens": " 100 ", "temperature": "0", "top_p": "0.5",
        "top_k": "-1", "seed": "-7", "ignore_eos": "TRUE", "skip_special_tokens": "false",
        "include_stop_str_in_output": "0", "logprobs": "2", "stop_token_ids": ["3", 4],
        "stop": "</s>", "repetition_penalty": "1e0", "max_new_tokens": None,
    })
    assert (p.max_new_tokens, p.min_new_tokens, p.temperature, p.top_p) == (100, 100, 0.0, 0.5)
    assert p.top_k == -1 and p.seed == -7 and p.logprobs == 2
    assert p.ignore_eos is True and p.skip_special_tokens is False
    assert p.include_stop_str_in_output is False
    assert p.stop_token_ids == (3, 4) and p.stop == ("</s>",) and p.repetition_penalty == 1.0


def test_aliases_and_integral_floats() -> None:
    assert SamplingParams.from_dict({"max_new_tokens": 7}).max_new_tokens == 7
    assert SamplingParams.from_dict({"min_new_tokens": 3}).min_new_tokens == 3
    assert SamplingParams.from_dict({"max_tokens": 64.0}).max_new_tokens == 64
    assert SamplingParams.from_dict({"max_tokens": "64.0"}).max_new_tokens == 64
    assert SamplingParams.from_dict({"stop_token_ids": 5}).stop_token_ids == (5,)
    assert SamplingParams.from_dict({"stop": []}).stop == ()
    assert SamplingParams.from_dict({"ignore_eos": 1}).ignore_eos is True
    assert SamplingParams.from_dict({"top_k": 1}).top_k == 1
    assert SamplingParams.from_dict({"min_p": 1}).min_p == 1.0


@pytest.mark.parametrize(
    "d, field",
    [
        ({"foo": 1}, "foo"),
        ({"max_tokens": 16, "bogus_key": "x"}, "bogus_key"),
        ({"temperature": [1.0]}, "temperature"),
        ({"temperature": "abc"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": "nan"}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": "1.5"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": "abc"}, "max_tokens"),
        ({"max_tokens": [3]}, "max_tokens"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # > default max_tokens 16
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "-3"}, "frequency_penalty"),
        ({"seed": "x"}, "seed"),
        ({"seed": 1.25}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"ignore_eos": "maybe"}, "ignore_eos"),
        ({"ignore_eos": 2}, "ignore_eos"),
        ({"skip_special_tokens": [True]}, "skip_special_tokens"),
        ({"include_stop_str_in_output": 0.5}, "include_stop_str_in_output"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"n": 65}, "n"),
        ({"n": "0"}, "n"),
        ({"max_tokens": 3, "max_new_tokens": 3}, "max_new_tokens"),
    ],
)
def test_invalid_values_name_the_field(d: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams.from_dict(d)


def test_not_a_mapping() -> None:
    with pytest.raises(ValueError, match="JSON object"):
        SamplingParams.from_dict(["max_tokens", 3])  # type: ignore[arg-type]


def test_bounds_are_inclusive_where_documented() -> None:
    p = SamplingParams.from_dict({
        "top_p": 1, "min_p": 0, "presence_penalty": -2, "frequency_penalty": 2,
        "logprobs": MAX_LOGPROBS, "max_tokens": 1, "min_tokens": 1, "seed": 2**64 - 1,
    })
    assert (p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, -2.0, 2.0)
    assert p.logprobs == MAX_LOGPROBS and p.seed == 2**64 - 1
    assert SamplingParams.from_dict({"logprobs": 0}).logprobs == 0


def test_result_is_frozen() -> None:
    p = SamplingParams.from_dict({"max_tokens": 3})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_new_tokens = 4  # type: ignore[misc]


def test_verify_vocab() -> None:
    SamplingParams(stop_token_ids=(0, 99), top_k=99).verify(100)
    SamplingParams(top_k=-1).verify(100)
    SamplingParams(top_k=0).verify(100)  # direct construction: <= 0 is "disabled"
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(100,)).verify(100)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=100).verify(100)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams.from_dict({"top_k": "500"}).verify(100)


def test_verify_checks_ranges_of_directly_built_params() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0).verify(100)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0).verify(100)
    with pytest.raises(ValueError, match=r"\bstop\b"):
        SamplingParams(stop=["x"]).verify(100)  # type: ignore[arg-type]  # must be a tuple
    with pytest.raises(ValueError, match=r"^n must"):
        SamplingParams(n=65).verify(100)
