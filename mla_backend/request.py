"""Plain CPU data that crosses component boundaries: `SamplingParams`, `Req`, `FinishReason`,
`GenerateRequest` (adapter/tests → engine) and `RequestOutput` (engine → adapter/tests).

`SamplingParams.from_dict` is the one place request-level sampling input is parsed and validated
(JSON from the `sampling_parameters` tensor or Triton request parameters, values possibly strings).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch


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
    n: int = 1  # only 1 supported


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


@dataclass
class RequestOutput:
    """One increment of a request's output. Filled by: `Engine.step` / `Engine.abort`.

    Streaming consumers concatenate `new_text`; `text` is not repeated in every increment.
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


@dataclass
class Req:
    """Scheduler-side state of one request. Owned by the scheduler; the sampler and detokenizer
    read/append fields as documented.
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
    finished_len: int | None = None  # output tokens kept when a stop matched (stop str trimming)
    cumulative_logprob: float = 0.0
    # Sampler state: a private generator when `sampling_params.seed` is set (filled lazily).
    generator: torch.Generator | None = None
    # Detokenizer state (mla_backend.tokenizer.detokenizer): owned by the engine.
    detok: Any = None
    sent_offset: int = 0  # output tokens already reported in a RequestOutput

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None
