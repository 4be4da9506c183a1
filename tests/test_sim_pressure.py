"""Chapter 12 on the simulator: every memory policy keeps every page accounted for, after every
step and through injected failures, and each does what its engine does."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import kvlab.serving.sim.make_room as sim_room
from kvlab import CacheManager
from kvlab.alloc.paging import div_ceil
from kvlab.serving.pressure import CHAPTER_07, POLICIES, RetractDecode, SwapToHost
from kvlab.serving.sim import SimConfig, Simulator, make_workload, simulate
from kvlab.serving.sim.caches import free_page_ids

from faults import Boom, Interrupted, failing, interrupt_at_line, patched
from test_sim import _check_timeline

PRESSURED = ("eos_long_tail", "long_prompt_burst", "shared_system_prompt", "multi_turn_chat", "mixed")


def tight(w, P, slack=2):
    return max(div_ceil(r.max_len, P) for r in w.requests) + slack


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("name", PRESSURED)
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_keeps_every_invariant_under_pressure(policy, name, page_size):
    w = make_workload(name, seed=1)
    tl = simulate(w, page_size=page_size, num_pages=tight(w, page_size), policy=policy, max_running=6)
    _check_timeline(tl, w)
    s = tl.summary()
    assert tl.policy == policy
    if policy == "reserve":
        assert s.preemptions == 0 and s.recomputed_tokens == 0 and s.swapped_tokens == 0
    if policy in ("recompute", "swap"):
        assert all(r.promised_pages == 0 for r in tl.steps)   # they promise only the coming step
    if policy == "swap":
        assert tl.steps[-1].host_pages == 0 and not tl.steps[-1].swapped
        assert sum(r.swap_in_tokens for r in tl.steps) <= s.swapped_tokens
    for r in tl.requests.values():
        if not r.aborted:
            assert r.first_token_step >= r.first_admit_step >= r.arrival_step >= 0 and r.ttft >= 1


def test_optimistic_admission_runs_more_requests_at_once_than_whole_reservations():
    w = make_workload("eos_long_tail", seed=0, n_requests=24, mean_gap=0.5)
    pages = tight(w, 4, slack=8)
    runs = {p: simulate(w, page_size=4, num_pages=pages, policy=p, max_running=8).summary()
            for p in POLICIES}
    assert runs["recompute"].mean_running > runs["reserve"].mean_running
    assert runs["recompute"].steps < runs["reserve"].steps
    assert runs["reserve"].mean_promised_pages > runs["retract"].mean_promised_pages > 0


def test_preempted_requests_leave_and_come_back_with_everything_they_generated():
    w = make_workload("shared_system_prompt", seed=2)
    tl = simulate(w, page_size=4, num_pages=tight(w, 4), policy="recompute")
    stopped = {rid for s in tl.steps for rid in s.preempted}
    resumed = {rid for s in tl.steps for rid in s.resumed}
    assert stopped and stopped == resumed
    for rid in stopped:
        left = min(s.step for s in tl.steps if rid in s.preempted)
        back = min(s.step for s in tl.steps if rid in s.resumed and s.step >= left)
        assert back > left or back == left  # vLLM: nobody is admitted in the step that preempted
        assert tl.requests[rid].generated == len(w.requests[rid].output)
    assert all(not set(s.admitted) & set(s.preempted) for s in tl.steps)


def test_recompute_keeps_the_victims_pages_in_the_cache_and_chapter_07_does_not():
    w = make_workload("shared_system_prompt", seed=2)
    pages = tight(w, 4)
    kept = simulate(w, page_size=4, num_pages=pages, policy="recompute").summary()
    released = simulate(w, page_size=4, num_pages=pages).summary()   # chapter 07's policy
    assert kept.preemptions and released.preemptions
    assert kept.recomputed_tokens / kept.preemptions < released.recomputed_tokens / released.preemptions


def test_the_retract_ratio_decays_jumps_after_a_retraction_and_resets_when_idle():
    policy = RetractDecode(decay_steps=20)
    w = make_workload("random_prompts", seed=0, n_requests=20, mean_gap=0.5, output_len=(20, 40))
    tl = simulate(w, page_size=4, num_pages=tight(w, 4, slack=4), policy=policy, max_running=8)
    ratios = [s.ratio for s in tl.steps]
    jumps = [i for i, s in enumerate(tl.steps) if s.preempted]
    assert jumps, "no retraction: the test's pool is too large"
    for i in range(1, len(ratios)):
        if i in jumps:
            assert ratios[i] > ratios[i - 1]                   # it recovers
        elif tl.steps[i].decoded:
            assert ratios[i] == pytest.approx(max(ratios[i - 1] - policy.decay, policy.min_ratio))
    assert min(ratios) == pytest.approx(policy.min_ratio)
    idle = simulate(make_workload("few_shot", seed=0, n_requests=2, mean_gap=30), num_pages=40,
                    policy=policy)
    quiet = [s for s in idle.steps if not (s.decoded or s.admitted) and all(r < 0 for r in s.row_rids)]
    assert quiet and all(s.ratio == policy.init_ratio for s in quiet)


def test_a_host_pool_too_small_falls_back_to_recompute():
    w = make_workload("shared_system_prompt", seed=2)
    tl = simulate(w, page_size=4, num_pages=tight(w, 4), policy=SwapToHost(host_pages=2))
    _check_timeline(tl, w)
    assert max(s.host_pages for s in tl.steps) <= 2
    assert tl.summary().preemptions > sum(len(s.swapped_in) for s in tl.steps)


# --- a state machine: every policy, injected failures, no page lost or owned twice ---------------


def assert_pages_conserved(sim):
    """Each page is free, cached or mapped by exactly one running row (the sim's own check too)."""
    sim.check()
    m, P = sim.manager, sim.config.page_size
    free = list(free_page_ids(m))
    cached = [p for node in sim.cache.snapshot().nodes for p in node.page_ids]   # the radix tree
    private = []
    for req in m.running:
        handle = req.cache_handle.cached_len if req.cache_handle is not None else 0
        row = m.page_table[req.table_idx, handle: m.allocated_pages(req) * P]
        private += [int(s) // P for s in row[::P]]
    owned = free + cached + private
    assert {id(r) for r in m.running} == {id(live.req) for live in sim._running.values()}, \
        "the manager holds a request the simulator does not know of (or the other way round)"
    assert len(owned) == len(set(owned)), "a page is in two places"
    assert sorted(owned) == list(range(m.num_pages)), "a page was lost"


#: the policies that stop requests (retract with a fast decay: it retracts in short runs too)
MACHINE_POLICIES = ["recompute", RetractDecode(decay_steps=10), "swap", CHAPTER_07]


class PolicyMachine(RuleBasedStateMachine):
    """Steps a pressured run; some steps fail inside the policy's manager calls (an error before
    the call does anything, or an interrupt at any line inside it). The failed step is retried."""

    @initialize(policy=st.sampled_from(MACHINE_POLICIES), name=st.sampled_from(PRESSURED[:3]),
                page_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 50), slack=st.integers(0, 2))
    def start(self, policy, name, page_size, seed, slack):
        self.w = make_workload(name, seed=seed)
        self.sim = Simulator(self.w, SimConfig(page_size=page_size, max_running=6, policy=policy,
                                               num_pages=tight(self.w, page_size, slack)))

    @rule()
    def step(self):
        if not self.sim.done:
            self.sim.step()

    @rule(where=st.sampled_from(["release_req", "cache_req", "admit", "allocate_paged"]),
          k=st.integers(0, 1), line=st.integers(0, 12))
    def steps_until_the_policy_fails(self, where, k, line):
        """Arm ``manager.<where>`` inside the room's stop / restore only, and step until its
        ``k``-th call there (or the end): that call fails (``line`` 0: before it starts; else an
        interrupt at that line of the manager's method, which it must take back)."""
        manager = self.sim.manager
        calls = [0]
        original = getattr(manager, where)

        def armed(*args, **kwargs):
            n = calls[0]
            calls[0] += 1
            if n != k:
                return original(*args, **kwargs)
            if line == 0:
                return failing(original, 0)(*args, **kwargs)
            with interrupt_at_line(getattr(CacheManager, where), line):
                return original(*args, **kwargs)

        def inside_room(fn):
            def wrapped(*args, **kwargs):
                with patched(manager, where, armed):
                    return fn(*args, **kwargs)
            return wrapped

        with patched(sim_room, "stop_request", inside_room(sim_room.stop_request)), \
                patched(sim_room, "restore_request", inside_room(sim_room.restore_request)):
            while not self.sim.done and calls[0] <= k:
                try:
                    self.sim.step()
                except (Boom, Interrupted):
                    event(f"{self.sim.room.run.name}: a step failed in {where}, line {line}")
                    break
                assert_pages_conserved(self.sim)

    @invariant()
    def no_page_lost_or_owned_twice(self):
        if hasattr(self, "sim"):
            assert_pages_conserved(self.sim)

    def teardown(self):
        if not hasattr(self, "sim"):
            return
        self.sim.run()
        assert_pages_conserved(self.sim)
        m = self.sim.manager
        assert m.running == [] and m.available_pages == m.num_pages
        for r in self.w.requests:
            stats = self.sim.timeline.requests[r.rid]
            assert stats.aborted or stats.generated == len(r.output), f"request {r.rid} lost tokens"


TestPolicyMachine = PolicyMachine.TestCase
TestPolicyMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
