"""Triton custom metrics of an mla_backend model (`pb_utils.MetricFamily`), fed with plain numbers.

Owns the metric families, their buckets, the per-output token-gap arithmetic (`token_gaps`) and
`MetricsRecorder`, which the response thread (`responder.Responder`) feeds: `on_*` only buffer,
`flush()` sends (each call an IPC round trip); the responder flushes before it queues a round's
final responses, else at least every 0.1 s. Not thread-safe (but `count_failure`): the response
thread calls the rest.

The families mean what vLLM's and Triton's vLLM backend's do (names, descriptions, buckets,
labels `model` and `version`); times are `time.monotonic()` s, arrival the adapter's, token times
the engine's (`RequestOutput.first_token_time` / `last_token_time`):
- `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`: tokens the clients sent / got (a
  stop string's cut drops the tokens after it; the EOS that ended a request counts);
- `vllm:time_to_first_token_seconds`: engine first token − arrival, per request;
- `vllm:time_per_output_token_seconds`: one observation per token after the first, the time since
  the previous one (an output of k tokens spreads its time evenly: `token_gaps`);
- `vllm:e2e_request_latency_seconds`, `vllm:request_prompt_tokens`,
  `vllm:request_generation_tokens`, `vllm:request_params_n`, `vllm:request_params_max_tokens`:
  per finished request (n > 1: all completions, token gaps per completion);
- ours: gauges `mla_backend:num_requests_running` / `_waiting` / `kv_cache_usage_ratio` (slots
  held by live requests / pool; evictable cache counts as free), counters
  `mla_backend:prefix_cache_hit_tokens_total`, `mla_backend:num_retractions_total` and
  `mla_backend:request_failure_total` (requests answered with an error, label `reason`: the
  error's code, `FAILURE_REASONS`; Triton's own `nv_inference_request_failure` stays 0 for them,
  since the Python backend counts a request whose error is sent as a response as a success).
  `count_failure` sends at once, from any thread, before the error response goes out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# Histogram bucket upper bounds, the same as Triton's vLLM backend uses (seconds; n).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
N_BUCKETS = [1.0, 2.0, 5.0, 10.0, 20.0]
# `reason` label values of mla_backend:request_failure_total (the TritonError codes we send).
FAILURE_REASONS = ("invalid_argument", "cancelled", "unavailable", "internal")


def token_buckets(max_len: int) -> list[float]:
    """1-2-5 buckets (1, 2, 5, 10, 20, 50, ...) up to `max_len` (vLLM's `build_1_2_5_buckets`:
    every value <= `max_len`; larger counts land in +Inf only).

    Args:
        max_len: the largest count to resolve (the context length, tokens); must be >= 1.
    Raises:
        ValueError: `max_len` < 1.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    out: list[float] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_len:
                return out
            out.append(float(v))
        exp += 1


def token_gaps(prev_token_time: float | None, first_token_time: float, last_token_time: float,
               new_tokens: int) -> tuple[float, int]:
    """The inter-token latencies one output adds: (seconds per gap, number of gaps).

    Args:
        prev_token_time: when the engine had the request's previous token (the last token of its
            previous output with tokens), s; None when this output carries the first token.
        first_token_time: when the engine had the request's first token, s (used only when
            `prev_token_time` is None).
        last_token_time: when the engine had this output's last token, s.
        new_tokens: tokens in this output (k).
    Returns:
        k gaps (k − 1 for the output with the first token) sharing evenly the time from the
        previous token (from the first token) to this output's last one; negative spans count as
        0; (0.0, 0) when there is no gap.
    """
    if prev_token_time is None:
        count, start = new_tokens - 1, first_token_time
    else:
        count, start = new_tokens, prev_token_time
    if count <= 0:
        return 0.0, 0
    return max(last_token_time - start, 0.0) / count, count


@dataclass(frozen=True)
class FinishedRequest:
    """Per-request numbers, recorded when its final output reaches the response thread."""

    prompt_tokens: int
    generation_tokens: int  # what the client got (after a stop string's cut)
    cached_tokens: int  # prompt tokens served from the radix cache
    e2e_s: float  # arrival (execute) → final output, seconds
    max_tokens: int | None = None  # its max_tokens sampling parameter (None: not known)
    n: int = 1  # its n sampling parameter


class MetricsRecorder:
    """The model's metric families and their buffered updates.

    Not thread-safe, except `count_failure`: call the rest from one thread (the adapter's
    response thread).
    """

    def __init__(self, pb: Any, model: str, version: str, max_model_len: int):
        """Create the families (each a registration IPC).

        Args:
            pb: the `triton_python_backend_utils` module (gives `MetricFamily`).
            model, version: label values (`model`, `version`), as Triton's vLLM backend.
            max_model_len: context length in tokens (bounds the token-count histograms).
        Raises:
            pb_utils.TritonModelException: the server refused a family (e.g. metrics disabled).
        """
        labels = {"model": model, "version": version}
        MF = pb.MetricFamily
        self._families: list[Any] = []

        def metric(name: str, desc: str, kind: Any, buckets: list[float] | None = None) -> Any:
            family = MF(name=name, description=desc, kind=kind)
            self._families.append(family)  # keep alive: a family must outlive its metrics
            if buckets is None:
                return family.Metric(labels=labels)
            return family.Metric(labels=labels, buckets=buckets)

        def by_reason(name: str, desc: str) -> dict[str, Any]:
            family = MF(name=name, description=desc, kind=MF.COUNTER)
            self._families.append(family)
            return {r: family.Metric(labels={**labels, "reason": r}) for r in FAILURE_REASONS}

        C, G, H = MF.COUNTER, MF.GAUGE, MF.HISTOGRAM
        self.prompt_tokens = metric("vllm:prompt_tokens_total",
                                    "Number of prefill tokens processed.", C)
        self.generation_tokens = metric("vllm:generation_tokens_total",
                                        "Number of generation tokens processed.", C)
        self.ttft = metric("vllm:time_to_first_token_seconds",
                           "Histogram of time to first token in seconds.", H, TTFT_BUCKETS)
        self.tpot = metric("vllm:time_per_output_token_seconds",
                           "Histogram of time per output token in seconds.", H, TPOT_BUCKETS)
        self.e2e = metric("vllm:e2e_request_latency_seconds",
                          "Histogram of end to end request latency in seconds.", H, E2E_BUCKETS)
        tb = token_buckets(max_model_len)
        self.request_prompt = metric("vllm:request_prompt_tokens",
                                     "Number of prefill tokens processed.", H, tb)
        self.request_generation = metric("vllm:request_generation_tokens",
                                         "Number of generation tokens processed.", H, tb)
        self.request_n = metric("vllm:request_params_n",
                                "Histogram of the n request parameter.", H, N_BUCKETS)
        self.request_max_tokens = metric("vllm:request_params_max_tokens",
                                         "Histogram of the max_tokens request parameter.", H, tb)
        self.running = metric("mla_backend:num_requests_running",
                              "Number of requests in the running batch.", G)
        self.waiting = metric("mla_backend:num_requests_waiting",
                              "Number of requests waiting to be scheduled.", G)
        self.kv_usage = metric("mla_backend:kv_cache_usage_ratio",
                               "KV pool slots held by live requests / pool size (0..1).", G)
        self.cache_hits = metric("mla_backend:prefix_cache_hit_tokens_total",
                                 "Prompt tokens served from the radix prefix cache.", C)
        self.retractions = metric("mla_backend:num_retractions_total",
                                  "Running requests retracted to the queue (KV pool full).", C)
        self.failures = by_reason("mla_backend:request_failure_total",
                                  "Requests answered with an error, by the error's code.")
        self._prompt_pending = 0
        self._gen_pending = 0
        self._ttft: list[float] = []
        self._gaps: list[tuple[float, int]] = []  # (seconds, how many observations)
        self._finished: list[FinishedRequest] = []
        self._stats: Mapping[str, int] | None = None
        self._gauges_sent: dict[str, float] = {}
        self._retractions_sent = 0

    # ------------------------------------------------------------------ buffering (no IPC)
    def on_output(self, new_prompt_tokens: int, new_generation_tokens: int) -> None:
        """Count tokens of one engine output (prompt tokens once per request, at its first)."""
        self._prompt_pending += new_prompt_tokens
        self._gen_pending += new_generation_tokens

    def on_first_token(self, ttft_s: float) -> None:
        """Buffer one request's time to first token (engine first token − arrival), s."""
        self._ttft.append(ttft_s)

    def on_token_gaps(self, seconds: float, count: int) -> None:
        """Buffer `count` inter-token latencies of `seconds` each (`token_gaps` of an output)."""
        if count > 0:
            self._gaps.append((seconds, count))

    def on_finished(self, req: FinishedRequest) -> None:
        """Buffer one finished request's latency, sizes and parameters."""
        self._finished.append(req)

    def set_engine_stats(self, stats: Mapping[str, int]) -> None:
        """Buffer an `Engine.stats()` snapshot (running, waiting, free/evictable/total slots,
        retractions)."""
        self._stats = stats

    # ------------------------------------------------------------------ IPC
    def count_failure(self, reason: str, n: int = 1) -> None:
        """Count `n` requests answered with an error (one `increment`, sent now). Callable from
        any thread: the stub's metric calls are (its response senders rely on the same).

        Args:
            reason: one of `FAILURE_REASONS`.
        Raises:
            KeyError: an unknown reason.
        """
        self.failures[reason].increment(n)

    def flush(self) -> None:
        """Send the buffered updates to the server (skips counters with nothing new and gauges
        whose value has not changed): one `increment` per counter, one `set` per changed gauge,
        one `observe` per histogram observation."""
        if self._prompt_pending:
            self.prompt_tokens.increment(self._prompt_pending)
            self._prompt_pending = 0
        if self._gen_pending:
            self.generation_tokens.increment(self._gen_pending)
            self._gen_pending = 0
        ttft, self._ttft = self._ttft, []
        for seconds in ttft:
            self.ttft.observe(seconds)
        gaps, self._gaps = self._gaps, []
        for seconds, count in gaps:
            for _ in range(count):
                self.tpot.observe(seconds)
        finished, self._finished = self._finished, []
        hits = 0
        for r in finished:
            self.e2e.observe(r.e2e_s)
            self.request_prompt.observe(float(r.prompt_tokens))
            self.request_generation.observe(float(r.generation_tokens))
            self.request_n.observe(float(r.n))
            if r.max_tokens is not None:
                self.request_max_tokens.observe(float(r.max_tokens))
            hits += r.cached_tokens
        if hits:
            self.cache_hits.increment(hits)
        stats, self._stats = self._stats, None
        if stats is not None:
            total = max(int(stats.get("total_slots", 0)), 1)
            held = total - int(stats.get("free_slots", 0)) - int(stats.get("evictable_slots", 0))
            self._set_gauge("running", self.running, float(stats.get("running", 0)))
            self._set_gauge("waiting", self.waiting, float(stats.get("waiting", 0)))
            self._set_gauge("kv", self.kv_usage, min(max(held / total, 0.0), 1.0))
            retractions = int(stats.get("retractions", 0))
            if retractions > self._retractions_sent:
                self.retractions.increment(retractions - self._retractions_sent)
                self._retractions_sent = retractions

    def close(self) -> None:
        """Drop the metrics, then their families (the stub requires that order). Idempotent."""
        for name in ("prompt_tokens", "generation_tokens", "ttft", "tpot", "e2e",
                     "request_prompt", "request_generation", "request_n", "request_max_tokens",
                     "running", "waiting", "kv_usage", "cache_hits", "retractions",
                     "failures"):
            if hasattr(self, name):
                delattr(self, name)
        self._families.clear()

    def _set_gauge(self, key: str, gauge: Any, value: float) -> None:
        if self._gauges_sent.get(key) != value:
            gauge.set(value)
            self._gauges_sent[key] = value


__all__ = ["E2E_BUCKETS", "FAILURE_REASONS", "FinishedRequest", "MetricsRecorder", "N_BUCKETS",
           "TPOT_BUCKETS", "TTFT_BUCKETS", "token_buckets", "token_gaps"]
