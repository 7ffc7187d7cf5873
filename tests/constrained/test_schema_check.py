"""`check_json_schema`: refused schemas are exactly those xgrammar would let a wrong output through.

For each refused keyword, the evidence: xgrammar (strict mode, as `GrammarCompiler` compiles a
`json` schema) accepts an output that `jsonschema` finds invalid, and the check names the keyword
and where it sits. Should a later xgrammar hold outputs to one of them, its case fails here: drop
the keyword from the check. Accepted schemas: a pydantic-style one, the benchmark's and every
schema of the property tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest
import xgrammar as xgr
from hypothesis import given, settings
from xgrammar.testing import _is_grammar_accept_string as xgrammar_accepts

from mla_backend.constrained.schema_check import (
    FORMATS,
    MAX_DEPTH,
    STANDARD_FORMATS,
    check_json_schema,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from constrained_helpers import schemas  # noqa: E402

_INT = {"type": "integer"}

# (schema, an output xgrammar accepts that breaks the schema, what the refusal must say)
REFUSED = [
    ({"type": "object", "properties": {"a": _INT, "b": _INT},
      "allOf": [{"required": ["a", "b"]}]}, '{}', "at the root: .*`allOf`"),
    ({"type": "integer", "not": {"const": 3}}, "3", "`not`"),
    ({"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 3}}, "5", "`if`"),
    ({"type": "object", "properties": {"a": _INT, "b": _INT}, "dependentRequired": {"a": ["b"]}},
     '{"a": 1}', "`dependentRequired`"),
    ({"type": "object", "properties": {"a": _INT, "b": _INT},
      "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}', "`dependentSchemas`"),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
      "properties": {"a": _INT, "b": _INT}, "dependencies": {"a": ["b"]}},
     '{"a": 1}', "`dependencies`"),
    ({"type": "object", "properties": {"l": {"type": "array", "items": _INT,
                                             "uniqueItems": True}}, "required": ["l"]},
     '{"l": [1, 1]}', "at /properties/l: .*`uniqueItems`"),
    ({"type": "array", "items": {"type": ["integer", "string"]}, "contains": {"type": "string"}},
     "[1]", "`contains`"),
    ({"type": "number", "multipleOf": 0.5}, "0.3", "`multipleOf`"),
    ({"type": "string", "format": "regex"}, '"("', "`format`.*'regex'"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aaaa"', "`maxLength`"),
    ({"type": "string", "format": "email", "maxLength": 6}, '"abcdef@gh.com"', "`maxLength`"),
    ({"$defs": {"p": {"type": "integer"}}, "$ref": "#/$defs/p", "minimum": 3}, "1",
     "`minimum`.*beside `\\$ref`"),
    ({"type": "integer", "minimum": 0, "anyOf": [{"type": "integer", "maximum": 5}]}, "-3",
     "`minimum`.*beside `anyOf`"),
    ({"type": "object", "properties": {"a": _INT}, "required": ["a"],
      "oneOf": [{"type": "object", "properties": {"a": _INT}}]}, "{}", "beside `oneOf`"),
    ({"type": "string", "enum": ["a", 1]}, "1", "the `enum` value 1 breaks"),
    ({"type": "integer", "const": 3, "minimum": 5}, "3", "the `const` value 3 breaks"),
    ({"pattern": "^a+$"}, '"b"', "`pattern`.*under a `type`"),
    ({"minimum": 7}, "5", "`minimum`.*under a `type`"),
    ({"type": "object", "required": ["a"]}, "{}", "`required`.*'a'"),
    ({"type": "array", "items": _INT, "minItems": -1}, None, "invalid JSON schema: at /minItems"),
]


@pytest.mark.parametrize("schema, wrong, message", REFUSED,
                         ids=[m.split("`")[1] if "`" in m else "metaschema"
                              for _, _, m in REFUSED])
def test_a_keyword_xgrammar_drops_is_refused(schema, wrong, message) -> None:
    if wrong is not None:  # the evidence: xgrammar lets an invalid output through
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True,
                                               strict_mode=True)
        assert xgrammar_accepts(grammar, wrong)
        draft = jsonschema.validators.validator_for(schema,
                                                    default=jsonschema.Draft202012Validator)
        assert not draft(schema, format_checker=draft.FORMAT_CHECKER).is_valid(json.loads(wrong))
    with pytest.raises(ValueError, match=message):
        check_json_schema(schema)


def test_formats_xgrammar_lacks_are_refused_unless_they_are_annotations() -> None:
    wrong = '"not an address"'
    assert xgrammar_accepts(xgr.Grammar.from_json_schema(
        json.dumps({"type": "string", "format": "idn-email"}), any_whitespace=True), wrong)
    for fmt in STANDARD_FORMATS - FORMATS:
        with pytest.raises(ValueError, match=f"`format` .*'{fmt}'"):
            check_json_schema({"type": "string", "format": fmt})
    # a format outside JSON Schema's own list constrains nothing: any string is valid
    binary = {"type": "string", "format": "binary"}
    assert jsonschema.Draft202012Validator(
        binary, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER).is_valid("!")
    check_json_schema(binary)
    for fmt in FORMATS:
        schema = {"type": "string", "format": fmt}
        check_json_schema(schema)
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True)
        assert not xgrammar_accepts(grammar, '"@ not %% valid ^^ :"'), fmt


PYDANTIC_STYLE = {
    "$defs": {
        "Color": {"enum": ["red", "green"], "title": "Color", "type": "string"},
        "Item": {"properties": {"sku": {"maxLength": 8, "title": "Sku", "type": "string"},
                                "qty": {"minimum": 1, "title": "Qty", "type": "integer"}},
                 "required": ["sku", "qty"], "title": "Item", "type": "object"},
    },
    "properties": {
        "id": {"title": "Id", "type": "integer", "multipleOf": 2},
        "color": {"$ref": "#/$defs/Color", "description": "the colour"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None,
                 "title": "Note"},
        "items": {"items": {"$ref": "#/$defs/Item"}, "minItems": 1, "title": "Items",
                  "type": "array"},
        "email": {"format": "email", "title": "Email", "type": "string"},
        "code": {"pattern": "^[A-Z]{3}$", "type": "string"},
        "kind": {"const": "order", "type": "string"},
        "size": {"enum": ["S", "M"], "description": "a size"},
    },
    "required": ["id", "color", "items"],
    "title": "Order",
    "type": "object",
}


def test_schemas_xgrammar_holds_outputs_to_are_accepted() -> None:
    check_json_schema(PYDANTIC_STYLE)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_structured import SCHEMA

    check_json_schema(SCHEMA)


@settings(max_examples=200, deadline=None)
@given(schemas)
def test_the_property_tests_schemas_are_accepted(schema) -> None:
    check_json_schema(schema)


def test_a_property_named_like_a_keyword_is_a_name() -> None:
    check_json_schema({"type": "object", "properties": {"not": _INT, "allOf": _INT},
                       "required": ["not"]})


def test_property_names_are_strings_without_a_type() -> None:
    schema = {"type": "object", "additionalProperties": _INT,
              "propertyNames": {"pattern": "^a", "maxLength": 3}}
    with pytest.raises(ValueError, match="/propertyNames: .*`maxLength`"):  # beside pattern
        check_json_schema(schema)
    del schema["propertyNames"]["maxLength"]
    check_json_schema(schema)


def test_nesting_is_bounded_before_the_checks_recurse() -> None:
    def nested(levels: int) -> dict:
        schema: dict = {"type": "integer"}
        for _ in range(levels):  # two JSON levels each: the object and its `properties`
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        return schema

    check_json_schema(nested(MAX_DEPTH // 2 - 1))
    for levels in (MAX_DEPTH // 2 + 1, 400):  # 400: deeper than jsonschema's recursion goes
        with pytest.raises(ValueError, match=f"nested more than {MAX_DEPTH} levels"):
            check_json_schema(nested(levels))
