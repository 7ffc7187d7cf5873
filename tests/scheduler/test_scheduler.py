"""Scheduler behaviour on hand-made schedules, driven by the model-free loop of sched_sim."""

from __future__ import annotations

import pytest
import torch
from sched_sim import Sim, expected_output

from mla_backend.forward_batch import ForwardMode
from mla_backend.mem_cache.radix_cache import RadixCache
from mla_backend.request import FinishReason, Req, SamplingParams
from mla_backend.scheduler.schedule_policy import PrefillAdder


def run_all(sim: Sim, max_steps: int = 500, on_step=None) -> list:
    batches = []
    for _ in range(max_steps):
        if not sim.sched.has_work():
            return batches
        if on_step is not None:
            on_step()
        b = sim.step()
        if b is not None:
            batches.append(b)
    raise AssertionError("no progress")


def sim_with(reqs: list[tuple[list[int], int]], **kw) -> tuple[Sim, list[Req]]:
    args = dict(radix=True, chunk=0, policy="lpm", pool_size=64, max_running=8,
                max_prefill=64)
    args.update(kw)
    sim = Sim(**args)
    out = [sim.make_req(f"r{i}", p, m) for i, (p, m) in enumerate(reqs)]
    for r in out:
        sim.sched.add_request(r)
    return sim, out


@pytest.mark.parametrize("radix", [True, False])
def test_extend_then_decode_fields(radix):
    sim, (a,) = sim_with([([3, 1, 4, 1, 5], 3)], radix=radix)
    b1 = sim.step()
    assert b1.forward_mode is ForwardMode.EXTEND
    assert b1.input_ids == [3, 1, 4, 1, 5] and b1.positions == [0, 1, 2, 3, 4]
    assert b1.prefix_lens == [0] and b1.extend_lens == [5] and b1.seq_lens == [5]
    assert b1.sample_mask == [True] and a.cached_tokens == 0
    b2 = sim.step()
    assert b2.forward_mode is ForwardMode.DECODE
    assert b2.input_ids == [a.output_ids[0]] and b2.positions == [5] and b2.seq_lens == [6]
    assert b2.prefix_lens == [5] and b2.extend_lens == [1]
    assert int(sim.r2t.req_to_token[a.req_pool_idx, 5]) == int(b2.out_cache_loc[0])
    run_all(sim)
    assert a.output_ids == expected_output([3, 1, 4, 1, 5], 3) and sim.drained()


def test_prefix_reuse_full_hit_recomputes_last_token():
    prompt = [7, 8, 9, 10, 11, 12]
    sim, (a,) = sim_with([(prompt, 2)])
    run_all(sim)
    b = sim.make_req("b", prompt, 2)
    c = sim.make_req("c", prompt[:4] + [40], 2)
    sim.sched.add_request(b)
    sim.sched.add_request(c)
    batch = sim.step()
    by_rid = dict(zip([r.rid for r in batch.reqs], zip(batch.prefix_lens, batch.extend_lens)))
    assert by_rid["b"] == (5, 1)  # full hit: the last prompt token is still computed
    assert by_rid["c"] == (4, 1)
    assert b.cached_tokens == 5 and c.cached_tokens == 4
    run_all(sim)
    assert b.output_ids == a.output_ids == expected_output(prompt, 2)
    assert c.output_ids == expected_output(prompt[:4] + [40], 2)
    assert sim.drained()


@pytest.mark.parametrize("radix", [True, False])
def test_chunked_prefill_masks_all_but_last_chunk(radix):
    prompt = list(range(1, 11))
    sim, (a, b) = sim_with([(prompt, 3), ([20, 21], 2)], radix=radix, chunk=4)
    batches = run_all(sim)
    extends = [bt for bt in batches if bt.forward_mode is ForwardMode.EXTEND]
    first = extends[0]
    assert first.reqs == [a] and first.extend_lens == [4] and first.sample_mask == [False]
    # chunked request continues first; b joins once a's chunk leaves budget
    assert [bt.extend_lens[0] for bt in extends[:3]] == [4, 4, 2]
    assert [bt.sample_mask[0] for bt in extends[:3]] == [False, False, True]
    assert [bt.prefix_lens[0] for bt in extends[:3]] == [0, 4, 8]
    assert a.output_ids == expected_output(prompt, 3)
    assert b.output_ids == expected_output([20, 21], 2)
    assert sim.drained()


@pytest.mark.parametrize("radix", [True, False])
def test_a_request_that_fits_a_whole_chunk_is_not_split_across_batches(radix):
    # chunk 8: a (5 tokens) leaves 3; b (6) would fit a chunk whole, so it waits and leads the
    # next batch uncut; c (12) could never fit one chunk, so it is cut to what b leaves (2).
    sim, (a, b, c) = sim_with([([1, 2, 3, 4, 5], 2), ([6, 7, 8, 9, 10, 11], 2),
                               (list(range(20, 32)), 2)], radix=radix, chunk=8)
    batches = run_all(sim)
    extends = [bt for bt in batches if bt.forward_mode is ForwardMode.EXTEND]
    assert [bt.reqs for bt in extends[:2]] == [[a], [b, c]]
    assert extends[0].extend_lens == [5] and extends[0].prefix_lens == [0]
    assert extends[1].extend_lens == [6, 2] and extends[1].prefix_lens == [0, 0]
    assert extends[1].sample_mask == [True, False]
    assert [bt.prefix_lens[0] for bt in extends[2:4]] == [2, 10]  # c's later chunks
    for req, prompt in ((a, [1, 2, 3, 4, 5]), (b, [6, 7, 8, 9, 10, 11]),
                        (c, list(range(20, 32)))):
        assert req.output_ids == expected_output(prompt, 2)
    assert sim.drained()


def test_chunk_kv_is_held_by_the_radix_tree_between_chunks():
    prompt = list(range(1, 10))
    sim, (a,) = sim_with([(prompt, 1)], chunk=4)
    sim.step()
    assert sim.sched.chunked_req is a and a.is_chunked
    tree = sim.tree
    assert isinstance(tree, RadixCache) and tree.protected_size() == 4
    assert sim.sched.num_running == 1 and sim.sched.num_waiting == 0
    run_all(sim)
    assert a.output_ids == expected_output(prompt, 1) and sim.drained()


def _check_victims(sim: Sim, log: list):
    """Wraps a step: records (victims, survivors) whenever a retraction happens."""
    before = list(sim.sched.running)
    outs = {r.rid: len(r.output_ids) for r in before}
    n = sim.sched.num_retractions

    def after():
        if sim.sched.num_retractions > n:
            victims = [r for r in before if r in sim.sched.waiting]
            survivors = [r for r in before if r not in victims]
            log.append(([r.rid for r in victims], [r.rid for r in survivors], outs))
    return after


@pytest.mark.parametrize("radix", [True, False])
def test_retraction_order_and_outputs(radix):
    # A and B are admitted together; C next step; all have 1 output when decode starts.
    specs = [([1, 2], 10), ([3, 4, 5, 6, 7, 8], 9), ([9, 10, 11], 10)]
    sim, reqs = sim_with(specs, radix=radix, pool_size=28, conservativeness=0.01)
    log: list = []
    for _ in range(300):
        if not sim.sched.has_work():
            break
        check = _check_victims(sim, log)
        sim.step()
        check()
    assert sim.sched.num_retractions >= 2 and log
    victims, survivors, outs = log[0]
    # equal outputs → longest prompt first; at least one request keeps running
    assert victims == ["r1", "r2"] and survivors == ["r0"]
    assert outs["r0"] == outs["r1"] == outs["r2"]
    for r, (p, m) in zip(reqs, specs):
        assert r.output_ids == expected_output(p, m), r.rid
    assert sim.drained()


@pytest.mark.parametrize("radix", [True, False])
def test_retraction_prefers_fewest_outputs(radix):
    specs = [([6, 7, 8], 12), ([10, 11], 12)]  # neither hits the fake EOS within 12 tokens
    sim, (a,) = sim_with(specs[:1], radix=radix, pool_size=22, conservativeness=0.01)
    for _ in range(3):
        sim.step()
    b = sim.make_req("r1", *specs[1])
    sim.sched.add_request(b)  # arrives when a has 3 outputs
    log: list = []
    for _ in range(300):
        if not sim.sched.has_work():
            break
        check = _check_victims(sim, log)
        sim.step()
        check()
    assert log, "expected a retraction"
    victims, survivors, outs = log[0]
    assert victims == ["r1"] and survivors == ["r0"] and outs["r1"] < outs["r0"]
    assert a.output_ids == expected_output(*specs[0]) and b.output_ids == expected_output(*specs[1])
    assert sim.drained()


def test_abort_waiting_running_and_inflight():
    sim, (a, b, c) = sim_with([([1, 2, 3], 8), ([4, 5], 8), ([6, 7, 8], 8)], max_running=2,
                              rows=2)
    sim.step()  # a, b admitted; c waits (max_running)
    assert sim.sched.num_waiting == 1 and sim.sched.num_running == 2
    got = sim.sched.abort_request("r2")
    assert got is c and c.finished_reason is FinishReason.ABORT and sim.sched.num_waiting == 0
    assert sim.sched.abort_request("r2") is None and sim.sched.abort_request("zz") is None
    # running: marked, released at the next boundary, exactly once
    assert sim.sched.abort_request("r0") is a and sim.sched.abort_request("r0") is None
    sim.sched.check_invariant()
    batch = sim.sched.get_next_batch()
    assert a not in batch.reqs and a.req_pool_idx is None
    # abort while b's batch is in flight: released in process_batch_result
    assert sim.sched.abort_request("r1") is b
    assert b.req_pool_idx is not None
    sim.sched.process_batch_result(batch, sim.run(batch))
    sim.sched.check_invariant()
    assert b.req_pool_idx is None and not sim.sched.has_work() and sim.drained()
    assert a.output_ids == expected_output([1, 2, 3], 8)[:len(a.output_ids)]


def test_abort_of_inflight_chunked_request():
    sim, (a, b) = sim_with([(list(range(1, 13)), 2), ([30, 31], 2)], chunk=4)
    sim.step()
    assert sim.sched.chunked_req is a
    sim.sched.abort_request("r0")
    run_all(sim)
    assert sim.sched.chunked_req is None and a.req_pool_idx is None
    assert b.output_ids == expected_output([30, 31], 2) and sim.drained()


def test_prompt_that_can_never_fit_is_rejected_not_blocking():
    sim, (big, small) = sim_with([(list(range(1, 30)), 2), ([5, 6], 2)], pool_size=16)
    run_all(sim)
    rejected = sim.sched.take_rejected()
    assert rejected == [big] and big.finished_reason is FinishReason.ABORT
    assert big.output_ids == [] and sim.sched.take_rejected() == []
    assert small.output_ids == expected_output([5, 6], 2) and sim.drained()


def test_lone_request_whose_reservation_does_not_fit_still_runs():
    # prompt 10 + max_new 10 > pool 15: admitted alone, finished LENGTH when the pool is full
    sim, (a,) = sim_with([(list(range(1, 11)), 10)], pool_size=15)
    run_all(sim)
    assert sim.sched.take_rejected() == [a] and a.finished_reason is FinishReason.LENGTH
    assert a.output_ids == expected_output(list(range(1, 11)), 10)[:len(a.output_ids)]
    assert len(a.output_ids) == 6 and sim.drained()  # 15 slots: 10 prompt + 5 decoded


@pytest.mark.parametrize("policy,first", [("lpm", "r1"), ("fcfs", "r0")])
def test_policy_orders_admission(policy, first):
    shared = [9, 9, 8, 8, 7, 7]
    sim, _ = sim_with([], policy=policy)
    warm = sim.make_req("w", shared + [1], 1)
    sim.sched.add_request(warm)
    run_all(sim)
    r0 = sim.make_req("r0", [50, 51, 52], 1)
    r1 = sim.make_req("r1", shared + [2], 1)
    sim.sched.add_request(r0)
    sim.sched.add_request(r1)
    batch = sim.step()
    assert batch.reqs[0].rid == first and len(batch.reqs) == 2


def test_check_invariant_detects_a_leak():
    sim, _ = sim_with([([1, 2, 3], 2)])
    sim.step()
    leaked = sim.alloc.alloc(2)
    with pytest.raises(AssertionError, match="pool size"):
        sim.sched.check_invariant()
    sim.alloc.free(leaked)
    sim.sched.check_invariant()


def test_prefill_adder_reserves_running_outputs_by_ratio():
    sim, _ = sim_with([])
    running = [Req(rid="x", origin_input_ids=[1], sampling_params=SamplingParams(
        max_new_tokens=100), output_ids=[5] * 20)]
    adder = PrefillAdder(sim.tree, running, 0.5, 64, 30, 0)
    assert adder.rem_total_tokens == pytest.approx(64 - 80 * 0.5)
    req = sim.make_req("n", [1, 2, 3, 4], 20)
    sim.sched._prepare(req)
    assert adder.add_one_req(req).name == "NO_TOKEN"  # 4 + 20 >= 24
    req2 = sim.make_req("m", [1, 2, 3, 4], 19)
    sim.sched._prepare(req2)
    assert adder.add_one_req(req2).name == "ADDED"
    assert adder.rem_total_tokens == pytest.approx(24 - 23) and adder.rem_input_tokens == 26
    assert adder.can_run_list == [req2] and adder.new_chunked_req is None


def test_prefill_adder_reservation_clips_each_request():
    """Each running request reserves min(max_new - generated, 4096) outputs, never below 0:
    one past its max_new_tokens (possible while its last token is in flight) reserves none."""
    sim, _ = sim_with([])
    running = [Req(rid=str(i), origin_input_ids=[1], sampling_params=SamplingParams(
        max_new_tokens=max_new), output_ids=[5] * n_out)
        for i, (max_new, n_out) in enumerate([(100, 20), (10_000, 10), (4, 4), (3, 5)])]
    adder = PrefillAdder(sim.tree, running, 0.25, 10_000, 30, 0)
    assert adder.rem_total_tokens == pytest.approx(10_000 - (80 + 4096 + 0 + 0) * 0.25)


def test_get_next_batch_requires_processing_the_previous_one():
    sim, _ = sim_with([([1, 2], 2)])
    batch = sim.sched.get_next_batch()
    with pytest.raises(RuntimeError):
        sim.sched.get_next_batch()
    with pytest.raises(ValueError):
        sim.sched.process_batch_result(batch, [])
    assert isinstance(batch.out_cache_loc, torch.Tensor)


def test_failed_batch_discards_its_kv_but_keeps_earlier_kv():
    prompt = [1, 2, 3, 4, 5, 6]
    sim, (a,) = sim_with([(prompt, 3)])
    batch = sim.sched.get_next_batch()  # the forward "raises": no KV is written
    sim.sched.process_batch_result(batch, [False], failed=True)
    sim.sched.check_invariant()
    assert a.finished_reason is FinishReason.ABORT and sim.tree.total_size() == 0
    assert sim.drained()
    b = sim.make_req("b", prompt, 3)
    sim.sched.add_request(b)
    run_all(sim)  # would read unwritten KV if the failed batch's slots had been cached
    assert b.output_ids == expected_output(prompt, 3)
    c = sim.make_req("c", [20, 21, 22], 5)
    sim.sched.add_request(c)
    sim.step()
    sim.step()  # extend + one decode: KV of 4 tokens
    batch = sim.sched.get_next_batch()
    assert batch.forward_mode is ForwardMode.DECODE and batch.reqs == [c]
    sim.sched.process_batch_result(batch, [False], failed=True)
    sim.sched.check_invariant()
    toks = c.origin_input_ids + c.output_ids
    assert sim.tree.match_prefix(toks).device_indices.numel() == 4 and sim.drained()


def test_prefill_min_free_rows_batches_admissions():
    """With prefill_min_free_rows 2, a request waiting behind a full batch is admitted only
    once 2 rows are free (one finished request alone does not start a prefill), unless every
    waiting request fits; outputs are unchanged."""
    reqs = [([1, 2, 3], 2), ([4, 5], 4), ([6, 7, 8], 12), ([9, 1], 12),
            ([2, 2, 3], 3), ([3, 4], 3), ([5, 6, 7], 3)]
    for min_free in (1, 2):
        sim, out = sim_with(reqs, max_running=4, pool_size=256, min_free_rows=min_free)
        sizes = [b.batch_size for b in run_all(sim) if b.forward_mode is ForwardMode.EXTEND]
        # 1: r0 finishes first and r4 is admitted alone; 2: held until r1 also finishes, then
        # r4 + r5 together, then r6 (the last waiting request fits one free row)
        if min_free == 2:
            assert sizes == [4, 2, 1], sizes
        else:
            assert sizes[0] == 4 and sizes[1] == 1, sizes
        for (p, m), r in zip(reqs, out):
            assert r.output_ids == expected_output(p, m)
        assert sim.drained()


def test_prefill_hold_is_bounded():
    """A request held back by prefill_min_free_rows is admitted after at most
    PREFILL_MAX_DELAY_STEPS decode steps even if the rows never free up."""
    from mla_backend.scheduler.scheduler import PREFILL_MAX_DELAY_STEPS

    n = PREFILL_MAX_DELAY_STEPS + 40
    reqs = [([1, 2], 1), ([3, 4], n), ([5, 6], n), ([7, 8], 2), ([9, 9], 2)]
    sim, out = sim_with(reqs, max_running=3, pool_size=1024, min_free_rows=3)
    decode_steps = 0
    admitted_at = None
    for _ in range(1000):
        if not sim.sched.has_work():
            break
        b = sim.step()
        if b is None:
            continue
        if b.forward_mode is ForwardMode.DECODE:
            decode_steps += 1
        elif out[3] in b.reqs and admitted_at is None:
            admitted_at = decode_steps
    assert admitted_at is not None and 1 <= admitted_at <= PREFILL_MAX_DELAY_STEPS + 2
    assert [r.output_ids for r in out] == [expected_output(p, m) for p, m in reqs]
    assert sim.drained()


def test_overlap_schedule_next_decode_while_one_is_outstanding():
    """The engine's overlap schedule: a DECODE batch is built while the previous one is still
    outstanding (its tokens in flight); results are processed oldest first, a request that
    finished with the older batch is released once."""
    sim, (a, b) = sim_with([([1, 2, 3], 8), ([4, 5], 2)], radix=False)
    assert sim.step().is_extend()  # both prefilled: one output token each
    n1 = sim.sched.get_next_batch()
    assert n1.is_decode() and n1.future_rows == []
    sim2, _ = sim_with([([1, 2], 2)])
    assert sim2.sched.get_next_batch().is_extend()
    with pytest.raises(RuntimeError):  # an EXTEND may not be outstanding; a DECODE one may
        sim2.sched.get_next_batch()
    for r in n1.reqs:
        r.num_inflight_tokens = 1
    n2 = sim.sched.get_next_batch()  # b's in-flight token is its last (max 2): left out
    assert n2.reqs == [a] and n2.future_rows == [0]
    assert n2.seq_lens == [a.seqlen + 1] and n2.positions == [a.seqlen]
    sim.sched.check_invariant()
    with pytest.raises(RuntimeError):
        sim.sched.get_next_batch()
    with pytest.raises(ValueError):  # oldest first
        sim.sched.process_batch_result(n2, [False])
    # n1's results: both tokens appended, b finished by length and released now
    for r in n1.reqs:
        r.num_inflight_tokens = 0
    finished = []
    for r in n1.reqs:
        r.output_ids.append(7)
        if len(r.output_ids) >= r.sampling_params.max_new_tokens:
            r.finished_reason = FinishReason.LENGTH
        finished.append(r.finished())
    assert finished == [False, True]
    sim.sched.process_batch_result(n1, finished)
    sim.sched.check_invariant()
    assert sim.sched.num_running == 1
    # a ends (as by EOS) with n2's token: n2 is processed with it finished, released once
    a.finished_reason = FinishReason.STOP
    sim.sched.process_batch_result(n2, [True])
    sim.sched.check_invariant()
    assert sim.sched.get_next_batch() is None and sim.drained()
