"""Request-field parsing of structured outputs, logit_bias and allowed_token_ids (no xgrammar)."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_backend.constrained.spec import (
    ALIASES,
    IGNORED,
    JSON_OBJECT_SCHEMA,
    KINDS,
    StructuredOutputSpec,
    parse_allowed_token_ids,
    parse_logit_bias,
    parse_structured_outputs,
    structured_outputs_from_sampling_parameters,
)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))


@pytest.mark.parametrize("value, kind, text", [
    ({"json": SCHEMA}, "json", SCHEMA_TEXT),
    ({"json": json.dumps(SCHEMA, indent=2)}, "json", SCHEMA_TEXT),
    ({"guided_json": SCHEMA}, "json", SCHEMA_TEXT),
    ({"guided_json": json.dumps(SCHEMA)}, "json", SCHEMA_TEXT),
    ({"regex": "[a-z]+@x\\.com"}, "regex", "[a-z]+@x\\.com"),
    ({"guided_regex": "\\d{3}"}, "regex", "\\d{3}"),
    ({"choice": ["yes", "no"]}, "choice", '["yes", "no"]'),
    ({"guided_choice": ["é", ""]}, "choice", '["é", ""]'),
    ({"grammar": 'root ::= "a" | "b"'}, "grammar", 'root ::= "a" | "b"'),
    ({"guided_grammar": 'start: "a"'}, "grammar", 'start: "a"'),
    ({"json_object": True}, "json_object", JSON_OBJECT_SCHEMA),
])
def test_every_key_and_alias(value, kind, text) -> None:
    spec = parse_structured_outputs(value)
    assert spec == StructuredOutputSpec(kind, text)
    # the same as a JSON string, and under the alias field name
    assert parse_structured_outputs(json.dumps(value)) == spec
    assert structured_outputs_from_sampling_parameters({"guided_decoding": value}) == spec
    assert structured_outputs_from_sampling_parameters({"structured_outputs": value,
                                                        "guided_decoding": None}) == spec


def test_none_fields_and_ignored_keys() -> None:
    assert parse_structured_outputs(None) is None
    assert structured_outputs_from_sampling_parameters({"temperature": 0}) is None
    # clients that serialize the whole vLLM dataclass send every field, unused ones as null
    full = {k: None for k in (*KINDS, *ALIASES, "whitespace_pattern", "structural_tag")}
    full.update(regex="ab", json_object=False, backend="xgrammar", disable_fallback=True,
                disable_any_whitespace=True, disable_additional_properties=False,
                backend_was_auto=False)
    assert parse_structured_outputs(full) == StructuredOutputSpec("regex", "ab")
    assert set(IGNORED) <= set(full)


def test_spec_is_a_picklable_cache_key() -> None:
    a = parse_structured_outputs({"json": SCHEMA})
    b = parse_structured_outputs({"guided_json": json.dumps(SCHEMA, indent=4)})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.kind = "regex"  # type: ignore[misc]
    # property order is meaning (xgrammar emits properties in schema order): not sorted away
    swapped = {**SCHEMA, "properties": dict(reversed(SCHEMA["properties"].items()))}
    assert parse_structured_outputs({"json": swapped}) != a
    assert parse_structured_outputs({"choice": ["b", "a"]}).choices == ["b", "a"]


@pytest.mark.parametrize("value, match", [
    ({"json": SCHEMA, "regex": "a"},
     (r"structured_outputs: give exactly one of json, regex, choice, grammar, json_object "
      r"\(got json and regex\)")),
    ({"json": SCHEMA, "guided_json": SCHEMA}, r"\(got json and guided_json\)"),
    ({"choice": ["a"], "json_object": True}, r"\(got choice and json_object\)"),
    ({}, r"give exactly one of .* \(got none\)"),
    ({"regex": None, "json_object": False}, r"\(got none\)"),
    ({"regexp": "a"}, r"structured_outputs: unknown key 'regexp'"),
    ({"regex": 3}, r"structured_outputs\.regex: expected a string, got an integer"),
    ({"regex": ""}, r"structured_outputs\.regex: must be a non-empty string"),
    ({"guided_regex": ["a"]}, r"structured_outputs\.guided_regex: expected a string, got a list"),
    ({"grammar": ""}, r"structured_outputs\.grammar: must be a non-empty"),
    ({"choice": []}, r"structured_outputs\.choice: must be a non-empty list"),
    ({"choice": "yes"}, r"structured_outputs\.choice: expected a list of strings, got a string"),
    ({"guided_choice": ["a", 1]}, r"structured_outputs\.guided_choice\[1\]: expected a string"),
    ({"json": "{not json"}, r"structured_outputs\.json: invalid JSON"),
    ({"json": [1, 2]}, r"structured_outputs\.json: expected a JSON schema object, got a list"),
    ({"json": "true"}, r"structured_outputs\.json: expected a JSON schema object, got a boolean"),
    ({"json": {"maximum": float("nan")}}, r"structured_outputs\.json: not serializable"),
    ({"json_object": "yes"}, r"structured_outputs\.json_object: expected true or false"),
    ({"regex": "\ud800"}, r"structured_outputs\.regex: not valid Unicode"),
    ({"whitespace_pattern": "[ ]?"}, r"structured_outputs\.whitespace_pattern: not supported"),
    ({"structural_tag": "{}"}, r"structured_outputs\.structural_tag: not supported"),
    ({"regex": "a", "disable_fallback": "yes"},
     r"structured_outputs\.disable_fallback: expected bool, got a string"),
    ({"regex": "a", "backend": 1}, r"structured_outputs\.backend: expected str"),
    ('{"regex": "a"', r"structured_outputs: invalid JSON"),
    ('["regex"]', r"structured_outputs: expected a JSON object, got a list"),
    (7, r"structured_outputs: expected a JSON object, got an integer"),
])
def test_errors_name_the_field(value, match) -> None:
    with pytest.raises(ValueError, match=match):
        parse_structured_outputs(value)


def test_error_uses_the_field_name_the_client_used() -> None:
    with pytest.raises(ValueError, match=r"^guided_decoding\.choice: must be a non-empty"):
        structured_outputs_from_sampling_parameters({"guided_decoding": {"choice": []}})
    with pytest.raises(ValueError, match="structured_outputs or guided_decoding, not both"):
        structured_outputs_from_sampling_parameters(
            {"guided_decoding": {"regex": "a"}, "structured_outputs": {"regex": "a"}})


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c,
                                                                         max_size=3),
                     max_leaves=8)


@settings(max_examples=50, deadline=None)
@given(schema=st.dictionaries(st.text(max_size=6), _json, max_size=4),
       choices=st.lists(st.text(max_size=8), min_size=1, max_size=4))
def test_json_string_and_object_forms_agree(schema, choices) -> None:
    for kind, val in (("json", schema), ("choice", choices)):
        spec = parse_structured_outputs({kind: val})
        assert spec == parse_structured_outputs(json.dumps({kind: val}))
        if kind == "json":
            assert spec == parse_structured_outputs({kind: json.dumps(val, indent=1)})
            assert json.loads(spec.text) == val
        else:
            assert spec.choices == val


def test_logit_bias() -> None:
    assert parse_logit_bias(None, 10) == {}
    assert parse_logit_bias({}, 10) == {}
    assert parse_logit_bias({"3": 1.5, 4: -100, "0": 0}, 10) == {3: 1.5, 4: -100.0, 0: 0.0}
    assert parse_logit_bias('{"9": 2}', 10) == {9: 2.0}


@pytest.mark.parametrize("value, match", [
    ({"10": 1.0}, r"logit_bias\['10'\]: token id 10 is outside \[0, 10\)"),
    ({-1: 1.0}, r"logit_bias\[-1\]: token id -1 is outside"),
    ({"-1": 1.0}, r"logit_bias: key '-1' is not a token id"),
    ({"a": 1.0}, r"logit_bias: key 'a' is not a token id"),
    ({" 3": 1.0}, r"logit_bias: key ' 3' is not a token id"),
    ({True: 1.0}, r"logit_bias: key True is not a token id"),
    ({"3": "1"}, r"logit_bias\['3'\]: expected a number, got a string"),
    ({"3": True}, r"logit_bias\['3'\]: expected a number, got a boolean"),
    ({"3": float("inf")}, r"logit_bias\['3'\]: must be finite"),
    ({"3": float("nan")}, r"logit_bias\['3'\]: must be finite"),
    ([1, 2], r"logit_bias: expected a map of token id to bias, got a list"),
    ("{bad", r"logit_bias: invalid JSON"),
])
def test_logit_bias_errors(value, match) -> None:
    with pytest.raises(ValueError, match=match):
        parse_logit_bias(value, 10)


def test_allowed_token_ids() -> None:
    assert parse_allowed_token_ids(None, 10) is None
    assert parse_allowed_token_ids([5, 1, 5, 0], 10) == (0, 1, 5)
    assert parse_allowed_token_ids("[9]", 10) == (9,)


@pytest.mark.parametrize("value, match", [
    ([], r"allowed_token_ids: must not be empty"),
    ([1, 10], r"allowed_token_ids\[1\]: token id 10 is outside \[0, 10\)"),
    ([-1], r"allowed_token_ids\[0\]: token id -1 is outside"),
    ([1, True], r"allowed_token_ids\[1\]: expected an integer token id, got a boolean"),
    ([1.0], r"allowed_token_ids\[0\]: expected an integer token id, got a number"),
    ({"1": 1}, r"allowed_token_ids: expected a list of token ids, got an object"),
    (3, r"allowed_token_ids: expected a list of token ids, got an integer"),
])
def test_allowed_token_ids_errors(value, match) -> None:
    with pytest.raises(ValueError, match=match):
        parse_allowed_token_ids(value, 10)
