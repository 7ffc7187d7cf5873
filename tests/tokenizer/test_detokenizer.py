"""IncrementalDetokenizer with the real SmolLM2 tokenizer (byte-level BPE): split UTF-8
characters are held back, leading spaces kept, special tokens skipped, and the concatenated
deltas equal one `tokenizer.decode` of all ids however the ids are chunked."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mla_backend.tokenizer.detokenizer import IncrementalDetokenizer

IM_START, IM_END = 1, 2  # SmolLM2 special tokens
REPLACEMENT = "\ufffd"

# Printable text, rich in multi-byte characters and spaces.
_texts = st.lists(
    st.one_of(
        # No surrogates, controls, unassigned or private-use code points (they do not round-trip).
        # U+FFFD itself is tested separately: it is held back like an incomplete character.
        st.characters(blacklist_categories=("Cs", "Cc", "Cn", "Co"),
                      blacklist_characters="\ufffd"),
        st.sampled_from(["😀", "🇺🇸", "👩\u200d💻", "世", "界", "é", " ", "  ", "\n", "a", "e\u0301"]),
    ),
    min_size=1,
    max_size=30,
).map("".join)
_chunk_sizes = st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=8)
_settings = settings(max_examples=60, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


def feed(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int] | None = None,
         ) -> list[str]:
    """Feed ids in chunks of the given sizes (cycled; one at a time when None)."""
    deltas, pos = [], 0
    for size in itertools.cycle(sizes or [1]):
        if pos >= len(ids):
            break
        deltas.append(detok.add(ids[pos:pos + size]))
        pos += size
    return deltas


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_emoji_split_over_tokens_is_held_until_complete(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = encode(tok, "Hi 😀 世界!")
    assert len(ids) > 5  # the emoji and the CJK characters take several byte tokens each
    detok = IncrementalDetokenizer(tok)
    deltas = feed(detok, ids)
    assert "".join(deltas) == "Hi 😀 世界!"
    assert all(REPLACEMENT not in d for d in deltas)
    assert "" in deltas  # some tokens completed no character
    assert " 😀" in deltas  # the emoji comes out whole with its leading space


def test_leading_spaces_kept_after_prompt(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    prompt = encode(tok, "Hello")
    gen = encode(tok, " world,   spaced  out")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    deltas = feed(detok, gen)
    assert deltas[0] == " world"
    assert "".join(deltas) == " world,   spaced  out"
    assert detok.output_ids == gen


def test_special_tokens_skipped_or_kept(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = [IM_START] + encode(tok, "assistant\nOK") + [IM_END]
    skipping = IncrementalDetokenizer(tok, skip_special_tokens=True)
    deltas = feed(skipping, ids)
    assert deltas[0] == "" and deltas[-1] == ""
    assert "".join(deltas) == "assistant\nOK"
    keeping = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(feed(keeping, ids)) == "<|im_start|>assistant\nOK<|im_end|>"


def test_nothing_new_gives_empty_string(smollm2_tokenizer) -> None:
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    assert detok.add([]) == ""
    assert detok.flush() == ""


def test_incomplete_character_at_the_end_comes_out_on_flush(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = encode(tok, "ok 😀")
    detok = IncrementalDetokenizer(tok)
    text = "".join(feed(detok, ids[:-1]))  # the emoji's last byte is missing
    assert REPLACEMENT not in text
    rest = detok.flush()
    assert rest.endswith(REPLACEMENT)
    assert text + rest == tok.decode(ids[:-1])


def test_literal_replacement_character_held_until_next_text_or_flush(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids_a, ids_b = encode(tok, "x\ufffd"), encode(tok, " y")
    detok = IncrementalDetokenizer(tok)
    assert "".join(feed(detok, ids_a)) == "x"  # cannot tell it from an incomplete character yet
    assert "".join(feed(detok, ids_b)) == "\ufffd y"
    detok = IncrementalDetokenizer(tok)
    assert "".join(feed(detok, ids_a)) + detok.flush() == "x\ufffd"


@_settings
@given(text=_texts, sizes=_chunk_sizes)
def test_deltas_concatenate_to_decode(smollm2_tokenizer, text: str, sizes: list[int]) -> None:
    tok = smollm2_tokenizer
    ids = encode(tok, text)
    expected = tok.decode(ids)
    assume(expected == text)  # printable text that the tokenizer round-trips
    one_by_one = feed(IncrementalDetokenizer(tok), ids)
    chunked = feed(IncrementalDetokenizer(tok), ids, sizes)
    assert "".join(one_by_one) == expected
    assert "".join(chunked) == expected
    assert all(REPLACEMENT not in d for d in one_by_one + chunked)


@_settings
@given(prompt=_texts, text=_texts, sizes=_chunk_sizes)
def test_deltas_after_prompt_equal_decode_suffix(smollm2_tokenizer, prompt: str, text: str,
                                                 sizes: list[int]) -> None:
    tok = smollm2_tokenizer
    p_ids, g_ids = encode(tok, prompt), encode(tok, text)
    detok = IncrementalDetokenizer(tok, prompt_ids=p_ids)
    got = "".join(feed(detok, g_ids, sizes))
    whole, head = tok.decode(p_ids + g_ids), tok.decode(p_ids)
    assert whole.startswith(head)
    assert got == whole[len(head):]


@_settings
@given(
    ids=st.lists(st.one_of(st.integers(0, 16), st.integers(17, 49151)), min_size=1, max_size=30),
    sizes=_chunk_sizes,
    skip=st.booleans(),
)
def test_arbitrary_ids_plus_flush_equal_decode(smollm2_tokenizer, ids: list[int],
                                               sizes: list[int], skip: bool) -> None:
    # Random ids may form invalid UTF-8 and contain special tokens; nothing may be lost.
    tok = smollm2_tokenizer
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    got = "".join(feed(detok, ids, sizes)) + detok.flush()
    assert got == tok.decode(ids, skip_special_tokens=skip)


def test_library_stream_is_used_with_a_tokenizers_backed_tokenizer(smollm2_tokenizer) -> None:
    assert IncrementalDetokenizer(smollm2_tokenizer)._stream is not None
    assert IncrementalDetokenizer(smollm2_tokenizer, use_stream=False)._stream is None


@_settings
@given(
    prompt=st.lists(st.integers(0, 49151), max_size=12),
    ids=st.lists(st.one_of(st.integers(0, 16), st.integers(17, 49151)), min_size=1, max_size=30),
    sizes=_chunk_sizes,
    skip=st.booleans(),
    one_at_a_time=st.booleans(),
)
def test_library_stream_gives_the_python_windows_deltas(smollm2_tokenizer, prompt: list[int],
                                                        ids: list[int], sizes: list[int],
                                                        skip: bool, one_at_a_time: bool) -> None:
    # Delta for delta (not only concatenated), then the flush, and adds after the flush.
    tok = smollm2_tokenizer
    lib = IncrementalDetokenizer(tok, skip, prompt_ids=prompt)
    py = IncrementalDetokenizer(tok, skip, prompt_ids=prompt, use_stream=False)
    if one_at_a_time:
        got = [lib.add_token(i) for i in ids]
        want = [py.add([i]) for i in ids]
    else:
        got, want = feed(lib, ids, sizes), feed(py, ids, sizes)
    assert got == want
    assert (lib.prefix_offset, lib.read_offset) == (py.prefix_offset, py.read_offset)
    assert lib.flush() == py.flush()
    assert feed(lib, ids[:5]) == feed(py, ids[:5])


class _FailingStream:
    """Stands in for a `DecodeStream` that refuses a window (the library raises when a window's
    text does not start with the previous one's): every step raises."""

    def step(self, tokenizer, ids):
        raise RuntimeError("invalid prefix")


def test_library_failure_falls_back_to_python_windows(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    prompt, gen = encode(tok, "Hello"), encode(tok, " world 😀 and 世界 again")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    first = [detok.add_token(i) for i in gen[:4]]
    detok._stream = _FailingStream()
    rest = [detok.add_token(i) for i in gen[4:7]] + feed(detok, gen[7:], [2])
    assert detok._stream is None
    assert "".join(first + rest) + detok.flush() == " world 😀 and 世界 again"
