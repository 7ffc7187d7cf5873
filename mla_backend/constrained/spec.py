"""Request fields of structured outputs, parsed and validated at the edge (no xgrammar, no torch).

Owns the vLLM-backend-compatible parsing of `sampling_parameters["structured_outputs"]` (alias
`"guided_decoding"`), `"logit_bias"` and `"allowed_token_ids"`. In: what a client sent (a dict or
a JSON string). Out: a frozen, picklable `StructuredOutputSpec(kind, text)` whose `(kind, text)` is
the grammar cache key of `constrained.grammar.GrammarCompiler`, a `dict[int, float]` of logit
biases, a `tuple[int, ...]` of allowed token ids. Every malformed input raises `ValueError` with a
message naming the field; nothing else is raised for client input.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# the constraint kinds (StructuredOutputSpec.kind)
KINDS = ("json", "regex", "choice", "grammar", "json_object")
# the older `guided_*` names of the same constraints
ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
# accepted and ignored (harmless here): value type each must have when not None
IGNORED = {"backend": str, "backend_was_auto": bool, "disable_fallback": bool,
           "disable_any_whitespace": bool, "disable_additional_properties": bool}
# vLLM keys refused unless None: they would change the output and cannot be honoured
REFUSED = {"whitespace_pattern": "JSON whitespace is fixed by the server (compact by default)",
           "structural_tag": "structural tags are not supported"}
# the two names a client may use in sampling_parameters
FIELD_NAMES = ("structured_outputs", "guided_decoding")
# the JSON object `json_object: true` compiles to (any object, as vLLM's xgrammar backend)
JSON_OBJECT_SCHEMA = '{"type":"object"}'
_DIGITS = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class StructuredOutputSpec:
    """One output constraint of a request. Filled by `parse_structured_outputs`.

    kind: one of KINDS. text: canonical, deterministic text — `json`: the schema as compact JSON
    (key order kept: xgrammar emits object properties in the schema's order); `regex` and
    `grammar`: the string as given; `choice`: the choices as a JSON list; `json_object`:
    JSON_OBJECT_SCHEMA. `(kind, text)` is hashable and picklable (a cache key).
    """

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured_outputs: unknown kind {self.kind!r} (one of {KINDS})")
        _check_utf8(self.text, self.kind)

    @property
    def choices(self) -> list[str]:
        """The choices of a `choice` spec (ValueError for other kinds)."""
        if self.kind != "choice":
            raise ValueError(f"structured_outputs: a {self.kind} spec has no choices")
        return json.loads(self.text)


def parse_structured_outputs(value: Any,
                             field: str = "structured_outputs") -> StructuredOutputSpec | None:
    """Parse `sampling_parameters["structured_outputs"]` (or `["guided_decoding"]`, same format).

    value: None (no constraint), a dict or a JSON string of one. Keys (vLLM's
    StructuredOutputsParams / GuidedDecodingParams):
      json         a JSON schema: an object, or a JSON string of one
      regex        a non-empty regex string (xgrammar's dialect: no lookaround, no backrefs)
      choice       a non-empty list of strings; the output is exactly one of them
      grammar      a non-empty EBNF/GBNF grammar with a `root` rule (or Lark with a `start` rule)
      json_object  true: any JSON object; false is the same as absent
      guided_json, guided_regex, guided_choice, guided_grammar: the older names of the above.
    A key whose value is None counts as absent (clients often send every field). Exactly one
    constraint must remain. Accepted and ignored: `backend` (str; xgrammar is the one backend),
    `backend_was_auto`, `disable_fallback` (there is no fallback), `disable_any_whitespace` (JSON
    whitespace is the server's policy, compact by default), `disable_additional_properties`
    (schemas already refuse properties they do not list). Refused unless None: `whitespace_pattern`,
    `structural_tag`. Any other key is refused.

    Returns: the spec; None only for value None (an empty or all-None dict is an error).
    Raises: ValueError naming the field (and key) for every problem.
    """
    if value is None:
        return None
    if isinstance(value, (str, bytes)):
        value = _loads(value, field)
    if not isinstance(value, Mapping):
        raise ValueError(f"{field}: expected a JSON object, got {_type_name(value)}")
    given: list[tuple[str, str, Any]] = []  # (key as sent, kind, value)
    for key, val in value.items():
        if not isinstance(key, str):
            raise ValueError(f"{field}: keys must be strings, got {key!r}")
        if key in IGNORED:
            if val is not None and not isinstance(val, IGNORED[key]):
                raise ValueError(f"{field}.{key}: expected {IGNORED[key].__name__}, "
                                 f"got {_type_name(val)}")
            continue
        if key in REFUSED:
            if val is not None:
                raise ValueError(f"{field}.{key}: not supported ({REFUSED[key]})")
            continue
        kind = ALIASES.get(key, key)
        if kind not in KINDS:
            raise ValueError(f"{field}: unknown key {key!r} (expected one of "
                             f"{', '.join(KINDS)}; or {', '.join(ALIASES)})")
        if val is None or (kind == "json_object" and val is False):
            continue
        given.append((key, kind, val))
    if len(given) != 1:
        got = " and ".join(k for k, _, _ in given) if given else "none"
        raise ValueError(f"{field}: give exactly one of {', '.join(KINDS)} (got {got})")
    ((key, kind, val),) = given
    where = f"{field}.{key}"
    return StructuredOutputSpec(kind, _canonical(kind, val, where))


def structured_outputs_from_sampling_parameters(
        params: Mapping[str, Any]) -> StructuredOutputSpec | None:
    """The spec of a request's sampling parameters: `structured_outputs` or its alias
    `guided_decoding` (ValueError when both are given and not None)."""
    present = [name for name in FIELD_NAMES if params.get(name) is not None]
    if len(present) > 1:
        raise ValueError("sampling_parameters: give structured_outputs or guided_decoding, "
                         "not both")
    return parse_structured_outputs(params[present[0]], present[0]) if present else None


def parse_logit_bias(value: Any, vocab_size: int, field: str = "logit_bias") -> dict[int, float]:
    """Parse `logit_bias`: a map (dict or JSON string) token id -> bias added to that logit.

    Keys: int, or a string of decimal digits; ids in [0, vocab_size). Values: finite int/float
    (not bool). None or {} -> {}. Returns {token_id: bias}. Raises ValueError naming the field.
    """
    if value is None:
        return {}
    if isinstance(value, (str, bytes)):
        value = _loads(value, field)
    if not isinstance(value, Mapping):
        raise ValueError(f"{field}: expected a map of token id to bias, got {_type_name(value)}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, str) and _DIGITS.fullmatch(key):
            tid = int(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            tid = key
        else:
            raise ValueError(f"{field}: key {key!r} is not a token id (an integer)")
        _check_id(tid, vocab_size, f"{field}[{key!r}]")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise ValueError(f"{field}[{key!r}]: expected a number, got {_type_name(bias)}")
        if not math.isfinite(bias):
            raise ValueError(f"{field}[{key!r}]: must be finite, got {bias}")
        out[tid] = float(bias)
    return out


def parse_allowed_token_ids(value: Any, vocab_size: int,
                            field: str = "allowed_token_ids") -> tuple[int, ...] | None:
    """Parse `allowed_token_ids`: a non-empty list (or JSON string of one) of token ids in
    [0, vocab_size). None -> None (no restriction). Returns the sorted distinct ids.
    Raises ValueError naming the field."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)):
        value = _loads(value, field)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{field}: expected a list of token ids, got {_type_name(value)}")
    if not value:
        raise ValueError(f"{field}: must not be empty")
    for i, tid in enumerate(value):
        if isinstance(tid, bool) or not isinstance(tid, int):
            raise ValueError(f"{field}[{i}]: expected an integer token id, got {_type_name(tid)}")
        _check_id(tid, vocab_size, f"{field}[{i}]")
    return tuple(sorted(set(value)))


def _canonical(kind: str, val: Any, where: str) -> str:
    if kind == "json":
        if isinstance(val, (str, bytes)):
            val = _loads(val, where)
        if not isinstance(val, Mapping):
            raise ValueError(f"{where}: expected a JSON schema object, got {_type_name(val)}")
        try:
            return json.dumps(val, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: not serializable as JSON ({e})") from None
    if kind == "json_object":
        if val is not True:
            raise ValueError(f"{where}: expected true or false, got {val!r}")
        return JSON_OBJECT_SCHEMA
    if kind == "choice":
        if not isinstance(val, (list, tuple)):
            raise ValueError(f"{where}: expected a list of strings, got {_type_name(val)}")
        if not val:
            raise ValueError(f"{where}: must be a non-empty list of strings")
        for i, c in enumerate(val):
            if not isinstance(c, str):
                raise ValueError(f"{where}[{i}]: expected a string, got {_type_name(c)}")
            _check_utf8(c, f"{where}[{i}]")
        return json.dumps(list(val), ensure_ascii=False)
    # regex, grammar
    if not isinstance(val, str):
        raise ValueError(f"{where}: expected a string, got {_type_name(val)}")
    if not val:
        raise ValueError(f"{where}: must be a non-empty string")
    _check_utf8(val, where)
    return val


def _loads(text: str | bytes, where: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: invalid JSON ({e})") from None


def _check_id(tid: int, vocab_size: int, where: str) -> None:
    if not 0 <= tid < vocab_size:
        raise ValueError(f"{where}: token id {tid} is outside [0, {vocab_size})")


def _check_utf8(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where}: not valid Unicode (a lone surrogate)") from None


def _type_name(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(v),
                                                                        type(v).__name__)
