"""Incremental detokenization: token ids arriving a few at a time → only the new text.

Owned by the `output_processor.OutputProcessor`, one `IncrementalDetokenizer` per request; it is
fed the token ids of the request's outputs and its text goes to the stop-string matcher and then
to `RequestOutput.new_text`.

Technique (prefix offset / read offset, as in TGI and vLLM): the text of a token depends on its
neighbours (SentencePiece drops the leading space of the first token it decodes; byte-level BPE
splits one UTF-8 character over several tokens). So each step decodes a short window:
`prefix` = ids[prefix_offset:read_offset] (already emitted, kept as left context) and
`prefix + new ids`; the new text is the difference. When the window's text ends in U+FFFD (an
incomplete UTF-8 sequence), nothing is emitted and the offsets stay, so the bytes are decoded
again together with the next token. The windows are decoded with `clean_up_tokenization_spaces`
off, so concatenated deltas equal `tokenizer.decode(all_ids, skip_special_tokens=...,
clean_up_tokenization_spaces=False)`. For transformers' tokenizers-backed classes that do not
override `_decode`, that call is exactly the Rust `tokenizers.Tokenizer.decode`, which the windows
call directly (the Python wrapper costs ~10x the decode itself, per token per request). With such a
tokenizer, `add` / `add_token` run the same window algorithm inside the tokenizers library
(`tokenizers.decoders.DecodeStream`, one call per add instead of two decodes and the slicing;
its share of the host's work shows in `benchmarks/bench_host_step.py`'s "output processor"
column) and mirror its offsets, so `flush` and a fallback to the Python windows (the library
raises when a window's text does not extend the previous one) continue from the same place.
"""

from __future__ import annotations

from typing import Any, Sequence

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21: the Python windows only
    DecodeStream = None

# Left context taken from the prompt for the first generated tokens (vLLM uses 5 as well).
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns ids fed one or more at a time into text deltas.

    tokenizer: a Hugging Face tokenizer (`decode(ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=...)`). skip_special_tokens: drop special tokens from the text.
    prompt_ids: the request's prompt; its last few tokens are used as left context (never
    emitted), so the first generated token keeps its leading space as it would after the prompt.
    use_stream: run the windows in the tokenizers library when the tokenizer allows it (False:
    in Python only; the deltas are the same).
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] | None = None, use_stream: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids or [])
        self.read_offset = len(self.ids)  # ids before this are emitted (or prompt)
        self.prefix_offset = max(0, self.read_offset - PROMPT_CONTEXT_TOKENS)
        self.num_prompt_ids = len(self.ids)
        self._backend = _rust_backend(tokenizer)
        # The library's stream starts from the same window: the left context, nothing emitted.
        # (Not when that context ends inside a UTF-8 character: the library then takes its text
        # as empty where the Python windows take U+FFFD.)
        self._stream = None
        if use_stream and self._backend is not None and DecodeStream is not None:
            context = self.ids[self.prefix_offset:]
            if not self._decode(context).endswith(_REPLACEMENT):
                self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            list(ids),
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def add(self, ids: Sequence[int]) -> str:
        """Append token ids; return the text they complete ("" while a UTF-8 character is still
        incomplete or the ids decode to nothing, e.g. skipped special tokens)."""
        ids = [int(i) for i in ids]
        if not ids:
            return ""
        self.ids += ids
        return self._step(ids)

    def add_token(self, token_id: int) -> str:
        """`add([token_id])` for one int id, without the list (the engine's per-token call)."""
        self.ids.append(token_id)
        return self._step(token_id)

    def _step(self, new: int | list[int]) -> str:
        """The text completed by `new`, already appended to `ids`: through the library's
        stream while it is in use (its offsets mirrored), else the Python windows."""
        stream = self._stream
        if stream is None:
            return self._emit(final=False)
        try:
            text = stream.step(self._backend, new)
        except Exception:  # noqa: BLE001 - the library refused a window: Python from here
            self._stream = None
            return self._emit(final=False)
        if text is None:
            return ""
        self.prefix_offset = self.read_offset  # the library's window moves the same way
        self.read_offset = len(self.ids)
        return text

    def flush(self) -> str:
        """Return text still held back (an incomplete UTF-8 sequence decodes to U+FFFD) when the
        request ends; later `add` calls continue after it (with the Python windows)."""
        self._stream = None  # its window now lags ours
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if len(self.ids) == self.read_offset:
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(_REPLACEMENT) and not final:
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full_text[len(prefix_text):]

    @property
    def output_ids(self) -> list[int]:
        """The ids fed through `add` (without the prompt)."""
        return self.ids[self.num_prompt_ids:]


_BACKENDS: dict[int, Any] = {}


def _rust_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind `tokenizer` when its decode (clean-up off) is exactly that
    Tokenizer's decode; else None (the tokenizer's own `decode` is used)."""
    key = id(tokenizer)
    if key in _BACKENDS and _BACKENDS[key][0] is tokenizer:
        return _BACKENDS[key][1]
    backend = None
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep the generic path
        TokenizersBackend = None
    if (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend)
            and type(tokenizer)._decode is TokenizersBackend._decode):
        backend = getattr(tokenizer, "_tokenizer", None)
    _BACKENDS[key] = (tokenizer, backend)
    return backend
