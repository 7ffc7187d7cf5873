"""Rank 0 driving tensor-parallel worker processes (`distributed.tp_workers`), as the Triton adapter
does: `Engine(tensor_parallel_size=2)` in this process spawns rank 1, mirrors every step to it,
and gives the same greedy tokens as TP 1 (with chunked prefill and a radix-cache hit, whose prefix
slots only rank 0's cache knows); a killed worker fails requests with a clear error, no hang;
`close()` stops the worker and leaves the process group.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from mla_backend.config import EngineConfig
from mla_backend.distributed import get_tp_size, is_tensor_parallel_initialized
from mla_backend.engine import Engine
from mla_backend.request import SamplingParams

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


def test_worker_driven_tp2_equals_tp1(deepseek):
    settings = {"model_path": deepseek, "max_total_tokens": 1024, "chunked_prefill_size": 8}
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


def test_dead_worker_fails_requests_clearly(deepseek):
    eng = Engine(EngineConfig.create(model_path=deepseek, max_total_tokens=1024,
                                     tensor_parallel_size=2))
    try:
        pid = eng.runner.tp_workers.pids()[0]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and eng.runner.tp_workers._procs[0].is_alive():
            time.sleep(0.05)
        t0 = time.monotonic()
        outs = eng.generate(["hello", "world"], GREEDY)
        assert time.monotonic() - t0 < 30
        for o in outs:
            assert o.finish_reason is not None
            assert o.error and "tensor-parallel worker rank 1 exited" in o.error
        eng.check_invariant()  # the failed batch's slots and rows came back
    finally:
        eng.close()
    assert not is_tensor_parallel_initialized()
