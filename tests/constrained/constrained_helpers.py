"""Decode loops over random logits for the constrained tests, and small schema/regex strategies.

`logits_at(seed, pos, vocab)`: the logits of position `pos` depend only on (seed, pos), so a decode
that skips positions (jump-forward) sees the same logits at the positions it does compute.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from mla_backend.constrained.grammar import (
    GrammarState,
    allocate_bitmask,
    apply_bitmask,
    forced_tokens,
    jump_forward_tokens,
)


_settings = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                           HealthCheck.too_slow])
# a schema with fixed keys (jump-forward has forced tokens between its values)
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"]}


def logits_at(seed: int, pos: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 100_003 + pos)
    return torch.randn(1, vocab, generator=gen)  # [1, vocab] fp32, cpu


def greedy_step(state: GrammarState, logits: torch.Tensor, bitmask: torch.Tensor) -> int:
    state.fill_bitmask(bitmask, 0)
    apply_bitmask(logits, bitmask)
    return int(logits[0].argmax())


def decode(state: GrammarState, seed: int, max_steps: int, *, jump: str | None = None,
           tokenizer=None) -> tuple[list[int], int]:
    """Greedy constrained decode over random logits until the state terminates or max_steps
    tokens. jump: None, "forced" (forced_tokens) or "retokenize" (jump_forward_tokens) before
    each step. Returns (token ids incl. the final stop token, number of jumped tokens)."""
    bitmask = allocate_bitmask(1, state.vocab_size)
    out: list[int] = []
    jumped = 0
    while len(out) < max_steps and not state.is_terminated():
        if jump is not None:
            left = max_steps - len(out)
            ids = (forced_tokens(state, max_tokens=left, include_stop=True) if jump == "forced"
                   else jump_forward_tokens(state, tokenizer, max_tokens=left))
            for tid in ids:
                assert state.accept_token(tid)
            out += ids
            jumped += len(ids)
            if state.is_terminated() or len(out) >= max_steps:
                break
        tid = greedy_step(state, logits_at(seed, len(out), state.vocab_size), bitmask)
        assert state.accept_token(tid), tid
        out.append(tid)
    return out, jumped


def text_of(ids: list[int], token_bytes, stops) -> str:
    # surrogatepass: xgrammar 0.2.9 lets negated character classes match UTF-8-encoded
    # surrogates (ED A0..BF xx), which are not valid UTF-8 (see test_constrained_grammar.py)
    data = b"".join(token_bytes[i] for i in ids if i not in stops)
    return data.decode("utf-8", "surrogatepass")


# --- small bounded schemas (every output of them is short, so random decodes terminate)

_names = st.sampled_from(["a", "b", "id", "name", "x_y", "ok", "tags"])
_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.tuples(st.integers(-50, 50), st.integers(0, 300)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.sampled_from(["red", "green", "a b", 'q"t', "é"]), min_size=1, max_size=3,
             unique=True).map(lambda v: {"enum": v}),
    st.sampled_from(["x", "hello", 7]).map(lambda v: {"const": v}),
)


def _containers(children):
    objects = st.lists(st.tuples(_names, children), min_size=1, max_size=3,
                       unique_by=lambda t: t[0]).flatmap(
        lambda props: st.lists(st.sampled_from([k for k, _ in props]), unique=True).map(
            lambda req: {"type": "object", "properties": dict(props), "required": req}))
    arrays = st.tuples(children, st.integers(0, 2), st.integers(0, 1)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": min(t[1], t[2]),
                   "maxItems": t[1]})
    return st.one_of(objects, arrays)


schemas = st.recursive(_leaf, _containers, max_leaves=5).filter(
    lambda s: s.get("type") in ("object", "array"))

# --- the other keywords `schema_check` lets through (bounded, so random decodes terminate)

_rich_leaf = st.one_of(
    _leaf,
    st.sampled_from(["^[a-c]{1,4}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no)$"]).map(
        lambda p: {"type": "string", "pattern": p}),
    st.sampled_from(["date", "uuid", "ipv4", "time"]).map(
        lambda f: {"type": "string", "format": f}),
    st.tuples(st.integers(2, 7), st.integers(0, 40)).map(
        lambda t: {"type": "integer", "multipleOf": t[0], "minimum": -t[1], "maximum": t[1]}),
    st.just({"type": "string", "enum": ["S", "M", "L"], "description": "a size"}),
    st.just({"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}],
             "default": None, "title": "maybe"}),
    st.just({"type": ["boolean", "null"]}),
)


def _rich_containers(children):
    tuples = st.lists(children, min_size=1, max_size=2).map(
        lambda items: {"type": "array", "prefixItems": items, "items": False,
                       "minItems": len(items)})
    maps = st.tuples(children, st.integers(0, 2)).map(
        lambda t: {"type": "object", "additionalProperties": t[0], "maxProperties": t[1],
                   "propertyNames": {"pattern": "^[a-d]$"}})
    return st.one_of(_containers(children), tuples, maps)


def _with_defs(schema: dict) -> dict:
    """The schema's first property, if any, moved to $defs and referenced from its place."""
    props = schema.get("properties")
    if not props:
        return schema
    name = next(iter(props))
    return {**schema, "$defs": {"D": props[name]},
            "properties": {**props, name: {"$ref": "#/$defs/D", "description": "moved"}}}


rich_schemas = st.recursive(_rich_leaf, _rich_containers, max_leaves=5).filter(
    lambda s: s.get("type") in ("object", "array")).flatmap(
    lambda s: st.sampled_from([s, _with_defs(s)]))


# --- regexes in the common dialect of xgrammar and Python's re, with bounded repetition (not
# `\s`: xgrammar's follows ECMAScript and includes U+FEFF, Python's does not)

_atom = st.one_of(
    st.sampled_from(list("abxyz019 -_")),
    st.sampled_from([r"\d", "[a-c]", "[A-Z0-9]", r"\.", "[^a]", "[ \t]", "[éü]"]),
)


def _regex_ext(children):
    return st.one_of(
        st.lists(children, min_size=2, max_size=3).map("".join),
        st.tuples(children, children).map(lambda t: f"({t[0]}|{t[1]})"),
        st.tuples(children, st.sampled_from(["?", "{2}", "{0,2}", "{1,3}"])).map(
            lambda t: f"({t[0]}){t[1]}"),
    )


regexes = st.recursive(_atom, _regex_ext, max_leaves=6)
