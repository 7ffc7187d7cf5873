"""Overlap schedule (`overlap_schedule`, `Engine.step`) vs the serial loop, on the CPU.

With overlap the host detokenizes and emits step N's tokens while step N + 1 runs; the stop
rules that need no text act at once, a stop string one step late (the extra token is dropped).
Whatever the order of host work, every request must get the same tokens, text, finish reason
and logprobs as the serial loop, streamed text must equal the final text, and the pools must
balance. The model is the shipped trained `deepseek-v2-tiny` (it writes real text, so stop
strings match), fp32.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from mla_backend.config import EngineConfig
from mla_backend.engine import Engine
from mla_backend.request import FinishReason, GenerateRequest, SamplingParams
from mla_backend.tokenizer.output_processor import OutputProcessor
from tests.test_engine import check_abort_mid_decode

MODEL = os.path.join(os.path.dirname(os.path.dirname(__file__)), "checkpoints",
                     "deepseek-v2-tiny")
PROMPTS = ["Once upon a time", "The little dog", "One day, a girl named Lily", "Tom and Sam",
           "The sun was", "She looked at the", "In the morning"]


def make_engine(overlap: str, device: str = "cpu", **kw) -> Engine:
    if device == "cuda":
        kw.setdefault("max_total_tokens", 4096)  # not sized from free memory
    return Engine(EngineConfig.create(model_path=MODEL, dtype="float32", device=device,
                                      overlap_schedule=overlap, **kw))


GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])


@pytest.fixture(scope="module")
def reference():
    """Serial-loop texts of the prompts (greedy, 40 tokens, no EOS stop)."""
    eng = make_engine("false")
    sp = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    return [r for r in eng.generate(PROMPTS, sp)]


def mixed_params(reference) -> list[SamplingParams]:
    """One request per prompt, each ending a different way: max_tokens, a stop token id, a
    stop string from the middle of its own serial text (kept or cut), seeded sampling with
    logprobs; and two whose sampling reads their output tokens (the overlap schedule reads
    their tokens before the next step): min_tokens past a stop token, a repetition penalty."""
    stop_tok = reference[1].token_ids[9]
    text2 = reference[2].text
    stop_str = text2[len(text2) // 2: len(text2) // 2 + 4]
    text3 = reference[3].text
    stop_kept = text3[len(text3) // 3: len(text3) // 3 + 3]
    return [
        SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=(stop_tok,)),
        SamplingParams(max_new_tokens=40, temperature=0.0, stop=(stop_str,), ignore_eos=True),
        SamplingParams(max_new_tokens=40, temperature=0.0, stop=(stop_kept,),
                       include_stop_str_in_output=True, ignore_eos=True),
        SamplingParams(max_new_tokens=40, temperature=0.8, top_p=0.9, seed=7, logprobs=2,
                       ignore_eos=True),
        SamplingParams(max_new_tokens=30, temperature=0.0, min_new_tokens=12,
                       stop_token_ids=(reference[5].token_ids[3],)),
        SamplingParams(max_new_tokens=30, temperature=0.0, repetition_penalty=1.3,
                       ignore_eos=True),
    ]


def count_overlapped_batches(eng: Engine) -> list[int]:
    """Counts, in a one-element list, the batches scheduled while another was in flight
    (decode rows whose input token was still being sampled)."""
    count = [0]
    inner = eng.scheduler.get_next_batch

    def get_next_batch():
        batch = inner()
        count[0] += bool(batch is not None and batch.future_rows)
        return batch

    eng.scheduler.get_next_batch = get_next_batch
    return count


@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("settings", [{}, {"enable_radix_cache": False}])
def test_overlap_outputs_equal_serial(reference, settings, device):
    """On the GPU with CUDA graphs too (where the overlap is real)."""
    sps = mixed_params(reference)
    results = {}
    for mode in ("false", "true"):
        eng = make_engine(mode, device, **settings)
        assert eng.overlap == (mode == "true")
        overlapped = count_overlapped_batches(eng)
        results[mode] = eng.generate(PROMPTS, sps)
        assert (overlapped[0] > 0) == (mode == "true")
        eng.check_invariant()
        st = eng.stats()
        assert st["free_slots"] + st["evictable_slots"] == st["total_slots"]
        assert st["running"] == 0 and st["live"] == 0
        assert eng._num_reading_outputs == 0  # the penalty request was counted, then released
    serial, overlap = results["false"], results["true"]
    if device == "cpu":  # the stop rules were taken from the CPU's serial text: each one hits
        reasons = [r.finish_reason for r in serial]
        assert reasons[:5] == [FinishReason.LENGTH, FinishReason.STOP, FinishReason.STOP,
                               FinishReason.STOP, FinishReason.LENGTH]
        assert len(serial[5].token_ids) >= 12
        assert len(serial[1].token_ids) < 40 and len(serial[2].token_ids) < 40
    for a, b in zip(serial, overlap):
        assert b.token_ids == a.token_ids
        assert b.text == a.text
        assert b.finish_reason == a.finish_reason
        # (GPU: the overlap schedule's extra rows change batch sizes, so graph buckets and
        # fp32 reduction orders: ~1e-5 over 40 tokens)
        assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, rel=2e-6, abs=1e-5)


def test_overlap_with_retraction_equals_serial(reference):
    # 5 x (4-6 + 40) tokens cannot all decode in 120 slots: requests are retracted and rerun.
    sp = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    eng = make_engine("true", max_total_tokens=120)
    got = eng.generate(PROMPTS, sp)
    assert eng.scheduler.num_retractions > 0
    assert [r.token_ids for r in got] == [r.token_ids for r in reference]
    assert [r.text for r in got] == [r.text for r in reference]
    eng.check_invariant()


def test_overlap_streams_one_step_later_and_aborts_cleanly():
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    eng = make_engine("true", enable_radix_cache=False)
    total = eng.stats()["free_slots"]
    eng.add_request(GenerateRequest(rid="s", text=PROMPTS[0], sampling_params=sp, stream=True))
    # Step 1 runs the prefill (a prefill is completed in its own step): the first token.
    parts = [o for o in eng.step() if o.rid == "s"]
    assert len(parts) == 1
    # Step 2 launches the first decode and completes nothing: no output.
    assert [o for o in eng.step() if o.rid == "s"] == []
    steps = 2
    while True:  # from then on each step launches one decode and emits the one before
        outs = [o for o in eng.step() if o.rid == "s"]
        steps += 1
        parts += outs
        assert len(outs) == 1
        if outs[-1].finished:
            break
    assert all(len(o.new_token_ids) == 1 for o in parts) and len(parts) == 12
    # 12 forwards (1 prefill + 11 decodes) and one step that only completes the last decode
    assert steps == 13
    serial = make_engine("false", enable_radix_cache=False).generate([PROMPTS[0]], sp)[0]
    assert [t for o in parts for t in o.new_token_ids] == serial.token_ids
    assert eng.tokenizer.decode(serial.token_ids) == serial.text

    assert eng.stats()["free_slots"] == total
    check_abort_mid_decode(eng, PROMPTS[1])  # aborted while its next decode is in flight


WORDS = "the little dog ran to a big tree and saw one girl named Lily who was happy sad".split()
SETTINGS = [{}, {"enable_radix_cache": False}, {"max_total_tokens": 150},
            {"chunked_prefill_size": 8}, {"max_total_tokens": 200, "chunked_prefill_size": 16}]


def random_workload(seed: int) -> tuple[list, dict, dict[int, int]]:
    """Requests (rid, prompt, params, arrival step) with every way of ending (max_tokens, EOS,
    stop strings, seeded sampling, min_tokens, a repetition penalty), engine settings and
    abort steps {step: which live request}, all drawn from `seed`."""
    rng = random.Random(seed)
    reqs = []
    for i in range(rng.randint(3, 9)):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
        sp = dict(max_new_tokens=rng.randint(1, 30), temperature=0.0)
        kind = rng.random()
        if kind < 0.3:
            sp["ignore_eos"] = True
        elif kind < 0.5:
            sp["stop"] = (rng.choice(WORDS)[:2],)
        elif kind < 0.6:
            sp.update(temperature=0.9, seed=rng.randint(0, 99))
        elif kind < 0.7:
            sp["min_new_tokens"] = min(sp["max_new_tokens"], rng.randint(1, 5))
        elif kind < 0.75:
            sp["repetition_penalty"] = 1.2
        reqs.append((f"r{i}", prompt, SamplingParams(**sp), rng.randint(0, 12)))
    settings = rng.choice(SETTINGS)
    aborts = {rng.randint(0, 40): rng.randint(0, 9) for _ in range(rng.randint(0, 2))}
    return reqs, settings, aborts


def run_workload(mode: str, seed: int) -> dict[str, tuple]:
    """Step an engine through `random_workload(seed)`; checks after every step that the pools
    balance and that nothing follows a request's final output. Returns rid → (token ids,
    text, finish reason)."""
    reqs, settings, aborts = random_workload(seed)
    eng = make_engine(mode, **settings)
    processor = OutputProcessor(eng.tokenizer)  # text and stop strings, as the front door
    pending, live, got = list(reqs), set(), {}
    step = 0
    while pending or eng.has_work():
        for rid, prompt, sp, _ in [r for r in pending if r[3] <= step]:
            processor.add(rid, eng.tokenizer(prompt).input_ids, sp, stream=True)
            eng.add_request(GenerateRequest(rid=rid, text=prompt, sampling_params=sp,
                                            stream=True))
            live.add(rid)
        pending = [r for r in pending if r[3] > step]
        if step in aborts and live:
            eng.abort(sorted(live)[aborts[step] % len(live)])
        outputs, stopped = processor.process(eng.step())
        for rid in stopped:
            eng.abort(rid)
        for o in outputs:
            ids, text, reason = got.get(o.rid, ([], "", None))
            assert reason is None, f"{o.rid}: an output after its final one"
            got[o.rid] = (ids + o.new_token_ids, text + o.new_text,
                          o.finish_reason if o.finished else None)
            if o.finished:
                live.discard(o.rid)
        eng.check_invariant()
        step += 1
        assert step < 2000, "no progress"
    st = eng.stats()
    assert st["free_slots"] + st["evictable_slots"] == st["total_slots"]
    assert st["running"] == 0 and st["waiting"] == 0 and st["live"] == 0
    assert eng._num_reading_outputs == 0  # counted at admission, released with aborts too
    return got


@pytest.mark.parametrize("seed", [3, 5, 9, 17, 34, 45])
def test_random_workloads_overlap_equals_serial(seed):
    """Random arrivals, aborts, retraction, chunking: every request that was not aborted ends
    the same with and without the overlap (seed 34 once left a request ended by a stop string,
    after its batch was handed back, holding its slots)."""
    serial, overlap = run_workload("false", seed), run_workload("true", seed)
    assert serial.keys() == overlap.keys()
    for rid, result in serial.items():
        if FinishReason.ABORT not in (result[2], overlap[rid][2]):
            assert overlap[rid] == result, rid


def test_min_tokens_keeps_the_overlap():
    """min_tokens = max_tokens (how benchmarks fix output lengths): EOS stays masked for exactly
    min_tokens tokens with the token in flight counted, and every decode step overlaps."""
    sp = SamplingParams(max_new_tokens=20, min_new_tokens=20, temperature=0.0)
    serial = make_engine("false").generate(PROMPTS[:3], sp)
    eng = make_engine("true")
    overlapped = count_overlapped_batches(eng)
    got = eng.generate(PROMPTS[:3], sp)
    assert [r.token_ids for r in got] == [r.token_ids for r in serial]
    assert all(len(r.token_ids) == 20 for r in got)
    assert overlapped[0] >= 18  # 19 decodes after the prefill; the first has nothing in flight
