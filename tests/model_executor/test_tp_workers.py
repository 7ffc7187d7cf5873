"""Rank 0 driving tensor-parallel worker processes (`model_executor.tp_workers`), as the adapter
does: `Engine(tensor_parallel_size=2)` in this process spawns rank 1, mirrors every step to it,
and gives the same greedy tokens as TP 1 (with chunked prefill and a radix-cache hit, whose prefix
slots only rank 0's cache knows); a killed worker (between steps, or inside a step: rank 0's gloo
collective then fails) fails every live request with one message naming it, no hang, and the
engine runs no more forwards; `close()` stops the worker and leaves the process group.
Structured outputs and n > 1 (rank 0 only) give TP 1's tokens too.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from mla_backend.config import EngineConfig
from mla_backend.distributed import get_tp_size, is_tensor_parallel_initialized
from mla_backend.engine import Engine, EngineFailedError
from mla_backend.request import FinishReason, SamplingParams

SHARED = "The history of the city goes back many centuries, and its old town"
PROMPTS = [SHARED + " is", SHARED + " has", "def fib(n):"]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)


def _generate(eng: Engine) -> tuple[list[list[int]], list[int]]:
    """(greedy tokens, cached prompt tokens) per prompt."""
    first = eng.generate(PROMPTS[:1], GREEDY)  # fills the radix cache with SHARED
    rest = eng.generate(PROMPTS[1:], GREEDY)  # the second prompt hits it
    return [o.token_ids for o in first + rest], [o.cached_tokens for o in first + rest]


@pytest.fixture(scope="module")
def deepseek(tiny_deepseek_factory):
    return tiny_deepseek_factory(seed=6, hidden_size=64, num_hidden_layers=2)


@pytest.mark.parametrize("as_decode", ["false", "true"])  # prefills as decode rows: workers too
def test_worker_driven_tp2_equals_tp1(deepseek, as_decode):
    settings = {"model_path": deepseek, "max_total_tokens": 1024, "chunked_prefill_size": 8,
                "extend_as_decode": as_decode}
    expected, _ = _generate(Engine(EngineConfig.create(**settings)))
    eng = Engine(EngineConfig.create(tensor_parallel_size=2, **settings))
    try:
        assert eng.runner.tp_workers is not None and get_tp_size() == 2
        tokens, cached = _generate(eng)
        assert tokens == expected
        assert cached[1] >= 8  # the shared prefix came from rank 0's radix cache
        eng.check_invariant()
    finally:
        eng.close()
    assert not is_tensor_parallel_initialized() and get_tp_size() == 1


def test_tp2_structured_outputs_and_n_equal_tp1(deepseek):
    """Grammar masks and n > 1 live on rank 0 (the sampler, the scheduler): the workers see
    plain forwards, and the tokens equal TP 1's."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                     "maximum": 999},
                                               "b": {"type": "string", "maxLength": 6}},
              "required": ["a", "b"]}
    sps = [SamplingParams.from_dict({"temperature": 0, "max_tokens": 40,
                                     "structured_outputs": {"json": schema}}),
           SamplingParams(n=2, max_new_tokens=8, temperature=0.0, ignore_eos=True)]
    settings = {"model_path": deepseek, "max_total_tokens": 1024}
    one = Engine(EngineConfig.create(**settings))
    try:
        expected = [r.token_ids for r in one.generate(PROMPTS[1:], sps)]
    finally:
        one.close()
    eng = Engine(EngineConfig.create(tensor_parallel_size=2, **settings))
    try:
        got = eng.generate(PROMPTS[1:], sps)
        eng.check_invariant()
    finally:
        eng.close()
    assert [r.token_ids for r in got] == expected and len(got) == 3
    assert got[0].finish_reason == FinishReason.STOP and got[0].text.startswith('{"a": ')


def test_tp2_slots_the_prefix_cache_swapped_after_a_prefill_equal_tp1(deepseek):
    """Two identical prompts in one prefill: after it, rank 0's radix cache frees the second
    one's duplicate slots and points its row at the first one's (`cache_unfinished_req`). The
    worker's row must follow, or its decode reads slots that a small pool soon hands to other
    tokens (silently: the logprobs drift, greedy tokens of a tiny model may not)."""
    prompt = PROMPTS[0]
    sp = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    settings = {"model_path": deepseek, "max_total_tokens": 48}
    runs = []
    for tp in (1, 2):
        eng = Engine(EngineConfig.create(tensor_parallel_size=tp, **settings))
        try:
            runs.append(eng.generate([prompt, prompt], sp))
            eng.check_invariant()
        finally:
            eng.close()
    (a1, b1), (a2, b2) = runs
    assert a2.token_ids == a1.token_ids and b2.token_ids == b1.token_ids
    for one, two in ((a1, a2), (b1, b2)):
        assert two.cumulative_logprob == pytest.approx(one.cumulative_logprob, abs=1e-4)


def _killed_message(pid: int) -> str:
    return (f"tensor-parallel worker rank 1 (pid {pid}) exited (signal 9, SIGKILL); the model "
            "must be reloaded")


def _count_forwards(eng: Engine, monkeypatch, kill_at: int | None = None) -> list[int]:
    """Wrap rank 0's model forward: returns the list of calls (batch sizes); SIGKILLs the worker
    at call number `kill_at`, after the step was sent to it and before rank 0's collectives."""
    calls: list[int] = []
    real = eng.runner._forward
    pid = eng.runner.tp_workers.pids()[0]

    def forward(fb):
        calls.append(fb.batch_size)
        if len(calls) == kill_at:
            os.kill(pid, signal.SIGKILL)
        return real(fb)

    monkeypatch.setattr(eng.runner, "_forward", forward)
    return calls


def test_worker_dead_between_steps_fails_requests_clearly(deepseek, monkeypatch):
    eng = Engine(EngineConfig.create(model_path=deepseek, max_total_tokens=1024,
                                     tensor_parallel_size=2))
    try:
        workers = eng.runner.tp_workers
        pid = workers.pids()[0]
        calls = _count_forwards(eng, monkeypatch)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while workers.dead_worker() is None:
            assert time.monotonic() < deadline, "the killed worker was not reaped"
            time.sleep(0.05)
        t0 = time.monotonic()
        outs = eng.generate(["hello", "world"], GREEDY)
        assert time.monotonic() - t0 < 30
        for o in outs:
            assert o.error == _killed_message(pid)
            assert o.finish_reason is FinishReason.ABORT and o.token_ids == []
        assert calls == []  # the step was refused before rank 0 ran anything
        assert eng.failed == _killed_message(pid) and eng.check_health() == eng.failed
        with pytest.raises(EngineFailedError, match=r"rank 1 \(pid \d+\) exited \(signal 9"):
            eng.generate(["again"], GREEDY)
        assert eng.step() == [] and calls == []  # no more forwards
        eng.check_invariant()  # the failed batch's slots and rows came back
        assert eng.stats()["live"] == eng.stats()["running"] == eng.stats()["waiting"] == 0
    finally:
        eng.close()
    assert not is_tensor_parallel_initialized()


def test_worker_killed_inside_a_step_fails_every_live_request(deepseek, monkeypatch):
    """Rank 0's all-reduce meets a dead peer (gloo: connection reset): every request — the
    batch's and the one still waiting — ends with the message naming the worker."""
    eng = Engine(EngineConfig.create(model_path=deepseek, max_total_tokens=1024,
                                     max_running_requests=2, tensor_parallel_size=2))
    try:
        workers = eng.runner.tp_workers
        pid = workers.pids()[0]
        calls = _count_forwards(eng, monkeypatch, kill_at=3)
        seen: list[BaseException] = []
        real_step_failed = workers.step_failed
        monkeypatch.setattr(workers, "step_failed",
                            lambda e, **kw: seen.append(e) or real_step_failed(e, **kw))
        t0 = time.monotonic()
        outs = eng.generate(["one", "two", "three"], GREEDY)
        assert time.monotonic() - t0 < 30
        assert len(calls) == 3  # the failed forward was the last one
        assert len(seen) == 1 and "gloo" in str(seen[0])  # the collective's own error
        for o in outs:
            assert o.error == _killed_message(pid)
            assert o.finish_reason is FinishReason.ABORT
        assert [len(o.token_ids) for o in outs] == [2, 2, 0]  # 2 steps ran; "three" waited
        assert eng.failed == _killed_message(pid)
        eng.check_invariant()
        assert eng.stats()["live"] == eng.stats()["running"] == eng.stats()["waiting"] == 0
    finally:
        eng.close()
    assert not is_tensor_parallel_initialized()
