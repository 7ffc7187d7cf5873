"""Plain CPU data that crosses component boundaries: `SamplingParams`, `Req`, `FinishReason`,
`GenerateRequest` (adapter/tests → engine) and `RequestOutput` (engine → adapter/tests); the
request errors (`InvalidRequestError`, `EngineFailedError`) and `validate_request`, the one check
of a request at whichever edge it enters.

`SamplingParams.from_dict` is the one place request-level sampling input is parsed and validated
(JSON from the `sampling_parameters` tensor or Triton request parameters, values possibly strings).
"""

from __future__ import annotations

import enum
import math
import weakref
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Mapping

import torch

from mla_backend.constrained.spec import (
    StructuredOutputSpec,
    parse_allowed_token_ids,
    parse_logit_bias,
    parse_structured_outputs,
)

# Most top logprobs a request may ask for (vLLM's default `max_logprobs`).
MAX_LOGPROBS = 20
# Most completions one request may ask for (`n`).
MAX_N = 64
# Seeds must fit a torch.Generator seed (64 bits, signed or unsigned).
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the context length reached
    ABORT = "abort"  # cancelled by the client or aborted by the engine


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping settings (vLLM names; `max_tokens` → max_new_tokens).

    temperature == 0 means greedy. top_k <= 0 / -1 means disabled. Filled by: `from_dict`.
    """

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # number of top logprobs per new token; None = not asked
    n: int = 1  # completions of the prompt (`sequences`), at most MAX_N
    # Output constraint (JSON schema, regex, choice, grammar): `constrained.spec`.
    structured_outputs: StructuredOutputSpec | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    allowed_token_ids: tuple[int, ...] | None = None  # sorted; None = every token
    # Set by the adapter (not a request field): the client reads the tokens' logprobs
    # (return_logprobs / return_cumulative_logprob). Jump-forward, which appends tokens without
    # computing their logprobs, is then off for the request.
    logprobs_returned: bool = False

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """Parse request sampling fields (vLLM / Triton vLLM-backend names) into `SamplingParams`.

        Accepted keys: `max_tokens` (alias `max_new_tokens`; default 16, >= 1), `min_tokens` (alias
        `min_new_tokens`; 0 <= min_tokens <= max_tokens), `temperature` (>= 0; 0 = greedy),
        `top_p` (0 < p <= 1), `top_k` (-1 = disabled, else >= 1), `min_p` ([0, 1]),
        `repetition_penalty` (> 0), `presence_penalty` / `frequency_penalty` ([-2, 2]), `seed`
        (64-bit int), `stop` (a non-empty str or a list of them), `stop_token_ids` (list of ints
        >= 0, or one int), `ignore_eos`, `include_stop_str_in_output`, `skip_special_tokens`
        (bools), `logprobs` (int in [0, 20]), `n` (in [1, 64]), `structured_outputs` (alias
        `guided_decoding`: `constrained.spec.parse_structured_outputs`; not with min_tokens),
        `logit_bias` ({token id: bias}), `allowed_token_ids` (non-empty list of token ids).

        Values may be strings, as Triton request parameters and genai-perf send them: "100" → 100,
        "0.5" → 0.5, "true"/"false" (any case, also "1"/"0", "yes"/"no") → bool. A JSON null keeps
        the default. Integral floats (100.0) are accepted for int fields; bools are not numbers.

        Raises ValueError naming the field: unknown key, a value that does not parse as the
        field's type, a value out of range, or both a name and its alias given.
        """
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(
                f"sampling parameters must be a JSON object, got {type(d).__name__}"
            )
        kwargs: dict[str, Any] = {}
        given_as: dict[str, str] = {}  # field → the key the caller used (for messages)
        for key, value in d.items():
            if key == "lora_name":  # the vLLM backend's message, which clients match on
                raise ValueError("LoRA feature is not enabled.")
            if not isinstance(key, str) or key not in _PARSERS:
                raise ValueError(
                    f"unknown sampling parameter {key!r}; accepted: {', '.join(sorted(_PARSERS))}"
                )
            target, parse = _PARSERS[key]
            if value is None:
                continue
            if target in given_as:
                raise ValueError(
                    f"sampling parameter {key!r} given together with {given_as[target]!r}"
                )
            given_as[target] = key
            kwargs[target] = parse(key, value)
        params = cls(**kwargs)
        names = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", **given_as}
        params._check_ranges(names=names, strict_top_k=True)
        return params

    def sequences(self, rid: str) -> list[tuple[str, SamplingParams]]:
        """The `n` completions of a request with id `rid`: (engine request id, its params).
        n == 1: [(rid, self)]. n > 1: ids "<rid>/<i>", each with n 1 and, when `seed` is set,
        seed + i (as vLLM seeds its child requests), so completion i is reproducible."""
        if self.n == 1:
            return [(rid, self)]
        def seed(i: int) -> int | None:
            if self.seed is None:
                return None
            s = self.seed + i
            return s if s <= _SEED_MAX else s - 2**64  # (still a valid 64-bit seed)

        return [(f"{rid}/{i}", replace(self, n=1, seed=seed(i))) for i in range(self.n)]

    def verify(self, vocab_size: int) -> None:
        """Check the ranges (as `from_dict`) and the vocab-dependent fields.

        `stop_token_ids` must lie in [0, vocab_size); `top_k` (when enabled, i.e. > 0) must be
        < vocab_size. A directly constructed instance may use any `top_k` <= 0 for "disabled".
        Raises ValueError naming the field.
        """
        self._check_ranges(names={}, strict_top_k=False)
        for tid in self.stop_token_ids:
            if not 0 <= tid < vocab_size:
                raise ValueError(
                    f"stop_token_ids: token id {tid} is outside the vocabulary [0, {vocab_size})"
                )
        for tid, _ in self.logit_bias:
            if not 0 <= tid < vocab_size:
                raise ValueError(
                    f"logit_bias: token id {tid} is outside the vocabulary [0, {vocab_size})")
        for tid in self.allowed_token_ids or ():
            if not 0 <= tid < vocab_size:
                raise ValueError(f"allowed_token_ids: token id {tid} is outside the vocabulary "
                                 f"[0, {vocab_size})")
        if self.top_k > 0 and self.top_k >= vocab_size:
            raise ValueError(
                f"top_k must be < the vocabulary size {vocab_size} (or -1 to disable), "
                f"got {self.top_k}"
            )

    def _check_ranges(self, names: Mapping[str, str], strict_top_k: bool) -> None:
        """Raise ValueError (naming the field as the user spelled it) for any value out of range.

        strict_top_k: only -1 disables top_k (user input); else any value <= 0 disables it.
        """

        def name(f: str) -> str:
            return names.get(f, f)

        def need(ok: bool, f: str, what: str) -> None:
            if not ok:
                raise ValueError(f"{name(f)} must be {what}, got {getattr(self, f)!r}")

        for f in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool), f, "an integer")
        for f in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty"):
            v = getattr(self, f)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            need(ok, f, "a finite number")
        need(self.max_new_tokens >= 1, "max_new_tokens", ">= 1")
        need(self.min_new_tokens >= 0, "min_new_tokens", ">= 0")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"{name('min_new_tokens')} ({self.min_new_tokens}) must be <= "
                f"{name('max_new_tokens')} ({self.max_new_tokens})"
            )
        need(self.temperature >= 0, "temperature", ">= 0")
        need(0 < self.top_p <= 1, "top_p", "in (0, 1]")
        if strict_top_k:
            need(self.top_k == -1 or self.top_k >= 1, "top_k", "-1 (disabled) or >= 1")
        need(0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        need(self.repetition_penalty > 0, "repetition_penalty", "> 0")
        need(-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]")
        need(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]")
        if self.seed is not None:
            ok = isinstance(self.seed, int) and not isinstance(self.seed, bool)
            need(ok and _SEED_MIN <= self.seed <= _SEED_MAX, "seed", "a 64-bit integer")
        need(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
             "stop", "a tuple of non-empty strings")
        need(isinstance(self.stop_token_ids, tuple)
             and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                     for t in self.stop_token_ids),
             "stop_token_ids", "a tuple of token ids >= 0")
        for f in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            need(isinstance(getattr(self, f), bool), f, "a bool")
        if self.logprobs is not None:
            ok = isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
            need(ok and 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
                 f"an integer in [0, {MAX_LOGPROBS}]")
        need(1 <= self.n <= MAX_N, "n", f"an integer in [1, {MAX_N}]")
        if self.structured_outputs is not None and self.min_new_tokens > 0:
            raise ValueError(f"{name('min_new_tokens')} cannot be combined with "
                             "structured_outputs (the grammar decides where the output ends)")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")


class InvalidRequestError(ValueError):
    """The client's request is malformed or can never be served; the message names the field."""


class EngineFailedError(RuntimeError):
    """The engine stopped for good (a tensor-parallel worker or the engine process died); the
    message says why. The model must be reloaded."""


@dataclass
class GenerateRequest:
    """A request as handed to `Engine.add_request`. Filled by: the adapter or tests.

    Exactly one of `text` / `input_ids` is set.
    """

    rid: str
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False


# tokenizer -> its longest token in characters (`max_token_chars`)
_MAX_TOKEN_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# A prompt of c characters has at least c / (max_token_chars * this) tokens: the margin covers
# normalizers that drop characters before tokenizing.
_CHARS_MARGIN = 4


def max_token_chars(tokenizer) -> int:
    """The longest string among `tokenizer`'s vocabulary entries (added tokens included), in
    characters: a token covers at most this many characters of a text (byte-level vocabularies
    spell a byte per character). Computed once per tokenizer."""
    n = _MAX_TOKEN_CHARS.get(tokenizer)
    if n is None:
        n = max(1, max((len(t) for t in tokenizer.get_vocab()), default=1))
        _MAX_TOKEN_CHARS[tokenizer] = n
    return n


def validate_request(request: GenerateRequest, tokenizer, vocab_size: int, context_len: int,
                     max_total_tokens: int) -> list[int]:
    """Check a request against a model's limits and return its prompt token ids.

    The one check of a request, at whichever edge it enters: `Engine.add_request` (in-process
    callers) or `client.EngineClient.add_request` (servers), whose engine then trusts it.

    Args:
        request: exactly one of `text` (tokenized with `tokenizer`) / `input_ids`.
        tokenizer: a transformers tokenizer (callable; `.input_ids` of its result).
        vocab_size: token ids must lie in [0, vocab_size).
        context_len: prompt + max_tokens limit (tokens).
        max_total_tokens: the KV pool's size (tokens); a request larger than it can never run.
    Returns:
        The prompt's token ids (list of int, non-empty).
    Raises:
        InvalidRequestError: empty prompt, both/neither of text and input_ids, ids outside the
            vocab (given, or from a tokenizer larger than the model's), bad sampling values,
            prompt + max_tokens beyond the context or the pool.
    """
    if (request.text is None) == (request.input_ids is None):
        raise InvalidRequestError("give exactly one of text_input and input_ids")
    if request.text is not None:
        if not isinstance(request.text, str) or request.text == "":
            raise InvalidRequestError("text_input must be a non-empty string")
        # A prompt far beyond the context is refused before tokenizing it (that would hold
        # the caller, the stub's request thread, for seconds per megabyte).
        least = len(request.text) // (max_token_chars(tokenizer) * _CHARS_MARGIN)
        if least > context_len:
            raise InvalidRequestError(
                f"prompt ({len(request.text)} characters, at least {least} tokens) exceeds the "
                f"context length of {context_len} tokens")
        ids = list(tokenizer(request.text).input_ids)
        if not ids:
            raise InvalidRequestError("text_input tokenizes to no tokens")
        top = max(ids)  # (an id past the embedding would fail the batch; on CUDA, the engine)
        if top >= vocab_size:
            raise InvalidRequestError(
                f"text_input: the tokenizer gives token id {top}, outside the model's vocabulary "
                f"[0, {vocab_size}) (its tokenizer has more tokens than its embedding has rows)")
    else:
        ids = list(request.input_ids or [])
        if not ids:
            raise InvalidRequestError("input_ids must not be empty")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)
               or t < 0 or t >= vocab_size]
        if bad:
            raise InvalidRequestError(
                f"input_ids: token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    sp = request.sampling_params
    try:
        sp.verify(vocab_size)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    prompt = f"prompt ({len(ids)} token{'s' * (len(ids) != 1)})"
    if len(ids) + sp.max_new_tokens > context_len:
        raise InvalidRequestError(
            f"{prompt} + max_tokens ({sp.max_new_tokens}) exceeds the context length of "
            f"{context_len} tokens")
    if len(ids) + sp.max_new_tokens > max_total_tokens:
        raise InvalidRequestError(
            f"{prompt} + max_tokens ({sp.max_new_tokens}) can never fit the KV pool of "
            f"{max_total_tokens} tokens")
    return ids


@dataclass
class RequestOutput:
    """One increment of a request's output. Filled by: `Engine.step` (token ids and counts;
    `new_text` "") and then `tokenizer.output_processor.OutputProcessor` (`new_text`; a stop
    string's cut).

    Streaming consumers concatenate `new_text`; `text` is not repeated in every increment.
    `Engine._emit` passes the fields positionally: keep their order in step with it.
    """

    rid: str
    new_token_ids: list[int]  # tokens produced since the previous output of this request
    new_text: str  # detokenized text since the previous output (never half a UTF-8 char)
    finished: bool
    finish_reason: FinishReason | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0  # total generated so far
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Per new token: {token_id: logprob} of the top `logprobs` candidates plus the chosen one.
    new_logprobs: list[dict[int, float]] | None = None
    new_token_logprobs: list[float] | None = None  # logprob of each chosen new token
    cumulative_logprob: float = 0.0
    error: str | None = None  # set when the engine failed this request (finished is True)
    # When the engine had the request's first token and this output's last token on the host
    # (time.monotonic() s, one clock for every process of a machine; None before the first).
    first_token_time: float | None = None
    last_token_time: float | None = None
    # The error is the client's (a bad grammar): INVALID_ARGUMENT rather than INTERNAL.
    invalid_request: bool = False
    # Which of the request's `n` completions this is (set by the engine's front door).
    index: int = 0


@dataclass
class Req:
    """Scheduler-side state of one request. Owned by the scheduler; the engine appends to
    `output_ids` and sets `finished_reason`; the sampler fills `generator`.
    """

    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    output_ids: list[int] = field(default_factory=list)  # appended by the engine after sampling

    # --- memory (filled by the scheduler / prefix cache) ---
    req_pool_idx: int | None = None  # row in ReqToTokenPool while running
    prefix_indices: torch.Tensor | None = None  # [n] int64 cpu: slot ids of the cached prefix
    last_node: Any = None  # RadixCache node locked by this request
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    fill_ids: list[int] = field(default_factory=list)  # tokens whose KV should exist after the
    # current extend (origin_input_ids + output_ids, truncated for a chunk)
    extend_input_len: int = 0  # new tokens in the current extend
    is_chunked: int = 0  # > 0 while the request is the in-flight chunked prefill

    # --- results ---
    finished_reason: FinishReason | None = None
    cumulative_logprob: float = 0.0
    # Sampler state: a private generator when `sampling_params.seed` is set (filled lazily).
    generator: torch.Generator | None = None
    # 1 while a token sampled for this request is still on the GPU (overlap schedule: its batch
    # was launched, its tokens not yet appended); the next decode batch reads it from there.
    num_inflight_tokens: int = 0
    # time.monotonic() s when the engine had its first / latest sampled token on the host
    first_token_time: float | None = None
    last_token_time: float | None = None
    # structured outputs: the grammar state (`constrained.grammar.GrammarState`), set by the
    # engine once the request's grammar is compiled; it accepts every committed token
    grammar: Any = None
    # jump-forward (engine): the grammar's forced tokens may be appended without decode steps
    # (`Engine._jump_eligible`); `forced_streak`: how many of its last sampled tokens in a row
    # were the only one their mask allowed (from 2 on, a forced run is looked for);
    # `jump_pending`: a run was found while a token of it was still in flight, so the next
    # decode batch leaves it out and the jump waits for that token
    jump_forward: bool = False
    forced_streak: int = 0
    jump_pending: bool = False

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None


# --- value parsers for SamplingParams.from_dict: (field name in the message, raw value) → value ---

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _type_error(key: str, value: Any, what: str) -> ValueError:
    return ValueError(f"{key} must be {what}, got {value!r} ({type(value).__name__})")


def _parse_int(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise _type_error(key, value, "an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        raise _type_error(key, value, "an integer")
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            f = float(text)
        except ValueError:
            raise _type_error(key, value, "an integer") from None
        if math.isfinite(f) and f.is_integer():
            return int(f)
    raise _type_error(key, value, "an integer")


def _parse_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise _type_error(key, value, "a number")
    if isinstance(value, (int, float)):
        f = float(value)
    elif isinstance(value, str):
        try:
            f = float(value.strip())
        except ValueError:
            raise _type_error(key, value, "a number") from None
    else:
        raise _type_error(key, value, "a number")
    if not math.isfinite(f):
        raise _type_error(key, value, "a finite number")
    return f


def _parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise _type_error(key, value, 'a bool (true/false, "true"/"false")')


def _parse_stop(key: str, value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise _type_error(key, value, "a string or a list of strings")
    for s in items:
        if not isinstance(s, str):
            raise _type_error(key, s, "a string (in the list)")
        if not s:
            raise ValueError(f"{key} must not contain an empty string")
    return tuple(items)


def _parse_token_ids(key: str, value: Any) -> tuple[int, ...]:
    items = value if isinstance(value, (list, tuple)) else [value]
    ids = tuple(_parse_int(key, v) for v in items)
    for t in ids:
        if t < 0:
            raise ValueError(f"{key} must hold token ids >= 0, got {t}")
    return ids


_PARSERS: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "max_tokens": ("max_new_tokens", _parse_int),
    "max_new_tokens": ("max_new_tokens", _parse_int),
    "min_tokens": ("min_new_tokens", _parse_int),
    "min_new_tokens": ("min_new_tokens", _parse_int),
    "temperature": ("temperature", _parse_float),
    "top_p": ("top_p", _parse_float),
    "top_k": ("top_k", _parse_int),
    "min_p": ("min_p", _parse_float),
    "repetition_penalty": ("repetition_penalty", _parse_float),
    "presence_penalty": ("presence_penalty", _parse_float),
    "frequency_penalty": ("frequency_penalty", _parse_float),
    "seed": ("seed", _parse_int),
    "stop": ("stop", _parse_stop),
    "stop_token_ids": ("stop_token_ids", _parse_token_ids),
    "ignore_eos": ("ignore_eos", _parse_bool),
    "include_stop_str_in_output": ("include_stop_str_in_output", _parse_bool),
    "skip_special_tokens": ("skip_special_tokens", _parse_bool),
    "logprobs": ("logprobs", _parse_int),
    "n": ("n", _parse_int),
    "structured_outputs": ("structured_outputs",
                           lambda key, value: parse_structured_outputs(value, key)),
    "guided_decoding": ("structured_outputs",
                        lambda key, value: parse_structured_outputs(value, key)),
    "logit_bias": ("logit_bias", lambda key, value: tuple(sorted(
        parse_logit_bias(value, _ANY_VOCAB, key).items()))),
    "allowed_token_ids": ("allowed_token_ids",
                          lambda key, value: parse_allowed_token_ids(value, _ANY_VOCAB, key)),
}
# from_dict checks token ids against no vocabulary yet (`verify` does, with the model's)
_ANY_VOCAB = 2**62
assert {t for t, _ in _PARSERS.values()} <= {f.name for f in fields(SamplingParams)}
