"""`n` > 1 completions of one prompt (`SamplingParams.n`) in the engine and through its front
door: the prompt is prefilled once (the other completions find it in the radix cache), sampled
completions differ and each is reproducible with a seed, greedy ones are equal, each completion
has its own outputs (`index` at the front door), and aborting the request mid-way frees every
slot."""

from __future__ import annotations

import time

import pytest
import torch

from mla_backend.client import InProcessClient, ProcessClient
from mla_backend.config import EngineConfig
from mla_backend.engine import Engine
from mla_backend.request import FinishReason, GenerateRequest, SamplingParams

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who " * 3


@pytest.fixture(scope="module")
def model_dir(tiny_deepseek_factory):
    return tiny_deepseek_factory(seed=1, hidden_size=128, num_hidden_layers=3)


def _config(path: str, **kw) -> EngineConfig:
    return EngineConfig.create(model_path=path, dtype="float32", device="cpu", **kw)


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = Engine(_config(model_dir))
    yield eng
    eng.close()


def _count_prefill_tokens(eng: Engine) -> list[int]:
    """New tokens computed by each prefill (extend) batch from now on."""
    counts: list[int] = []
    inner = eng.scheduler.get_next_batch

    def counted():
        batch = inner()
        if batch is not None and not batch.is_decode():
            counts.append(sum(batch.extend_lens))
        return batch

    eng.scheduler.get_next_batch = counted
    return counts


def test_the_prompt_is_prefilled_once(model_dir):
    eng = Engine(_config(model_dir))
    try:
        prompt_len = len(eng.tokenizer(PROMPT).input_ids)
        counts = _count_prefill_tokens(eng)
        got = eng.generate([PROMPT], SamplingParams(n=4, max_new_tokens=6, temperature=0.8))
        assert len(got) == 4 and all(len(r.token_ids) == 6 for r in got)
        # the first completion computes the prompt; the others only its last token's logits
        assert sum(counts) == prompt_len + 3, counts
        assert [r.cached_tokens for r in got] == [0] + [prompt_len - 1] * 3
        eng.check_invariant()
    finally:
        eng.close()


def test_sampled_completions_differ_and_repeat_with_a_seed(engine):
    sp = SamplingParams(n=4, max_new_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    first = engine.generate([PROMPT], sp)
    again = engine.generate([PROMPT], sp)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert len({tuple(r.token_ids) for r in first}) == 4
    unseeded = engine.generate([PROMPT], SamplingParams(n=4, max_new_tokens=16,
                                                        temperature=1.0, ignore_eos=True))
    assert len({tuple(r.token_ids) for r in unseeded}) > 1


def test_greedy_completions_are_equal(engine):
    got = engine.generate([PROMPT, "The sky is"], SamplingParams(n=3, max_new_tokens=10,
                                                                  temperature=0.0))
    assert len(got) == 6
    assert len({tuple(r.token_ids) for r in got[:3]}) == 1
    assert len({tuple(r.token_ids) for r in got[3:]}) == 1
    single = engine.generate([PROMPT], SamplingParams(max_new_tokens=10, temperature=0.0))[0]
    assert got[0].token_ids == single.token_ids


@pytest.mark.parametrize("where", ["thread", "detokenizer process"])
def test_the_front_door_names_each_completion_and_abort_frees_every_slot(model_dir, where):
    """Also with the text made in a detokenizer process, which registers each completion."""
    threads = torch.get_num_threads()
    client = (InProcessClient(_config(model_dir), threads=1) if where == "thread" else
              ProcessClient(_config(model_dir), threads=1, text_process=True))
    try:
        sp = SamplingParams(n=3, max_new_tokens=200, temperature=1.0, seed=5, ignore_eos=True)
        client.add_request(GenerateRequest(rid="multi", text=PROMPT, sampling_params=sp,
                                           stream=True))
        seen: dict[int, int] = {}
        deadline = time.monotonic() + 60
        while len(seen) < 3 or min(seen.values()) < 3:  # every completion is decoding
            assert time.monotonic() < deadline
            for out in client.get_outputs(0.1):
                assert out.rid == "multi" and not out.finished
                seen[out.index] = seen.get(out.index, 0) + len(out.new_token_ids)
        assert sorted(seen) == [0, 1, 2]
        client.abort("multi")
        ended: dict[int, FinishReason] = {}
        while len(ended) < 3:
            assert time.monotonic() < deadline
            for out in client.get_outputs(0.1):
                if out.finished:
                    ended[out.index] = out.finish_reason
        assert ended == {i: FinishReason.ABORT for i in range(3)}
        assert client._children == {} and client._seq_of == {}
        while client.stats()["live"] or client.stats()["running"]:
            assert time.monotonic() < deadline
            client.get_outputs(0.1)
        stats = client.stats()
        assert stats["protected_slots"] == 0
        assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]
        client.check_invariant()
    finally:
        client.close()
        torch.set_num_threads(threads)


def test_n_is_checked():
    with pytest.raises(ValueError, match="n must be an integer in"):
        SamplingParams.from_dict({"n": 0})
    with pytest.raises(ValueError, match="n must be an integer in"):
        SamplingParams.from_dict({"n": 65})
    seeds = [sp.seed for _, sp in SamplingParams(n=3, seed=2**64 - 2).sequences("r")]
    assert seeds == [2**64 - 2, 2**64 - 1, 0]  # past the largest seed: wrapped, still valid
