"""Jump-forward: `forced_tokens` never changes an output; `jump_forward_tokens` (retokenized
forced string) skips more but may spell the same text with other tokens.

The decodes compare a plain greedy decode over random logits with one that appends jump-forward
tokens before each step; the logits of a position depend only on (seed, position).
"""

from __future__ import annotations

import json
import re

import jsonschema
import torch
from constrained_helpers import PERSON, _settings, decode, regexes, schemas, text_of
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_backend.constrained.grammar import forced_tokens, jump_forward_tokens
from mla_backend.constrained.spec import parse_structured_outputs



def _state(compiler, **kw):
    return compiler.new_state(compiler.compile(parse_structured_outputs(kw)))


def _walk(compiler, tokenizer, state, text: str):
    """Feed `text`'s tokens; yield (text so far, state) before each token and at the end."""
    done = ""
    for tid in tokenizer.encode(text, add_special_tokens=False):
        yield done, state
        assert state.accept_token(tid)
        done += tokenizer.decode([tid])
    yield done, state


def test_forced_string_and_tokens_at_the_fixed_keys(compiler, tokenizer) -> None:
    state = _state(compiler, json=PERSON)
    eos = tokenizer.eos_token_id
    tb = compiler.token_bytes
    seen = {}
    for done, s in _walk(compiler, tokenizer, state, '{"name": "Bob", "age": 42, "ok": true}'):
        forced_str = s.jump_forward_string()
        retok = jump_forward_tokens(s, tokenizer)
        num = s.num_tokens
        forced = forced_tokens(s, include_stop=True)
        assert s.num_tokens == num  # neither helper moves the state
        # the retokenized ids spell a prefix of the forced string
        assert forced_str.encode().startswith(b"".join(tb[t] for t in retok))
        seen[done] = (forced_str, retok, forced)
    # the fixed parts of the output, where the schema leaves no choice
    assert seen[""][0] == '{"name": "'
    assert seen['{"name": "Bob",'][0] == ' "age": '
    assert seen['{"name": "Bob", "age": 42'][0] == ', "ok": '  # 42x > 120: no third digit
    assert seen['{"name": "Bob", "age": 42, "ok": true'][0] == "}"
    # retokenized: the tokenizer's own spelling, the last token dropped where a longer token
    # could cross the end of the forced string (`: "` then free string content)
    assert [tokenizer.decode([t]) for t in seen[""][1]] == ['{"', "name", '":']
    assert seen['{"name":'][0] == ' "' and seen['{"name":'][1] == []
    # token-wise forced (exactly one token allowed): few places with a BPE vocabulary
    assert seen[""][2] == []  # `{` or `{"`
    assert [tokenizer.decode([t]) for t in seen['{"name": "Bob", "age": 42'][2]] == [","]
    assert seen['{"name": "Bob", "age": 42, "ok": true'][2] == [tokenizer.encode("}")[0], eos]
    assert seen['{"name": "Bob", "age": 42, "ok": true}'][2] == [eos]
    last = seen['{"name": "Bob", "age": 42, "ok": true}']
    assert forced_tokens(state) == [] and last[1] == []  # a stop token only with include_stop


def test_forced_tokens_respect_max_tokens(compiler, tokenizer) -> None:
    state = _state(compiler, regex="(a|b) [0-9]{3}\\}")
    for tid in tokenizer.encode("a 123", add_special_tokens=False):
        assert state.accept_token(tid)
    full = forced_tokens(state, include_stop=True)
    assert full == [tokenizer.encode("}")[0], tokenizer.eos_token_id]
    assert forced_tokens(state, max_tokens=1, include_stop=True) == full[:1]
    assert forced_tokens(state, max_tokens=0, include_stop=True) == []


@settings(_settings, max_examples=22)
@given(spec=st.one_of(schemas.map(lambda s: {"json": s}), regexes.map(lambda r: {"regex": r})),
       seed=st.integers(0, 2**20))
def test_forced_jump_forward_gives_the_same_tokens(compiler, spec, seed) -> None:
    plain, _ = decode(_state(compiler, **spec), seed, max_steps=400)
    jumped, _ = decode(_state(compiler, **spec), seed, max_steps=400, jump="forced")
    assert jumped == plain


def test_forced_jump_forward_skips_steps(compiler) -> None:
    total = skipped = 0
    for seed in range(4):
        plain, _ = decode(_state(compiler, json=PERSON), seed, max_steps=200)
        jumped, n = decode(_state(compiler, json=PERSON), seed, max_steps=200, jump="forced")
        assert jumped == plain
        total, skipped = total + len(plain), skipped + n
    assert skipped >= 8  # at least `,` after the age, `}` and EOS... per decode, about


@settings(_settings, max_examples=8)
@given(schema=schemas, seed=st.integers(0, 2**20))
def test_retokenized_jump_forward_stays_valid(compiler, tokenizer, schema, seed) -> None:
    state = _state(compiler, json=schema)
    ids, _ = decode(state, seed, max_steps=400, jump="retokenize", tokenizer=tokenizer)
    assert state.is_terminated()
    text = text_of(ids, compiler.token_bytes, compiler.stop_token_ids)
    jsonschema.validate(json.loads(text, strict=False), schema)  # strict: see the grammar tests


def test_retokenized_jump_forward_can_change_the_tokens(compiler, tokenizer) -> None:
    """Why `forced_tokens` is the exact one: with the retokenized jump the tokens (and hence
    the logits seen later) differ from a token-by-token decode, though the output is valid."""
    differ = 0
    for seed in range(4):
        plain, _ = decode(_state(compiler, json=PERSON), seed, max_steps=200)
        state = _state(compiler, json=PERSON)
        jumped, n = decode(state, seed, max_steps=200, jump="retokenize", tokenizer=tokenizer)
        assert n > 0 and state.is_terminated()
        text = text_of(jumped, compiler.token_bytes, compiler.stop_token_ids)
        jsonschema.validate(json.loads(text, strict=False), PERSON)
        differ += jumped != plain
    assert differ > 0


def test_jump_forward_on_a_regex(compiler, tokenizer) -> None:
    state = _state(compiler, regex=r"id-[0-9]{2}\.json")
    assert state.jump_forward_string() == "id-"
    ids = jump_forward_tokens(state, tokenizer)
    assert tokenizer.decode(ids) in ("id", "id-")
    for tid in tokenizer.encode("id-42", add_special_tokens=False):
        assert state.accept_token(tid)
    assert state.jump_forward_string() == ".json"
    text = tokenizer.decode(jump_forward_tokens(state, tokenizer))
    assert text == ".json" and re.fullmatch(r"id-[0-9]{2}\.json", "id-42" + text)


def test_single_allowed_rows_equal_the_row_by_row_answer() -> None:
    from mla_backend.constrained.grammar import _single_allowed, single_allowed_rows

    gen = torch.Generator().manual_seed(0)
    vocab = 100 * 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (40, vocab // 32), dtype=torch.int32,
                            generator=gen)
    bitmask[1:7] = 0  # 1: a dead end
    bitmask[2, 3] = 1 << 5  # one token in the first words
    bitmask[3, 90] = -2**31  # one token (bit 31) past them
    bitmask[4, 90] = 6  # two tokens in one word
    bitmask[5, 2], bitmask[5, 99] = 1, 1  # two words
    bitmask[6, 1], bitmask[6, 2] = 4, 4  # two words among the first
    want = [r for r in range(40) if _single_allowed(bitmask[r], vocab) is not None]
    assert want == [2, 3]
    assert single_allowed_rows(bitmask) == want
