"""`OutputProcessor` (text, stop strings and logprob text of the engine's token outputs) with the
real SmolLM2 tokenizer: the texts of a request's outputs concatenate to one decode of its ids
however the engine chunks them; a stop string cuts the output after the token that completed it
(counts and cumulative logprob with it) and asks for an abort; min_tokens holds it off; a
non-streaming request gets one output; errors pass, unknown ids are dropped."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mla_backend.request import FinishReason, InvalidRequestError, RequestOutput, SamplingParams
from mla_backend.tokenizer.output_processor import OutputProcessor, engine_streams

from test_detokenizer import IM_END, _chunk_sizes, _settings, _texts, encode


def _outputs(rid: str, ids: list[int], sizes: list[int], reason: FinishReason | None,
             logprob: float = -0.5) -> list[RequestOutput]:
    """The engine's outputs of one request: `ids` in chunks, counts and logprobs as it fills
    them, the last one final with `reason`."""
    outs, pos = [], 0
    for size in itertools.cycle(sizes):
        if pos >= len(ids):
            break
        chunk = ids[pos:pos + size]
        pos += len(chunk)
        last = pos >= len(ids)
        outs.append(RequestOutput(rid, chunk, "", last, reason if last else None, 3, pos, 0,
                                  None, [logprob] * len(chunk), logprob * pos))
    return outs


@_settings
@given(text=_texts, sizes=_chunk_sizes, cut=st.integers(min_value=0, max_value=3),
       stop=st.booleans())
def test_texts_concatenate_to_one_decode(smollm2_tokenizer, text, sizes, cut, stop) -> None:
    """Ids in chunks, the last output final: the texts concatenate to one decode of the ids
    after the prompt context, the final output releases what an incomplete character held back
    (a request cut mid-character ends in U+FFFD), a STOP output's last id (the stop token) adds
    no text, and the request's state is gone afterwards."""
    tok = smollm2_tokenizer
    prompt = encode(tok, "Say:")
    ids = encode(tok, text)
    ids = ids[:max(1, len(ids) - cut)]  # may cut a character's bytes
    if stop:
        ids = ids + [IM_END]
    outs = _outputs("r", ids, sizes, FinishReason.STOP if stop else FinishReason.LENGTH)
    op = OutputProcessor(tok)
    op.add("r", prompt, SamplingParams(skip_special_tokens=False), stream=True)
    got = []
    for o in outs:  # one output per step, as the engine sends them
        emitted, stopped = op.process([o])
        assert emitted == [o] and stopped == []
        got += emitted
    assert len(op) == 0
    body = ids[:-1] if stop else ids
    want = tok.decode(prompt + body, skip_special_tokens=False,
                      clean_up_tokenization_spaces=False)[len(tok.decode(prompt)):]
    assert "".join(o.new_text for o in got) == want


@_settings
@given(text=_texts, sizes=_chunk_sizes, at=st.integers(min_value=0, max_value=40),
       length=st.integers(min_value=1, max_value=4), include=st.booleans(),
       stream=st.booleans())
def test_a_stop_string_cuts_after_the_token_that_completes_it(smollm2_tokenizer, text, sizes,
                                                              at, length, include,
                                                              stream) -> None:
    """The stop string is a piece of the decoded text: the request ends with STOP after the
    first token whose text completes it, its text ends before it (or with it, with
    include_stop_str_in_output), the tokens after the cut are dropped with their logprobs, and
    its id is returned for the engine to abort; streamed or gathered, the same text."""
    tok = smollm2_tokenizer
    prompt = encode(tok, "Say:")
    ids = encode(tok, text + " and more words after it")
    head = tok.decode(prompt, clean_up_tokenization_spaces=False)
    full = tok.decode(prompt + ids, clean_up_tokenization_spaces=False)[len(head):]
    stop_str = full[min(at, len(full) - 1):][:length]
    if stop_str.strip("\ufffd") != stop_str or not stop_str:
        return
    texts = [tok.decode(prompt + ids[:k], clean_up_tokenization_spaces=False)[len(head):]
             for k in range(len(ids) + 1)]
    # The first token after which the text, as the detokenizer shows it (nothing while a
    # character is incomplete), holds the stop string.
    k = next(k for k in range(1, len(ids) + 1)
             if not texts[k].endswith("\ufffd") and stop_str in texts[k])
    sp = SamplingParams(stop=(stop_str,), include_stop_str_in_output=include)
    assert engine_streams(sp, stream)
    op = OutputProcessor(tok)
    op.add("r", prompt, sp, stream)
    emitted, stopped = [], []
    for o in _outputs("r", ids, sizes, FinishReason.LENGTH):
        e, s = op.process([o])
        emitted += e
        stopped += s
    assert stopped == ["r"] and len(op) == 0
    assert [o.finished for o in emitted] == [False] * (len(emitted) - 1) + [True]
    assert not stream or len(emitted) >= 1
    assert stream or len(emitted) == 1
    final = emitted[-1]
    assert final.finish_reason == FinishReason.STOP and final.num_output_tokens == k
    assert [t for o in emitted for t in o.new_token_ids] == ids[:k]
    assert final.cumulative_logprob == pytest.approx(-0.5 * k)
    text_out = "".join(o.new_text for o in emitted)
    start = texts[k].find(stop_str)
    assert text_out == texts[k][:start + (len(stop_str) if include else 0)]


def test_min_tokens_holds_a_stop_string_off(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = encode(tok, "a b a b a b")
    op = OutputProcessor(tok)
    op.add("r", [], SamplingParams(stop=(" b",), min_new_tokens=3), stream=True)
    emitted, stopped = op.process(_outputs("r", ids, [1], FinishReason.LENGTH))
    assert stopped == ["r"]
    assert "".join(o.new_text for o in emitted) == "a b a"  # the first " b" came too early
    assert emitted[-1].num_output_tokens == 4


def test_errors_pass_and_unknown_ids_are_dropped(smollm2_tokenizer) -> None:
    op = OutputProcessor(smollm2_tokenizer)
    op.add("r", [5], SamplingParams(), stream=False)
    with pytest.raises(InvalidRequestError, match="already in use"):
        op.add("r", [5], SamplingParams(), stream=True)
    first = RequestOutput("r", [10], "", False, None, 1, 1, 0, None, [-1.0], -1.0)
    error = RequestOutput("r", [], "", True, error="boom")
    stray = RequestOutput("x", [7], "", True)
    emitted, stopped = op.process([first, stray, error])
    assert stopped == [] and len(op) == 0
    assert len(emitted) == 1 and emitted[0].error == "boom" and emitted[0].finished
    assert emitted[0].new_token_ids == [10]  # the gathered non-streaming output, with the error
    assert op.process([RequestOutput("r", [3], "", True)]) == ([], [])  # after its end
    assert op.token_text(IM_END) == "<|im_end|>"
