"""Incremental detokenization: token ids arriving a few at a time → only the new text.

Owned by the engine, one `IncrementalDetokenizer` per request (kept in `Req.detok`); it is fed the
request's sampled ids (`Req.output_ids` increments) and its output goes to the stop-string matcher
and then to `RequestOutput.new_text`.

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
call directly (the Python wrapper costs ~10x the decode itself, per token per request), and
`add_batch` decodes the windows of many requests in two `decode_batch` calls (the engine's
streaming path: one token per request per step).
"""

from __future__ import annotations

from typing import Any, Sequence

# Left context taken from the prompt for the first generated tokens (vLLM uses 5 as well).
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns ids fed one or more at a time into text deltas.

    tokenizer: a Hugging Face tokenizer (`decode(ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=...)`). skip_special_tokens: drop special tokens from the text.
    prompt_ids: the request's prompt; its last few tokens are used as left context (never
    emitted), so the first generated token keeps its leading space as it would after the prompt.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids or [])
        self.read_offset = len(self.ids)  # ids before this are emitted (or prompt)
        self.prefix_offset = max(0, self.read_offset - PROMPT_CONTEXT_TOKENS)
        self.num_prompt_ids = len(self.ids)
        self._backend = _rust_backend(tokenizer)

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
        self.ids += map(int, ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Return text still held back (an incomplete UTF-8 sequence decodes to U+FFFD) when the
        request ends; later `add` calls continue after it."""
        return self._emit(final=True)

    def _windows(self) -> tuple[list[int], list[int]]:
        """(prefix ids, prefix + new ids): the two windows whose texts `_advance` compares."""
        return self.ids[self.prefix_offset:self.read_offset], self.ids[self.prefix_offset:]

    def _advance(self, prefix_text: str, full_text: str, final: bool) -> str:
        """The new text given the two windows' texts; moves the offsets when it is complete."""
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(_REPLACEMENT) and not final:
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full_text[len(prefix_text):]

    def _emit(self, final: bool) -> str:
        if len(self.ids) == self.read_offset:
            return ""
        prefix, full = self._windows()
        return self._advance(self._decode(prefix), self._decode(full), final)

    @property
    def output_ids(self) -> list[int]:
        """The ids fed through `add` (without the prompt)."""
        return self.ids[self.num_prompt_ids:]


def add_batch(detoks: Sequence[IncrementalDetokenizer], ids: Sequence[Sequence[int]]
              ) -> list[str]:
    """`[d.add(i) for d, i in zip(detoks, ids)]` with the windows decoded in batches: the
    detokenizers that share a Rust `tokenizers.Tokenizer` and a `skip_special_tokens` setting
    take two `decode_batch` calls for all of them (one for the prefix windows, one for the full
    windows) instead of two `decode` calls each; the others decode one by one. The engine feeds
    every streaming request one token per step, so this turns 2 x batch-size decodes per step
    into two calls.

    Args:
        detoks: distinct detokenizers (a detokenizer listed twice would see its second ids
            before its first text is taken).
        ids: the new ids of each, in the same order.
    Returns:
        The new text of each ("" as `add` returns it).
    Raises:
        ValueError: the lists differ in length, or a detokenizer appears twice.
    """
    if len(detoks) != len(ids):
        raise ValueError(f"add_batch: {len(detoks)} detokenizers, {len(ids)} id lists")
    if len({id(d) for d in detoks}) != len(detoks):
        raise ValueError("add_batch: a detokenizer appears twice")
    out = [""] * len(detoks)
    groups: dict[tuple[int, bool], list[int]] = {}
    for j, (d, new) in enumerate(zip(detoks, ids)):
        d.ids += map(int, new)
        if len(d.ids) == d.read_offset:
            continue
        if d._backend is None:
            out[j] = d._emit(final=False)
            continue
        groups.setdefault((id(d._backend), d.skip_special_tokens), []).append(j)
    for (_, skip), members in groups.items():
        backend = detoks[members[0]]._backend
        windows = [detoks[j]._windows() for j in members]
        prefixes = backend.decode_batch([w[0] for w in windows], skip_special_tokens=skip)
        fulls = backend.decode_batch([w[1] for w in windows], skip_special_tokens=skip)
        for j, p, f in zip(members, prefixes, fulls):
            out[j] = detoks[j]._advance(p, f, final=False)
    return out


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
