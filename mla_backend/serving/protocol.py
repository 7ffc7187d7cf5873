"""The Triton LLM request/response contract (vLLM-backend names), as pure functions.

Owns the translation between Triton tensors and engine data, with no `pb_utils` dependency so it
is testable with plain numpy arrays:

- `parse_request(inputs, parameters, rid)`: input tensors (name → numpy array, as the adapter
  reads them from a `pb_utils.InferenceRequest`) plus the request's `parameters()` JSON →
  `ParsedRequest` (a `GenerateRequest` for `Engine.add_request` and the `OutputOptions` that decide
  which output tensors each response carries). Raises `ProtocolError` naming the field.
- `build_outputs(out, options, prefix, decode)`: one `RequestOutput` from `Engine.step` → output
  tensors (name → numpy array) that the adapter wraps into `pb_utils.Tensor`s.
- `merge_outputs(held, out)`: joins a streaming increment whose text is still empty (held back
  by the detokenizer or a stop-string prefix) with the next one, so that no empty non-final
  response is sent (genai-perf would time an empty first response as the first token).

Contract (that of Triton's vLLM backend, its model.py): sampling fields come from the
`sampling_parameters` tensor (a JSON object) or, when that tensor is absent, from the request
parameters (never merged); default max_tokens 16; the prompt is echoed only for non-streaming
requests unless `exclude_input_in_output` says otherwise; streaming with
`exclude_input_in_output` = false is an error. Our additions: `input_ids` (token ids instead
of `text_input`) and `return_cached_tokens`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from mla_backend.request import GenerateRequest, RequestOutput, SamplingParams


class ProtocolError(ValueError):
    """The request's tensors or parameters are malformed; the message names the field.

    The adapter answers it with one INVALID_ARGUMENT error response flagged FINAL.
    """


# BOOL [1] switches: input name → default when the tensor is absent.
RETURN_FLAGS: tuple[str, ...] = (
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_logprobs",
    "return_cumulative_logprob",
    "return_cached_tokens",
)
INPUT_NAMES: tuple[str, ...] = (
    "text_input",
    "input_ids",
    "stream",
    "sampling_parameters",
    "exclude_input_in_output",
    *RETURN_FLAGS,
)
# Request parameters that Triton's frontends or clients set for themselves, never sampling fields.
RESERVED_PARAMETERS: frozenset[str] = frozenset(
    {"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "binary_data_output",
     "headers"}
)
# config.pbtxt `parameters` read by the adapter, not by `EngineConfig`.
# ENABLE_VLLM_HEALTH_CHECK (the vLLM backend's) is accepted so that its config.pbtxt loads; the
# adapter always checks the engine's health (`triton_model`: it logs what it does instead).
ADAPTER_PARAMETERS: tuple[str, ...] = ("REPORT_CUSTOM_METRICS", "LOG_REQUESTS",
                                       "STREAM_INTERVAL", "UNLOAD_ON_FATAL_ERROR",
                                       "INTRA_OP_THREAD_COUNT", "RESPONSE_SENDER_THREADS",
                                       "ENGINE_PROCESS", "DETOKENIZER_PROCESS",
                                       "ENABLE_VLLM_HEALTH_CHECK", "GIL_SWITCH_INTERVAL_MS")

# The vLLM backend's text, which clients match on.
STREAMING_ECHO_ERROR = (
    "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
)


@dataclass(frozen=True)
class OutputOptions:
    """Which optional outputs every response of a request carries, and whether to echo."""

    stream: bool = False
    echo: bool = False  # prepend the prompt text to text_output (non-streaming only)
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_logprobs: bool = False
    return_cumulative_logprob: bool = False
    return_cached_tokens: bool = False


@dataclass(frozen=True)
class ParsedRequest:
    request: GenerateRequest
    options: OutputOptions


# ---------------------------------------------------------------------------------------- inputs
def parse_request(
    inputs: Mapping[str, np.ndarray | None],
    parameters: str | Mapping[str, Any] | None,
    rid: str,
) -> ParsedRequest:
    """Validate and convert one Triton request.

    Args:
        inputs: input name → numpy array (absent inputs missing or None). `text_input` /
            `sampling_parameters`: object or bytes arrays of one UTF-8 element; `input_ids`: int32
            or int64, any shape (flattened); BOOL switches: one element.
        parameters: `request.parameters()` (a JSON object string, or an already decoded dict);
            used for sampling only when the `sampling_parameters` tensor is absent.
        rid: the engine request id to use (unique per live request).
    Returns:
        ParsedRequest.
    Raises:
        ProtocolError: naming the field — missing/empty prompt, both prompts given, malformed or
            non-object JSON, unknown keys, wrong types or out-of-range sampling values, streaming
            with exclude_input_in_output = false.
    """
    present = {k: v for k, v in inputs.items() if v is not None}
    unknown = sorted(set(present) - set(INPUT_NAMES))
    if unknown:
        raise ProtocolError(f"unknown input tensor(s): {', '.join(unknown)}")

    text: str | None = None
    ids: list[int] | None = None
    if "text_input" in present and "input_ids" in present:
        raise ProtocolError("give only one of text_input and input_ids, not both")
    if "text_input" in present:
        text = _string_scalar(present["text_input"], "text_input")
        if text == "":
            raise ProtocolError("text_input: the prompt is empty")
    elif "input_ids" in present:
        ids = _token_ids(present["input_ids"])
    else:
        raise ProtocolError("text_input is required (or give input_ids)")

    stream = _bool_scalar(present, "stream", False)
    sampling = _sampling(present, parameters)

    exclude = present.get("exclude_input_in_output")
    if exclude is None:
        echo = not stream
    else:
        echo = not _bool_scalar(present, "exclude_input_in_output", True)
        if stream and echo:
            raise ProtocolError(STREAMING_ECHO_ERROR)
    flags = {name: _bool_scalar(present, name, False) for name in RETURN_FLAGS}
    options = OutputOptions(stream=stream, echo=echo, **flags)
    if options.return_logprobs or options.return_cumulative_logprob:
        sampling = replace(sampling, logprobs_returned=True)
    request = GenerateRequest(rid=rid, text=text, input_ids=ids, sampling_params=sampling,
                              stream=stream)
    return ParsedRequest(request=request, options=options)


def _json_object(raw: str, field: str) -> dict[str, Any]:
    """Parse `raw` as a JSON object. Raises ProtocolError naming `field`."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ProtocolError(f"{field}: malformed JSON ({e.msg} at char {e.pos})") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise ProtocolError(f"{field}: malformed JSON ({e})") from None
    except RecursionError:
        raise ProtocolError(f"{field}: JSON nested too deeply") from None
    if not isinstance(data, dict):
        kind = "null" if data is None else type(data).__name__
        raise ProtocolError(f"{field}: must be a JSON object, got {kind}")
    return data


def _sampling(present: Mapping[str, np.ndarray],
              parameters: str | Mapping[str, Any] | None) -> SamplingParams:
    if "sampling_parameters" in present:
        field = "sampling_parameters"
        data = _json_object(_string_scalar(present["sampling_parameters"], field), field)
    else:
        field = "parameters"
        if parameters is None or parameters == "":
            data = {}
        elif isinstance(parameters, Mapping):
            data = dict(parameters)
        else:
            data = _json_object(parameters, field)
        data = {k: v for k, v in data.items()
                if k not in RESERVED_PARAMETERS and not k.startswith("triton_")}
    try:
        return SamplingParams.from_dict(data)
    except ValueError as e:
        raise ProtocolError(f"{field}: {e}") from None
    except RecursionError:  # (a JSON schema nested deeper than its checks recurse)
        raise ProtocolError(f"{field}: nested too deeply") from None


def _single(arr: np.ndarray, name: str) -> Any:
    a = np.asarray(arr)
    if a.size != 1:
        raise ProtocolError(f"{name}: expected exactly one element, got shape {list(a.shape)}")
    return a.reshape(-1)[0]


def _string_scalar(arr: np.ndarray, name: str) -> str:
    v = _single(arr, name)
    if isinstance(v, (bytes, np.bytes_)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(f"{name}: not valid UTF-8") from None
    if isinstance(v, (str, np.str_)):
        return str(v)
    raise ProtocolError(f"{name}: expected a string (TYPE_STRING), got {type(v).__name__}")


def _bool_scalar(present: Mapping[str, np.ndarray], name: str, default: bool) -> bool:
    if name not in present:
        return default
    v = _single(present[name], name)
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    raise ProtocolError(f"{name}: expected a BOOL tensor, got {np.asarray(present[name]).dtype}")


def _token_ids(arr: np.ndarray) -> list[int]:
    a = np.asarray(arr)
    if a.dtype not in (np.int32, np.int64):
        raise ProtocolError(f"input_ids: expected INT32 or INT64 token ids, got {a.dtype}")
    ids = [int(t) for t in a.reshape(-1)]
    if not ids:
        raise ProtocolError("input_ids: the prompt is empty")
    if min(ids) < 0:
        raise ProtocolError(f"input_ids: token ids must be >= 0, got {min(ids)}")
    return ids


# --------------------------------------------------------------------------------------- outputs
def merge_outputs(held: RequestOutput | None, out: RequestOutput) -> RequestOutput:
    """Join a held-back streaming increment with the next one of the same request.

    Token ids, text and per-token logprobs concatenate; the counters, finish state and error are
    taken from the later `out`. Returns `out` itself when nothing is held, else `held` extended
    in place (`merge_run`).
    """
    if held is None:
        return out
    return merge_run([held, out])


def merge_run(outs: Sequence[RequestOutput]) -> RequestOutput:
    """Successive increments `outs` (at least one) of one request's completion as one output,
    the same as merging them pair by pair: token ids, text and per-token logprobs concatenate
    (logprobs stay None unless one of them has them); the counters, finish state and error are
    the last one's. The first output is extended in place (with new lists) and returned, so the
    caller must own `outs`, as the responder owns each round's outputs."""
    first = outs[0]
    if len(outs) == 1:
        return first
    ids = list(first.new_token_ids)
    text = first.new_text
    logprobs = None if first.new_logprobs is None else list(first.new_logprobs)
    token_lps = None if first.new_token_logprobs is None else list(first.new_token_logprobs)
    last = first
    for last in outs[1:]:
        ids += last.new_token_ids
        text += last.new_text
        if last.new_logprobs is not None:
            logprobs = (logprobs or []) + last.new_logprobs
        if last.new_token_logprobs is not None:
            token_lps = (token_lps or []) + last.new_token_logprobs
    first.new_token_ids, first.new_text = ids, text
    first.new_logprobs, first.new_token_logprobs = logprobs, token_lps
    first.finished, first.finish_reason, first.error = last.finished, last.finish_reason, last.error
    first.num_input_tokens, first.num_output_tokens = last.num_input_tokens, last.num_output_tokens
    first.cached_tokens, first.cumulative_logprob = last.cached_tokens, last.cumulative_logprob
    first.first_token_time, first.last_token_time = last.first_token_time, last.last_token_time
    return first


def coalesce(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Merge the successive increments of each request's completion (rid and `index`) into one
    output (`merge_run`: each run's first output is extended in place), at the place of its
    first one; order across requests and per completion is kept. An output with an error, and
    anything after a completion's finished output, stays separate."""
    runs: list[Any] = []  # an output, or the list of a run of two or more
    at: dict[tuple[str, int], int] = {}  # (rid, index) → its open run's place in runs
    for out in outputs:
        key = (out.rid, out.index)
        i = at.get(key)
        if i is not None and out.error is None:
            run = runs[i]
            if type(run) is list:
                run.append(out)
            else:
                runs[i] = [run, out]
        else:
            if out.error is None:
                at[key] = len(runs)
            runs.append(out)
        if out.finished or out.error is not None:
            at.pop(key, None)
    return [merge_run(run) if type(run) is list else run for run in runs]


def should_hold(out: RequestOutput, options: OutputOptions) -> bool:
    """True for a streaming, unfinished increment with no text yet (merge it into the next)."""
    return options.stream and not out.finished and out.new_text == ""


def build_outputs(
    out: RequestOutput,
    options: OutputOptions,
    prefix: str = "",
    decode: Callable[[int], str] | None = None,
) -> dict[str, np.ndarray]:
    """Output tensors for one response (the vLLM backend's output names).

    Args:
        out: the engine's increment (streaming) or final result (non-streaming).
        options: from `parse_request`.
        prefix: prompt text to prepend to `text_output` (the echo; non-streaming only).
        decode: token id → text, for `decoded_token` in logprobs (None → empty strings).
    Returns:
        name → numpy array: `text_output` object [1] (always; streaming: the delta), and when
        asked: `finish_reason` object [1] ("None" until the last response), `num_input_tokens`
        uint32 [1], `num_output_tokens` uint32 [1] (tokens in this response),
        `cumulative_logprob` float32 [1], `logprobs` object [1] (a JSON list with one
        {token_id: {logprob, rank, decoded_token}} per new token, or "null" when the request did
        not ask for `logprobs`), `cached_tokens` uint32 [1].
    """
    text = (prefix + out.new_text) if options.echo else out.new_text
    tensors: dict[str, np.ndarray] = {"text_output": _obj(text)}
    if options.return_finish_reason:
        reason = out.finish_reason.value if (out.finished and out.finish_reason) else "None"
        tensors["finish_reason"] = _obj(reason)
    if options.return_num_input_tokens:
        tensors["num_input_tokens"] = np.array([out.num_input_tokens], dtype=np.uint32)
    if options.return_num_output_tokens:
        n = len(out.new_token_ids) if options.stream else out.num_output_tokens
        tensors["num_output_tokens"] = np.array([n], dtype=np.uint32)
    if options.return_cumulative_logprob:
        tensors["cumulative_logprob"] = np.array([out.cumulative_logprob], dtype=np.float32)
    if options.return_logprobs:
        tensors["logprobs"] = _obj(logprobs_json(out, decode))
    if options.return_cached_tokens:
        tensors["cached_tokens"] = np.array([out.cached_tokens], dtype=np.uint32)
    return tensors


def build_sequence_outputs(
    outs: Sequence[RequestOutput],
    options: OutputOptions,
    prefix: str = "",
    decode: Callable[[int], str] | None = None,
) -> dict[str, np.ndarray]:
    """Output tensors for one response of a request with `n` > 1 (the vLLM backend's layout):
    `outs[i]` is completion i's increment since the previous response (no tokens when it has
    none, with its finish state); `text_output`, `finish_reason`, `num_output_tokens`,
    `cumulative_logprob` and `logprobs` get one element per completion, in index order;
    `num_input_tokens` and `cached_tokens` stay [1] (one prompt)."""
    per = [build_outputs(o, options, prefix, decode) for o in outs]
    return {name: per[0][name] if name in ("num_input_tokens", "cached_tokens")
            else np.concatenate([p[name] for p in per]) for name in per[0]}


def logprobs_json(out: RequestOutput, decode: Callable[[int], str] | None = None) -> str:
    """JSON of the per-token candidate logprobs of `out` ("null" if the request did not ask).

    Each entry maps str(token_id) → {"logprob", "rank", "decoded_token"}; rank is 1 + the number
    of listed candidates with a strictly higher logprob (exact for the top-k candidates; a lower
    bound for a chosen token outside them).
    """
    if out.new_logprobs is None:
        return "null"
    entries = []
    for cands in out.new_logprobs:
        values = sorted(cands.values(), reverse=True)
        entry = {}
        for tid, lp in cands.items():
            rank = 1 + sum(1 for v in values if v > lp)
            entry[str(tid)] = {"logprob": float(lp), "rank": rank,
                               "decoded_token": decode(tid) if decode else ""}
        entries.append(entry)
    return json.dumps(entries)


def check_instance_layout(instance_kind: str | None, tensor_parallel_size: int) -> None:
    """Model-load check of the instance group against the TP degree.

    Args:
        instance_kind: Triton's `model_instance_kind` ("GPU", "CPU", "MODEL", or None).
        tensor_parallel_size: the engine setting.
    Raises:
        ValueError: TP > 1 under KIND_GPU (Triton starts one instance per GPU, but one TP instance
            spans tensor_parallel_size GPUs itself).
    """
    if tensor_parallel_size > 1 and instance_kind == "GPU":
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} spans {tensor_parallel_size} GPUs from "
            "one instance: use instance_group [{ kind: KIND_MODEL }] (KIND_GPU starts one "
            "instance per GPU)")


def _obj(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)


__all__ = [
    "ADAPTER_PARAMETERS",
    "INPUT_NAMES",
    "OutputOptions",
    "ParsedRequest",
    "ProtocolError",
    "build_outputs",
    "check_instance_layout",
    "coalesce",
    "logprobs_json",
    "merge_outputs",
    "merge_run",
    "parse_request",
    "should_hold",
]
