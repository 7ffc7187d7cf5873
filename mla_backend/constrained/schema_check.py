"""Refuses a JSON schema whose constraints xgrammar would not hold an output to.

Owns `check_json_schema(schema)`. `GrammarCompiler` calls it on its compile threads before xgrammar
compiles a `structured_outputs.json` schema (strict mode: no properties beyond `properties`). In:
the parsed schema. Out: None, or `ValueError` saying which keyword, and where (a JSON pointer).

Two checks, so that every output of an accepted schema validates against it:
1. The schema is valid under its draft's metaschema (the `jsonschema` library; draft 2020-12
   unless `$schema` names another). xgrammar reads e.g. `"minItems": -1` as no bound.
2. Each schema position holds only what xgrammar 0.2.9 enforces. tests/constrained/
   test_schema_check.py shows, per refused keyword, an output xgrammar accepts that breaks it:
   - never enforced: `allOf`, `not`, `if` / `then` / `else`, `dependentRequired`,
     `dependentSchemas`, `dependencies`, `uniqueItems: true`, `contains` (and `minContains`,
     `maxContains`);
   - enforced only in some forms: `multipleOf` only for `"type": "integer"`; of JSON Schema's
     own formats, only FORMATS (other formats are annotations); `pattern` / `format` not
     together with `minLength` / `maxLength`; string and number keywords only under a `type`;
     `required` only for names under `properties`;
   - the siblings of `$ref`, `anyOf` and `oneOf` are dropped: only ANNOTATIONS may sit beside them;
   - the siblings of `enum` / `const` are dropped: accepted when every listed value satisfies them.
   `oneOf` is read as `anyOf`, as vLLM's xgrammar backend does: an output may match two branches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError

# the string formats xgrammar 0.2.9 turns into grammar rules (others it lets through as any string)
FORMATS = frozenset({
    "date", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "json-pointer",
    "relative-json-pointer", "time", "uri", "uri-reference", "uri-template", "uuid"})
# JSON Schema 2020-12's own formats (its validation spec, section 7.3); others (pydantic's
# "binary", OpenAPI's "int32", ...) are annotations that every string satisfies
STANDARD_FORMATS = FORMATS | {"idn-email", "idn-hostname", "iri", "iri-reference", "regex"}
# keywords that constrain nothing (allowed beside $ref, anyOf, oneOf, enum and const)
ANNOTATIONS = frozenset({
    "$anchor", "$comment", "$defs", "$id", "$schema", "contentEncoding", "contentMediaType",
    "default", "definitions", "deprecated", "description", "discriminator", "examples", "readOnly",
    "title", "writeOnly"})
# keyword -> why the output could not be held to it
_NEVER = {
    "allOf": "merge the subschemas into one",
    "not": "there is no negation in its grammars",
    "if": "there are no conditionals in its grammars",
    "then": "there are no conditionals in its grammars",
    "else": "there are no conditionals in its grammars",
    "dependentRequired": "list the properties in `required`",
    "dependentSchemas": "there are no conditionals in its grammars",
    "dependencies": "list the properties in `required`",
    "contains": "use `items` or `prefixItems`",
    "minContains": "use `items` or `prefixItems`",
    "maxContains": "use `items` or `prefixItems`",
}
_NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_STRING = ("minLength", "maxLength", "pattern", "format")
# schema-valued keywords: one subschema, a list of them, a map of name -> subschema
_ONE = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
        "propertyNames", "additionalItems")
_LIST = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")
# deepest nesting of JSON objects and arrays checked (the checks recurse, about five Python frames
# a level in jsonschema)
MAX_DEPTH = 128


def check_json_schema(schema: Any) -> None:
    """Raise `ValueError` unless every output xgrammar allows for `schema` is valid under it
    (module docstring). The message starts "invalid JSON schema: at <pointer>: " (check 1) or
    "unsupported JSON schema: at <pointer>: " (check 2)."""
    if not isinstance(schema, Mapping):
        raise ValueError(f"invalid JSON schema: expected an object, got {type(schema).__name__}")
    if _depth(schema) > MAX_DEPTH:
        raise ValueError(f"unsupported JSON schema: nested more than {MAX_DEPTH} levels deep")
    validator = jsonschema.validators.validator_for(schema,
                                                    default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except SchemaError as e:
        raise ValueError(f"invalid JSON schema: at {_pointer(e.absolute_path)}: {e.message}"
                         ) from None
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    _walk(schema, (), validator, defs)


def _walk(node: Any, path: tuple, validator: Any, defs: dict, names: bool = False) -> None:
    """Check `node` and the schemas inside it; names: `node` is a `propertyNames` schema (its
    instances are strings without a `type` saying so)."""
    if not isinstance(node, Mapping):
        return  # true / false
    _check_node(node, path, validator, defs, names)
    for key in _ONE:
        if isinstance(node.get(key), Mapping):
            _walk(node[key], (*path, key), validator, defs, key == "propertyNames")
    for key in _LIST:
        for i, sub in enumerate(node.get(key) or ()):
            _walk(sub, (*path, key, i), validator, defs)
    for key in _MAP:
        for name, sub in (node.get(key) or {}).items():
            _walk(sub, (*path, key, name), validator, defs)


def _check_node(node: Mapping, path: tuple, validator: Any, defs: dict, names: bool) -> None:
    def refuse(keyword: str, why: str) -> None:
        raise ValueError(f"unsupported JSON schema: at {_pointer(path)}: xgrammar would not hold "
                         f"the output to `{keyword}` ({why})")

    for key, why in _NEVER.items():
        if key in node:
            refuse(key, why)
    if node.get("uniqueItems") is True:
        refuse("uniqueItems", "its grammars cannot compare items")
    constraining = sorted(k for k in node if k not in ANNOTATIONS)
    for key in ("$ref", "anyOf", "oneOf"):
        if key in node:
            others = [k for k in constraining if k != key]
            if others:
                into = "the referenced schema" if key == "$ref" else "each branch"
                refuse(others[0], f"it is dropped beside `{key}`; move it into {into}")
    for key in ("enum", "const"):
        if key in node:
            rest = {k: v for k, v in node.items() if k not in ("enum", "const")}
            if any(k not in ANNOTATIONS for k in rest):
                values = node["enum"] if key == "enum" else [node["const"]]
                check = validator({**defs, **rest})
                for value in values:
                    if not check.is_valid(value):
                        raise ValueError(
                            f"unsupported JSON schema: at {_pointer(path)}: the `{key}` value "
                            f"{value!r} breaks the keywords beside it, which xgrammar drops")
            return
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types or ())
    if names and not types:
        types = {"string"}
    if not types:
        for key in (*_NUMERIC, *_STRING):
            if key in node:
                refuse(key, "it applies only under a `type`; add one")
    if "multipleOf" in node and "number" in types:
        refuse("multipleOf", 'only `"type": "integer"` is held to it')
    if "format" in node and "string" in types and node["format"] in STANDARD_FORMATS - FORMATS:
        refuse("format", f"{node['format']!r} is not one of {', '.join(sorted(FORMATS))}")
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        refuse("minLength" if "minLength" in node else "maxLength",
               "a length bound is dropped beside `pattern` or `format`; put it in the pattern")
    missing = [n for n in node.get("required") or () if n not in (node.get("properties") or {})]
    if missing:
        refuse("required", f"{missing[0]!r} has no entry in `properties`")


def _depth(value: Any) -> int:
    """Levels of JSON objects and arrays in `value` (0 for a scalar), without recursing."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, level = todo.pop()
        children = (node.values() if isinstance(node, Mapping)
                    else node if isinstance(node, (list, tuple)) else None)
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            break
        todo.extend((child, level + 1) for child in children)
    return deepest


def _pointer(path: Any) -> str:
    parts = [str(p).replace("~", "~0").replace("/", "~1") for p in path]
    return "/" + "/".join(parts) if parts else "the root"


__all__ = ["ANNOTATIONS", "FORMATS", "MAX_DEPTH", "STANDARD_FORMATS", "check_json_schema"]
