"""`OutputProcessor`: the one place where an engine's token outputs become text.

The engine (`Engine.step`) emits token ids, counts and logprobs only (`RequestOutput.new_text`
""). Its consumer, the engine's front door (`client.EngineClient`) or `Engine.generate` /
`stream` in process, passes every output through one `OutputProcessor`, which owns per request:
the incremental detokenizer (`detokenizer.IncrementalDetokenizer`), the stop-string matcher
(`stop.StopStringMatcher`) and, for a non-streaming request the engine streams (its stop strings
need every step's tokens), the output gathered so far. It also gives the text of single tokens for
logprobs (`token_text`). As in vLLM v1's OutputProcessor, a stop string is found here, after the
engine: the output is cut at the token that completed it and the request's id is returned for the
caller to abort in the engine, which by then may have run it a step or two further (those tokens
are dropped here).

Rules: a stop token's text (the last token of an output the engine finished with STOP) is not
emitted; text held back for an incomplete UTF-8 character or a possible stop string is released
with the final output; `min_tokens` holds stop strings off as in the engine. Outputs of requests
not registered (or already ended here) are dropped.

Thread use: `add` / `forget` from any thread; `process` from one thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

from mla_backend.request import FinishReason, InvalidRequestError, RequestOutput, SamplingParams
from mla_backend.tokenizer.detokenizer import IncrementalDetokenizer
from mla_backend.tokenizer.stop import StopStringMatcher


def engine_streams(sampling_params: SamplingParams, stream: bool) -> bool:
    """Whether the engine must emit a request's tokens every step (`Req.stream`): the client
    streams, or its stop strings are matched here as the tokens come."""
    return stream or bool(sampling_params.stop)


@dataclass(slots=True)
class _State:
    detok: IncrementalDetokenizer
    stopper: StopStringMatcher | None
    min_tokens: int
    stream: bool  # the client's: False gathers every increment into one final output
    gathered: RequestOutput | None = None
    n_out: int = 0  # tokens seen so far


class OutputProcessor:
    """Args:
        tokenizer: the engine's tokenizer (a transformers tokenizer; the same vocabulary).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._reqs: dict[str, _State] = {}
        self._lock = threading.Lock()
        self._token_texts: dict[int, str] = {}

    def add(self, rid: str, prompt_ids: Sequence[int], sampling_params: SamplingParams,
            stream: bool) -> None:
        """Register a request before the engine can answer it.

        Raises:
            InvalidRequestError: `rid` is already registered (live).
        """
        sp = sampling_params
        self._register(rid, _State(
            IncrementalDetokenizer(self.tokenizer, sp.skip_special_tokens, prompt_ids=prompt_ids),
            StopStringMatcher(sp.stop, sp.include_stop_str_in_output) if sp.stop else None,
            sp.min_new_tokens, stream))

    def _register(self, rid: str, state: Any) -> None:
        """`rid` → its state, unless `rid` is live (InvalidRequestError)."""
        with self._lock:
            if rid in self._reqs:
                raise InvalidRequestError(f"request id {rid!r} is already in use")
            self._reqs[rid] = state

    def forget(self, rid: str) -> None:
        """Drop a request that will get no (more) outputs here."""
        with self._lock:
            self._reqs.pop(rid, None)

    def rids(self) -> list[str]:
        """The registered requests that have not ended, sorted."""
        with self._lock:
            return sorted(self._reqs)

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, rid: object) -> bool:
        return rid in self._reqs

    def token_text(self, token_id: int) -> str:
        """One token's text with special tokens kept (logprobs' `decoded_token`)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False)
        return text

    def process(self, outputs: Sequence[RequestOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Fill the text of each output in order and apply stop strings.

        Returns:
            (outputs for the client: streaming requests' increments and every request's final
            output, the same objects with `new_text` set and, where a stop string ended the
            request, cut after the token that completed it with finish_reason STOP;
            the ids of the requests a stop string ended, which the engine still runs: abort
            them there).
        """
        emitted: list[RequestOutput] = []
        stopped: list[str] = []
        reqs = self._reqs
        for out in outputs:
            st = reqs.get(out.rid)
            if st is None:
                continue
            ids = out.new_token_ids
            if (len(ids) == 1 and st.stream and st.stopper is None and not out.finished
                    and out.error is None):  # a streamed decode token: `_add_text`'s one step
                st.n_out += 1
                out.new_text = st.detok.add_token(ids[0])
                emitted.append(out)
                continue
            if out.error is None and self._add_text(st, out):
                stopped.append(out.rid)
            if out.finished:
                self.forget(out.rid)
            if st.stream:
                emitted.append(out)
            else:
                st.gathered = out if st.gathered is None else _append(st.gathered, out)
                if out.finished:
                    emitted.append(st.gathered)
        return emitted, stopped

    @staticmethod
    def _add_text(st: _State, out: RequestOutput) -> bool:
        """Detokenize `out`'s tokens into `out.new_text`; True when a stop string ended it here
        (`out` then cut and finished)."""
        ids = out.new_token_ids
        last = len(ids) - 1 if out.finished and out.finish_reason is FinishReason.STOP else -1
        parts: list[str] = []
        detok, stopper = st.detok, st.stopper
        cut = -1
        for i, token in enumerate(ids):
            st.n_out += 1
            if i == last:  # the EOS / stop token that ended it: no text
                break
            delta = detok.add_token(token)
            if stopper is not None:
                delta, hit = stopper.feed(delta, can_stop=st.n_out >= st.min_tokens)
                if hit:
                    parts.append(delta)
                    cut = i + 1
                    break
            if delta:
                parts.append(delta)
        if cut >= 0:
            _cut(out, cut)
        elif out.finished:
            rest = detok.flush()
            if stopper is not None:
                rest = stopper.feed(rest, can_stop=False)[0] + stopper.flush()
            parts.append(rest)
        out.new_text = "".join(parts)
        return cut >= 0


def _cut(out: RequestOutput, keep: int) -> None:
    """End `out` with STOP after its first `keep` tokens (a stop string completed there)."""
    dropped = len(out.new_token_ids) - keep
    if dropped:
        if out.new_token_logprobs is not None:
            out.cumulative_logprob -= sum(out.new_token_logprobs[keep:])
            out.new_token_logprobs = out.new_token_logprobs[:keep]
        if out.new_logprobs is not None:
            out.new_logprobs = out.new_logprobs[:keep]
        out.new_token_ids = out.new_token_ids[:keep]
        out.num_output_tokens -= dropped
    out.finished = True
    out.finish_reason = FinishReason.STOP


def _append(acc: RequestOutput, out: RequestOutput) -> RequestOutput:
    """`acc` extended by the later increment `out` (a non-streaming request's gathered output)."""
    acc.new_token_ids = acc.new_token_ids + out.new_token_ids
    acc.new_text += out.new_text
    if acc.new_logprobs is not None and out.new_logprobs is not None:
        acc.new_logprobs = acc.new_logprobs + out.new_logprobs
    if acc.new_token_logprobs is not None and out.new_token_logprobs is not None:
        acc.new_token_logprobs = acc.new_token_logprobs + out.new_token_logprobs
    acc.finished, acc.finish_reason, acc.error = out.finished, out.finish_reason, out.error
    acc.num_input_tokens, acc.num_output_tokens = out.num_input_tokens, out.num_output_tokens
    acc.cached_tokens, acc.cumulative_logprob = out.cached_tokens, out.cumulative_logprob
    acc.first_token_time, acc.last_token_time = out.first_token_time, out.last_token_time
    return acc


__all__ = ["OutputProcessor", "engine_streams"]
