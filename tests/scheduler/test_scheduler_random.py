"""Randomized schedules: shared prefixes, random arrivals and aborts, a tiny pool that forces
eviction and retraction. After every step the slot accounting holds; at the end everything is
free; every request that was not aborted produced exactly what the fake model generates alone."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_sim import VOCAB, Sim, expected_output


@st.composite
def scenarios(draw, stress: bool = False):
    """stress: near-simultaneous arrivals, optimistic admission → frequent retraction."""
    n_bases = draw(st.integers(1, 3))
    bases = [draw(st.lists(st.integers(1, VOCAB - 1), min_size=2, max_size=14))
             for _ in range(n_bases)]
    n_reqs = draw(st.integers(3 if stress else 1, 8))
    reqs = []
    for _ in range(n_reqs):
        base = bases[draw(st.integers(0, n_bases - 1))]
        keep = draw(st.integers(0, len(base)))
        suffix = draw(st.lists(st.integers(1, VOCAB - 1), min_size=0 if keep else 1,
                               max_size=6))
        prompt = base[:keep] + suffix
        arrive = draw(st.integers(0, 3 if stress else 6))
        reqs.append((arrive, prompt, draw(st.integers(1, 12))))
    need = max(len(p) + m for _, p, m in reqs)
    pool = draw(st.integers(need, need + 8 if stress else need * 2))
    aborts = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, n_reqs - 1)),
                           max_size=3))
    cfg = dict(
        radix=draw(st.booleans()),
        chunk=draw(st.sampled_from([0, 3, 8])),
        policy=draw(st.sampled_from(["lpm", "fcfs"])),
        pool_size=pool,
        max_running=draw(st.integers(3 if stress else 1, 6)),
        max_prefill=draw(st.integers(4, 12 if stress else 40)),
        rows=draw(st.integers(4 if stress else 1, 8)),
        append_for_aborted=draw(st.booleans()),
        conservativeness=0.01 if stress else draw(st.sampled_from([1.0, 0.01])),
    )
    return cfg, reqs, aborts


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_schedules_keep_invariant_and_outputs(scenario):
    run_scenario(scenario)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(stress=True))
def test_random_schedules_under_memory_pressure(scenario):
    run_scenario(scenario)


def run_scenario(scenario) -> Sim:
    cfg, specs, aborts = scenario
    sim = Sim(**cfg)
    reqs = [sim.make_req(f"r{i}", p, m) for i, (_, p, m) in enumerate(specs)]
    aborted: set[str] = set()
    step = 0
    while True:
        for i, (arrive, _, _) in enumerate(specs):
            if arrive == step:
                sim.sched.add_request(reqs[i])
        for at, i in aborts:
            if at == step and sim.sched.abort_request(reqs[i].rid) is not None:
                aborted.add(reqs[i].rid)
        sim.sched.check_invariant()
        sim.step()
        assert sim.sched.take_rejected() == [], "every request fits the pool alone"
        step += 1
        if step > max(a for a, _, _ in specs) and not sim.sched.has_work():
            break
        assert step < 2000, "scheduler made no progress"
    assert sim.drained(), (sim.alloc.available_size(), sim.tree.evictable_size(),
                           sim.tree.protected_size(), sim.r2t.available_size())
    for req, (_, prompt, max_new) in zip(reqs, specs):
        want = expected_output(prompt, max_new)
        if req.rid in aborted:
            assert req.output_ids == want[:len(req.output_ids)]
        else:
            assert req.output_ids == want, req.rid
            assert req.finished()
    return sim
