"""Grammar-constrained decoding on xgrammar: compile a spec, track a request, mask logits.

Owns the library-facing half of structured outputs:
- `GrammarCompiler` (one per model): `StructuredOutputSpec` -> `Future[CompiledGrammar]`, compiled
  on a small thread pool, cached by (kind, text). A bad schema/regex/grammar is a `ValueError`
  from the future, naming the field; so is a JSON schema with keywords xgrammar would not hold
  the output to (`schema_check.check_json_schema`).
- `GrammarState` (one per request): the matcher; tokens in, next-token bitmask out.
- `BitmaskFiller` (one per engine): a batch's rows filled in one call, on xgrammar's threads.
- `allocate_bitmask` / `apply_bitmask`: bitmask [batch, ceil(vocab_size / 32)] int32 on CPU (bit
  j of word i set = token 32*i + j allowed); logits [batch, width] float32/bfloat16/float16 on CPU
  or CUDA, width >= vocab_size; masked entries become -inf in place.
- `forced_tokens` (exact), `single_allowed_rows` and `jump_forward_tokens` (retokenized):
  jump-forward helpers.

Stop tokens: the compiler's stop ids (the model's EOS ids) are allowed by the mask exactly when
the output so far is a complete match (`is_completed()`), and accepting one terminates the state.
The tokenizer's other special tokens (`<|im_start|>`, ...) are never allowed. Token ids in
[len(tokenizer), vocab_size) (padding of the LM head) are never allowed.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from mla_backend.host_tensors import int64_on, neg_inf_like

from .schema_check import check_json_schema
from .spec import StructuredOutputSpec

CompiledGrammar = xgr.CompiledGrammar
_HEAD_WORDS = 64  # `single_allowed_rows`' first look: this many words of each row
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and may carry a check prefix
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\]\s*\S+:\d+:\s*(Check failed: .*? is false:\s*)?")
_WHAT = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex",
         "choice": "choice", "grammar": "grammar"}


class GrammarCompiler:
    """Compiles `StructuredOutputSpec`s for one tokenizer and logits width, off the caller's thread.

    tokenizer: a transformers tokenizer. vocab_size: the model's logits width (may exceed
    len(tokenizer): ids past the tokenizer's are never allowed). stop_token_ids: the model's EOS
    ids (config / generation_config); None: the tokenizer's eos_token_id. max_threads: compile
    threads. cache_size / cache_bytes: compiled grammars kept, at most this many and this many
    bytes of them (`CompiledGrammar.memory_size_bytes`, which grows with a literal regex's
    length) (LRU; in-flight ones are never dropped; failures are not kept; a request keeps its
    grammar after eviction). json_any_whitespace: False (default) emits JSON with fixed separators
    (", " and ": ", no newlines), True lets the model put any whitespace between tokens (as
    vLLM's default; small models then tend to loop on whitespace).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *,
                 stop_token_ids: Sequence[int] | None = None, max_threads: int = 2,
                 cache_size: int = 256, cache_bytes: int = 512 << 20,
                 json_any_whitespace: bool = False) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.json_any_whitespace = json_any_whitespace
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.stop_token_ids: tuple[int, ...] = tuple(self.tokenizer_info.stop_token_ids)
        # token id -> its bytes ("" for special and padding ids); for jump-forward
        self.token_bytes: list[bytes] = list(self.tokenizer_info.decoded_vocab)
        # our cache (below) is the one cache: a bounded LRU that also dedupes in-flight compiles
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads,
                                             cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._sizes: dict[tuple[str, str], int] = {}  # compiled entries' memory_size_bytes
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def submit(self, spec: StructuredOutputSpec) -> Future[CompiledGrammar]:
        """Start compiling `spec` (or return the cached future). The future's result is the
        CompiledGrammar; its exception a ValueError ("structured_outputs.<kind>: invalid ...")."""
        key = (spec.kind, spec.text)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return fut
            self.misses += 1
            fut = self._pool.submit(self._compile, spec)
            self._cache[key] = fut
            self._evict()
        fut.add_done_callback(lambda f: self._on_done(key, f))
        return fut

    def compile(self, spec: StructuredOutputSpec, timeout: float | None = None) -> CompiledGrammar:
        """`submit(spec).result(timeout)`: blocks the caller."""
        return self.submit(spec).result(timeout)

    def new_state(self, compiled: CompiledGrammar, *,
                  stop_token_ids: Sequence[int] | None = None) -> GrammarState:
        """A fresh per-request state; stop_token_ids overrides the compiler's for this request."""
        return GrammarState(compiled, stop_token_ids=stop_token_ids, token_bytes=self.token_bytes)

    def cache_len(self) -> int:
        with self._lock:
            return len(self._cache)

    def cache_size_bytes(self) -> int:
        """Bytes of the compiled grammars the cache holds."""
        with self._lock:
            return sum(self._sizes.values())

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=not wait)

    def _compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        kind, text, c = spec.kind, spec.text, self._compiler
        if kind == "json":
            try:
                check_json_schema(json.loads(text))  # what xgrammar would not hold outputs to
            except ValueError as e:
                raise ValueError(f"structured_outputs.json: {e}") from None
        try:
            if kind == "json":
                return c.compile_json_schema(text, any_whitespace=self.json_any_whitespace)
            if kind == "json_object":
                return c.compile_json_schema(text, any_whitespace=self.json_any_whitespace,
                                             strict_mode=False)
            if kind == "regex":
                return c.compile_regex(text)
            if kind == "choice":
                return c.compile_grammar(choice_ebnf(spec.choices))
            # grammar: EBNF/GBNF (rules `name ::= ...`, root `root`), else Lark (root `start`)
            return c.compile_grammar(text) if "::=" in text else c.compile_lark(text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{kind}: invalid {_WHAT[kind]}: "
                             f"{_clean_error(e)}") from None

    def _on_done(self, key: tuple[str, str], fut: Future[CompiledGrammar]) -> None:
        failed = fut.cancelled() or fut.exception() is not None
        with self._lock:
            if self._cache.get(key) is not fut:
                return  # evicted meanwhile
            if failed:
                del self._cache[key]
                return
            self._sizes[key] = int(fut.result().memory_size_bytes)
            self._evict()

    def _evict(self) -> None:  # under self._lock: least recently used compiled entries first
        while (len(self._cache) > self._cache_size
               or sum(self._sizes.values()) > self._cache_bytes):
            done = next((k for k, f in self._cache.items() if f.done()), None)
            if done is None:
                return
            del self._cache[done]
            self._sizes.pop(done, None)


class GrammarState:
    """Per-request grammar matcher (xgrammar.GrammarMatcher), advanced by the engine thread.

    compiled: from GrammarCompiler. stop_token_ids: override the compiler's stop ids for this
    request. token_bytes: token id -> bytes (GrammarCompiler.token_bytes), for
    `jump_forward_tokens`; read from the grammar when None (slow: prefer `new_state`).
    Not thread-safe: one thread drives one state. `is_terminated` reads a flag kept here (the
    matcher is asked only after a stop token), so checking it costs no call into xgrammar.
    """

    def __init__(self, compiled: CompiledGrammar, *, stop_token_ids: Sequence[int] | None = None,
                 token_bytes: Sequence[bytes] | None = None) -> None:
        self._compiled = compiled
        self._matcher = xgr.GrammarMatcher(
            compiled, override_stop_tokens=list(stop_token_ids) if stop_token_ids else None)
        self.vocab_size: int = compiled.tokenizer_info.vocab_size
        self._token_bytes = token_bytes
        self.num_tokens = 0  # tokens accepted (and not rolled back): the most `rollback` undoes
        # only accepting one of these can terminate the matcher (it is made without
        # terminate_without_stop_token)
        self._stops = frozenset(self._matcher.stop_token_ids)
        self._terminated = False

    @property
    def stop_token_ids(self) -> list[int]:
        return self._matcher.stop_token_ids

    @property
    def token_bytes(self) -> Sequence[bytes]:
        if self._token_bytes is None:
            self._token_bytes = list(self._compiled.tokenizer_info.decoded_vocab)
        return self._token_bytes

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar does not allow it.
        A stop token is allowed only after a complete match and terminates the state."""
        ok = self._matcher.accept_token(token_id)
        if ok:
            self._accepted(token_id)
        return ok

    def _accepted(self, token_id: int) -> None:
        self.num_tokens += 1
        if token_id in self._stops:
            self._terminated = self._matcher.is_terminated()

    @staticmethod
    def accept_tokens(states: Sequence[GrammarState], token_ids: Sequence[int]) -> list[bool]:
        """`states[i].accept_token(token_ids[i])` for every i, in one call into xgrammar
        (`BatchGrammarMatcher.batch_accept_token`). Returns each accept's result."""
        if not states:
            return []
        oks = xgr.BatchGrammarMatcher.batch_accept_token([s._matcher for s in states],
                                                         list(token_ids))
        for state, tid, ok in zip(states, token_ids, oks):
            if ok:
                state._accepted(tid)
        return oks

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> bool:
        """Write the allowed next tokens into bitmask[row] (CPU int32, see allocate_bitmask).
        Returns False when every token is allowed (applying the row can be skipped).
        A row with no bit set is a dead end: the vocabulary cannot spell any continuation (e.g.
        a choice with a character whose bytes no token has); the request must end in an error.
        Raises RuntimeError after termination (nothing may follow a stop token)."""
        if self._terminated:
            raise RuntimeError("grammar state is terminated (a stop token was accepted)")
        return self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        """A stop token was accepted: the request is done."""
        return self._terminated

    def is_completed(self) -> bool:
        """The output so far is a complete match (a stop token is allowed now)."""
        return self._matcher.is_completed()

    def jump_forward_string(self) -> str:
        """The longest string every valid continuation starts with (whole UTF-8 characters
        only); "" when none. Does not change the state."""
        return self._matcher.find_jump_forward_string()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (e.g. rejected speculative tokens)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"rollback({num_tokens}): only {self.num_tokens} tokens accepted")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_tokens -= num_tokens
            self._terminated = self._terminated and self._matcher.is_terminated()

    def fork(self) -> GrammarState:
        """An independent copy of this state (same grammar)."""
        out = GrammarState.__new__(GrammarState)
        out._compiled, out._matcher = self._compiled, self._matcher.fork()
        out.vocab_size, out._token_bytes = self.vocab_size, self._token_bytes
        out.num_tokens, out._stops, out._terminated = (self.num_tokens, self._stops,
                                                        self._terminated)
        return out


class BitmaskFiller:
    """Fills the bitmask rows of many `GrammarState`s in one call (xgrammar's
    `BatchGrammarMatcher`): on `max_threads` threads from `min_rows_threaded` rows on, else on
    one. The same bits as `GrammarState.fill_bitmask` row by row. max_threads None: half this
    process's CPUs, at most 8. One caller at a time."""

    def __init__(self, max_threads: int | None = None, min_rows_threaded: int = 256) -> None:
        if max_threads is None:
            max_threads = min(8, max(1, len(os.sched_getaffinity(0)) // 2))
        self.max_threads = max_threads
        self.min_rows_threaded = min_rows_threaded
        self._one = xgr.BatchGrammarMatcher(max_threads=1)
        self._many = xgr.BatchGrammarMatcher(max_threads=max_threads) if max_threads > 1 \
            else self._one

    def fill(self, states: Sequence[GrammarState], bitmask: torch.Tensor) -> None:
        """Row j of `bitmask` (CPU int32, see `allocate_bitmask`) ← the allowed next tokens of
        states[j]. Raises RuntimeError when a state is terminated (nothing may follow a stop
        token)."""
        # (no call into xgrammar per state: on a fill thread each such call would wait for
        # the GIL that the engine thread holds)
        if any(state.is_terminated() for state in states):
            raise RuntimeError("grammar state is terminated (a stop token was accepted)")
        matchers = [state._matcher for state in states]
        batch = self._many if len(matchers) >= self.min_rows_threaded else self._one
        batch.batch_fill_next_token_bitmask(matchers, bitmask)


def build_tokenizer_info(tokenizer: Any, vocab_size: int,
                         stop_token_ids: Sequence[int] | None = None) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary: `TokenizerInfo.from_huggingface`, then rebuilt with the
    tokenizer's special tokens (other than the stop ids) blanked, which xgrammar never allows.
    Without that, e.g. `<|im_start|>` would match the text "<|im_start|>" of a regex `.*`, and
    the text a client gets (special tokens skipped) would no longer match the grammar."""
    if stop_token_ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        stop_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
    stops = sorted({int(t) for t in stop_token_ids})
    if not stops:
        raise ValueError("stop_token_ids: none given and the tokenizer has no eos_token_id")
    bad = [t for t in stops if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids: {bad} outside [0, {vocab_size})")
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=stops)
    special = set(getattr(tokenizer, "all_special_ids", ()))
    special |= {i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()
                if getattr(tok, "special", False)}
    special -= set(stops)
    encoded = [""] * vocab_size
    for token, idx in tokenizer.get_vocab().items():
        if idx < vocab_size and idx not in special:
            encoded[idx] = token
    return xgr.TokenizerInfo(encoded, info.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=stops, add_prefix_space=info.add_prefix_space)


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in dict.fromkeys(choices))


def _ebnf_literal(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isprintable() and ch != "\x7f":
            out.append(ch)
        else:  # control, separator and other non-printing characters: code-point escapes
            out.append(f"\\U{ord(ch):08X}" if ord(ch) > 0xFFFF else f"\\u{ord(ch):04X}")
    return '"' + "".join(out) + '"'


def _clean_error(e: Exception) -> str:
    lines = [_CPP_PREFIX.sub("", line).strip() for line in str(e).strip().splitlines()]
    msg = " ".join(line for line in lines if line) or type(e).__name__
    return msg if len(msg) <= 500 else msg[:497] + "..."


# ---------------------------------------------------------------------------------------------
# Bitmasks


def allocate_bitmask(batch: int, vocab_size: int, *, pin_memory: bool = False,
                     all_allowed: bool = True) -> torch.Tensor:
    """[batch, ceil(vocab_size / 32)] int32 on CPU, every bit set (all tokens allowed), or left
    uninitialized with all_allowed False (for a caller that fills every row). Rows are filled by
    GrammarState.fill_bitmask / BitmaskFiller (each writes its whole row); pin_memory for a
    fast copy to the GPU."""
    shape = xgr.get_bitmask_shape(batch, vocab_size)
    if not all_allowed:
        return torch.empty(shape, dtype=torch.int32, pin_memory=pin_memory)
    return torch.full(shape, -1, dtype=torch.int32, pin_memory=pin_memory)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: Sequence[int] | None = None, *, vocab_size: int | None = None) -> None:
    """Set the logits of disallowed tokens to -inf in place, for the given rows only.

    logits: [batch, width] float32/bfloat16/float16, CPU or CUDA. bitmask: [batch or more,
    ceil(vocab_size / 32)] int32 (copied to logits.device when elsewhere); row r of the bitmask
    masks row r of logits. rows: distinct row indices (None: all; []: nothing). vocab_size: the
    vocabulary the bitmask describes (at most 32 * bitmask words, the default); logits columns in
    [vocab_size, width) are set to -inf too (they are no token). Other rows are left untouched.
    """
    if rows is not None:
        rows = list(rows)
        if not rows:
            return
    needed = logits.shape[0] if rows is None else max(rows) + 1
    if logits.dim() != 2 or bitmask.dim() != 2 or needed > min(logits.shape[0], bitmask.shape[0]) \
            or (rows is not None and min(rows) < 0):
        raise IndexError(f"apply_bitmask: logits {tuple(logits.shape)} and bitmask "
                         f"{tuple(bitmask.shape)} do not cover rows up to {needed - 1}")
    width = logits.shape[-1]
    vocab = min(width, bitmask.shape[-1] * 32, width if vocab_size is None else vocab_size)
    # xgrammar's CUDA kernel takes the bitmask's row stride for its width: contiguous rows only
    bitmask = bitmask.to(logits.device, non_blocking=True).contiguous()
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
    if width > vocab:
        if rows is None:
            logits[:, vocab:].fill_(float("-inf"))
        else:  # (no wait for the device: `host_tensors`)
            logits[int64_on(rows, logits.device), vocab:] = neg_inf_like(logits)


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor,
                            rows: Sequence[int] | None = None, *,
                            vocab_size: int | None = None) -> None:
    """Pure-torch apply_bitmask (any device, same arguments): the oracle of the tests."""
    idx = torch.arange(logits.shape[0], device=logits.device) if rows is None else \
        torch.as_tensor(list(rows), dtype=torch.long, device=logits.device)
    if idx.numel() == 0:
        return
    allowed = unpack_bitmask(bitmask.to(logits.device)[idx], logits.shape[-1], vocab_size)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, width: int,
                   vocab_size: int | None = None) -> torch.Tensor:
    """[rows, words] int32 -> [rows, width] bool, True = allowed. Columns past vocab_size
    (default: all the mask's bits) are False."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(-2)
    vocab = min(width, bits.shape[-1], width if vocab_size is None else vocab_size)
    out = torch.zeros(*bits.shape[:-1], width, dtype=torch.bool, device=bits.device)
    out[..., :vocab] = bits[..., :vocab]
    return out


# ---------------------------------------------------------------------------------------------
# Jump-forward


def forced_tokens(state: GrammarState, *, max_tokens: int = 32, include_stop: bool = False,
                  bitmask: torch.Tensor | None = None) -> list[int]:
    """Tokens the grammar forces from `state`: the longest run of steps at which the mask allows
    exactly one token. Does not change `state` (the caller accepts the ids it appends).

    Exact: appending these ids gives the same token ids as decoding them one by one, whatever
    the logits (with finite logits only the single allowed token can come out), so jump-forward
    with them skips forward passes without changing a greedy output. A seeded sampled output
    stays the same only if the sampler's per-request generator is advanced as if each jumped
    step had been sampled (the engine's sampler draws vocab_size numbers per step). The engine's
    own restrictions still apply to these ids (allowed_token_ids; min_tokens banning a stop).
    include_stop: when the run ends at a step where only a stop token is allowed, append it
    (the request can finish without another forward pass). bitmask: a [1, words] scratch row.
    Returns [] when the next step has a choice (most steps with BPE vocabularies: a forced
    string `"name"` can be spelt `"`, `"n`, `"name`, ... so it is not forced token-wise).
    """
    if max_tokens <= 0 or state.is_terminated():
        return []
    if bitmask is None:
        bitmask = allocate_bitmask(1, state.vocab_size)
    stops = set(state.stop_token_ids)
    fork: GrammarState | None = None
    out: list[int] = []
    while len(out) < max_tokens:
        (fork or state).fill_bitmask(bitmask, 0)
        tid = _single_allowed(bitmask[0], state.vocab_size)
        if tid is None:
            break
        if tid in stops:
            if include_stop:
                out.append(tid)
            break
        fork = fork or state.fork()
        if not fork.accept_token(tid):  # the mask said it is allowed
            raise RuntimeError(f"grammar refused token {tid} its own mask allowed")
        out.append(tid)
    return out


def jump_forward_tokens(state: GrammarState, tokenizer: Any, *,
                        max_tokens: int = 32) -> list[int]:
    """Token ids spelling the grammar's forced string (`state.jump_forward_string()`) the way
    the tokenizer spells it (SGLang-style jump-forward). Does not change `state`.

    Tokenization boundaries: the forced string is tokenized on its own, so
    - its ids are kept only when their bytes spell exactly the forced string (else []), and
      only the prefix the grammar accepts token by token is kept;
    - the last id is dropped when the grammar also allows a longer token starting with the same
      bytes there (a token-by-token decode could cross the end of the forced string, e.g. `: "`
      followed by a free string);
    - the first id is not merged with the tokens already emitted (a model may have spelt the
      joint differently).
    NOT token-identical to token-by-token decoding: there the model may spell the same text
    with other tokens (`"`+`name` instead of `"name`), so outputs can change (the text still
    matches the grammar). Use `forced_tokens` where outputs must not change.
    """
    if max_tokens <= 0 or state.is_terminated():
        return []
    text = state.jump_forward_string()
    if not text:
        return []
    ids = tokenizer.encode(text, add_special_tokens=False)
    token_bytes = state.token_bytes
    if any(not 0 <= i < state.vocab_size for i in ids) or \
            b"".join(token_bytes[i] for i in ids) != text.encode("utf-8"):
        return []
    at_end = len(ids) <= max_tokens  # the last id ends the forced string
    ids = ids[:max_tokens]
    fork = state.fork()
    bitmask = allocate_bitmask(1, state.vocab_size)
    out: list[int] = []
    for i, tid in enumerate(ids):
        if at_end and i == len(ids) - 1:
            fork.fill_bitmask(bitmask, 0)
            allowed = unpack_bitmask(bitmask, state.vocab_size)[0].nonzero().flatten().tolist()
            mine = token_bytes[tid]
            if any(t != tid and len(token_bytes[t]) > len(mine) and
                   token_bytes[t].startswith(mine) for t in allowed):
                break
        if not fork.accept_token(tid):
            break
        out.append(tid)
    return out


def single_allowed_rows(bitmask: torch.Tensor) -> list[int]:
    """The rows of a [rows, words] int32 CPU mask that allow exactly one token (one non-zero
    word, with one bit set): where the grammar left no choice. Rows with two non-zero words
    among their first `_HEAD_WORDS` are ruled out first (most rows: the low ids are a BPE
    vocabulary's bytes and short tokens), so the full rows are read only for the others."""
    head = bitmask[:, :_HEAD_WORDS]
    cand = ((head != 0).sum(1) <= 1).nonzero().flatten()
    if not cand.numel():
        return []
    rows = bitmask.index_select(0, cand)
    nonzero = rows != 0
    one_word = nonzero.sum(1) == 1
    cand, rows, nonzero = cand[one_word], rows[one_word], nonzero[one_word]
    if not cand.numel():
        return []
    words = rows.masked_select(nonzero).to(torch.int64) & 0xFFFFFFFF
    return cand[(words & (words - 1)) == 0].tolist()


def _single_allowed(row: torch.Tensor, vocab_size: int) -> int | None:
    """The one token a [words] int32 mask row allows, or None when it allows 0 or several."""
    nz = row.nonzero()
    if nz.numel() != 1:
        return None
    i = int(nz[0, 0])
    word = int(row[i]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    tid = 32 * i + word.bit_length() - 1
    return tid if tid < vocab_size else None
