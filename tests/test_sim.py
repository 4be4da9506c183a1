"""Chapter 07: the serving-loop simulator keeps every memory invariant, on every workload."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvlab import InvalidArgument
from kvlab.alloc.paging import div_ceil
from kvlab.serving.sim import (WORKLOADS, RequestSpec, SimConfig, SimIntegrityError, Simulator, Workload,
                       make_workload, multi_turn_chat, shared_system_prompt, simulate)


def _check_timeline(tl, workload):
    """Independent checks on the recorded snapshots (the simulator also checks while running)."""
    P = tl.page_size
    for s in tl.steps:
        assert s.memory.total == tl.num_pages, f"step {s.step}: pages do not add up"
        assert len(set(s.free_pages)) == len(s.free_pages) == s.memory.free
        free = set(s.free_pages)
        cached = [p for node in s.tree.nodes for p in node.page_ids]
        assert len(set(cached)) == len(cached), f"step {s.step}: a page is in two cache nodes"
        assert not free & set(cached), f"step {s.step}: a cached page is also free"
        assert sum(len(n.page_ids) for n in s.tree.nodes) * P == s.cache_evictable + s.cache_protected
        for row, rid in enumerate(s.row_rids):
            mapped = s.page_table[row]
            if rid < 0:
                assert (mapped == -1).all(), f"step {s.step}: free row {row} still maps slots"
                continue
            slots = mapped[mapped >= 0]
            assert not free & set((slots // P).tolist()), f"step {s.step}: request {rid} maps a free page"
        if P == 1:
            assert s.wasted_slots == 0
        assert s.hit_tokens % P == 0  # only whole pages are ever matched
    last = tl.steps[-1]
    assert last.memory.in_use == 0 and last.cache_protected == 0
    assert last.memory.free + last.memory.cached_evictable == tl.num_pages
    assert all(rid == -1 for rid in last.row_rids)
    done = [r for s in tl.steps for r in s.finished + s.aborted]
    assert sorted(done) == list(range(len(workload))), "every request ends exactly once"
    for r in workload.requests:
        stats = tl.requests[r.rid]
        if stats.aborted:
            assert stats.generated == r.abort_after
        else:
            assert stats.generated == len(r.output)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_workload_runs_clean_at_each_page_size(name, page_size):
    w = make_workload(name, seed=3)
    tl = simulate(w, page_size=page_size, num_pages=max(div_ceil(w.max_total_len, page_size) * 3, 6))
    _check_timeline(tl, w)


@pytest.mark.parametrize("page_size", [1, 16])
def test_memory_pressure_evicts_and_preempts_but_stays_consistent(page_size):
    w = make_workload("shared_system_prompt", seed=2)
    tight = div_ceil(w.max_total_len, page_size) + 1   # barely more than one request alone
    tl = simulate(w, page_size=page_size, num_pages=tight)
    _check_timeline(tl, w)
    summary = tl.summary()
    assert summary.preemptions > 0 and summary.evicted_tokens > 0
    assert summary.peak_in_use_pages <= tight


@given(seed=st.integers(0, 10_000), name=st.sampled_from(sorted(WORKLOADS)),
       page_size=st.sampled_from([1, 16, 64]), slack=st.integers(1, 4),
       max_running=st.integers(1, 5), budget=st.sampled_from([8, 64, 1000]))
def test_random_workloads_and_configs_keep_invariants(seed, name, page_size, slack, max_running, budget):
    w = make_workload(name, seed=seed)
    pages = div_ceil(w.max_total_len, page_size) + slack
    tl = simulate(w, page_size=page_size, num_pages=pages, max_running=max_running,
                  prefill_budget=budget)
    _check_timeline(tl, w)


def test_runs_are_deterministic():
    w = make_workload("mixed", seed=5)
    a = simulate(w, page_size=4, num_pages=30)
    b = simulate(make_workload("mixed", seed=5), page_size=4, num_pages=30)
    assert a.series("free_pages") == b.series("free_pages")
    assert all(torch.equal(x.page_table, y.page_table) for x, y in zip(a.steps, b.steps))
    c = simulate(make_workload("mixed", seed=6), page_size=4, num_pages=30)
    assert a.series("free_pages") != c.series("free_pages")


def test_finer_pages_hit_more_of_a_shared_system_prompt():
    w = shared_system_prompt(seed=0, system_len=40, user_len=(4, 16))  # prompts of 44..56 tokens
    runs = {P: simulate(w, page_size=P, num_pages=4 * div_ceil(w.max_total_len, P) * len(w))
            for P in (1, 16, 64)}
    for P, whole_pages_of_system in [(1, 40), (16, 32), (64, 0)]:
        tl = runs[P]
        first = min(s.first_admit_step for s in tl.requests.values())
        later = [s for s in tl.requests.values() if s.first_admit_step > first]
        assert later, "some requests arrive after the first prefill"
        # every later request finds the system prompt, cut down to whole pages
        assert all(s.hit_tokens >= whole_pages_of_system for s in later)
        if P == 64:
            assert all(s.hit_tokens == 0 for s in later)  # no prompt holds a whole 64-page plus one
    summaries = {P: tl.summary() for P, tl in runs.items()}
    assert summaries[1].hit_tokens > summaries[16].hit_tokens > summaries[64].hit_tokens == 0
    assert summaries[1].mean_wasted_slots == 0 < summaries[16].mean_wasted_slots < summaries[64].mean_wasted_slots


def test_chat_turns_arrive_after_the_previous_turn_and_hit_its_history():
    w = multi_turn_chat(seed=1, n_conversations=2, turns=3, think_steps=2)
    tl = simulate(w, page_size=1, num_pages=400)
    for r in w.requests:
        if r.after is not None:
            prev = tl.requests[r.after]
            assert tl.requests[r.rid].arrival_step == prev.finish_step + 2
            # the whole previous prompt is cached; its answer only up to the last generated token
            assert tl.requests[r.rid].hit_tokens >= len(w.requests[r.after].prompt)


def test_aborted_requests_cache_nothing_and_free_their_pages():
    spec = RequestSpec(0, tuple(range(20)), tuple(range(10)), 0, abort_after=3)
    w = Workload("one abort", "", (spec,))
    tl = simulate(w, page_size=4, num_pages=10)
    assert tl.requests[0].aborted and tl.requests[0].generated == 3
    # the prompt was cached after prefill (5 whole pages), the rest went back to the free list
    assert tl[-1].cache_evictable == 20 and tl[-1].memory.free == 10 - 5


def test_a_broken_invariant_stops_the_run_naming_step_and_request():
    # two identical prompts prefilled in one batch: the second one's pages duplicate the
    # first one's; the source design frees them but leaves its row pointing at them
    prompt = tuple(range(100, 120))
    w = Workload("twins", "", (RequestSpec(0, prompt, (1, 2, 3), 0), RequestSpec(1, prompt, (4, 5, 6), 0)))
    _check_timeline(simulate(w, page_size=4, num_pages=20), w)  # kvlab's fix: clean
    with pytest.raises(SimIntegrityError, match=r"step 0, request 1: .*row 1") as err:
        simulate(w, page_size=4, num_pages=20, remap_duplicates=False)
    assert err.value.step == 0 and err.value.rid == 1


def test_tampering_with_the_free_list_is_caught_at_that_step():
    sim = Simulator(make_workload("random_prompts", seed=0), SimConfig(page_size=4, num_pages=40))
    for _ in range(3):
        sim.step()
    running = sim.manager.running[0]
    stolen = sim.page_table[running.table_idx, 0:1].to(torch.int32)  # a page the request uses
    sim.manager.free_slots = torch.cat([sim.manager.free_slots, stolen])
    with pytest.raises(SimIntegrityError, match=r"step 3, request \d+: .*free"):
        sim.step()


def test_triton_page_table_writer_gives_the_same_run():
    w = make_workload("few_shot", seed=4, n_requests=4)
    host = simulate(w, page_size=4, num_pages=40, page_table_writer="host")
    tri = simulate(w, page_size=4, num_pages=40, page_table_writer="triton")
    assert all(torch.equal(x.page_table, y.page_table) for x, y in zip(host.steps, tri.steps))


def test_bad_configs_and_workloads_are_rejected_up_front():
    w = make_workload("random_prompts", seed=0)
    with pytest.raises(InvalidArgument, match="must fit in memory alone"):
        Simulator(w, SimConfig(page_size=16, num_pages=1))
    with pytest.raises(InvalidArgument, match="page_size"):
        Simulator(w, SimConfig(page_size=0))
    with pytest.raises(InvalidArgument, match="max_seq_len"):
        Simulator(w, SimConfig(max_seq_len=4))
    with pytest.raises(InvalidArgument, match="name"):
        make_workload("nope")
    with pytest.raises(InvalidArgument, match="n_requests"):
        shared_system_prompt(n_requests=0)


# --- pictures and the explorer ---------------------------------------------------------


def test_explorer_slider_changes_the_picture_and_carries_a_png_fallback():
    import base64

    import matplotlib
    matplotlib.use("Agg")
    from kvlab.course.widgets import TimelineExplorer

    tl = simulate(make_workload("mixed", seed=0), page_size=4, num_pages=24)
    ex = TimelineExplorer(tl)
    assert "kvlab-timeline-slider" in ex.slider._dom_classes and ex.slider.description == "step"
    assert "kvlab-view" in ex.image._dom_classes
    first = ex.image.value
    busy = max(range(len(tl)), key=lambda i: (tl[i].page_table >= 0).sum())
    ex.show_step(busy)
    assert ex.image.value != first and ex.image.value[:4] == b"\x89PNG"
    assert f"step {busy}:" in ex.info.value
    for view in ("free list", "cache tree", "regions"):
        ex.show_step(busy, view)
        assert ex.image.value == ex.png(busy, view)
    bundle = ex._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert base64.b64decode(bundle["image/png"]) == ex.png()


def test_every_plot_draws_for_a_run_with_pressure():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlab.course.viz import dashboard as vs

    w = make_workload("mixed", seed=1)
    runs = {P: simulate(w, page_size=P, num_pages=div_ceil(w.max_total_len, P) + 2) for P in (1, 16, 64)}
    figs = [vs.timeline_dashboard(runs[16], step=3), vs.compare_page_sizes(runs)]
    figs += [vs.step_figure(runs[1], s, v) for v in vs.VIEWS for s in (0, len(runs[1]) // 2)]
    ax = vs.memory_over_time(runs[16])
    # the stacked memory areas add up to every page at every step
    tops = [max(p.get_paths()[0].vertices[:, 1]) for p in ax.collections]
    assert max(tops) == pytest.approx(runs[16].num_pages)
    with pytest.raises(ValueError, match="view"):
        vs.draw_step(runs[1], 0, "nope")
    plt.close("all")
    assert len(figs) == 2 + 2 * len(vs.VIEWS)


def test_explore_also_draws_static_steps_when_asked(monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlab.course.widgets import explore, static_widgets_wanted

    tl = simulate(make_workload("few_shot", seed=0, n_requests=3), page_size=4, num_pages=40)
    plt.close("all")
    monkeypatch.setenv("KVLAB_STATIC_WIDGETS", "0")
    assert not static_widgets_wanted()
    explore(tl, "free list")
    assert plt.get_fignums() == []           # only the widget (with its PNG fallback)
    monkeypatch.setenv("KVLAB_STATIC_WIDGETS", "1")
    ex = explore(tl, "free list", static_steps=[0, 1])
    assert len(plt.get_fignums()) == 1 and len(plt.gcf().axes) == 2
    assert ex.view.value == "free list"
    plt.close("all")


@given(seed=st.integers(0, 10_000), name=st.sampled_from(sorted(WORKLOADS)),
       page_size=st.sampled_from([1, 4, 16]), slack=st.integers(1, 4),
       max_running=st.integers(1, 5), budget=st.sampled_from([1, 5, 64]))
def test_chunked_prefill_keeps_invariants_and_the_token_budget(seed, name, page_size, slack,
                                                               max_running, budget):
    w = make_workload(name, seed=seed)
    pages = div_ceil(w.max_total_len, page_size) + slack
    tl = simulate(w, page_size=page_size, num_pages=pages, max_running=max_running,
                  prefill_budget=budget, chunked_prefill=True)
    _check_timeline(tl, w)
    assert all(s.prefill_tokens <= budget for s in tl.steps)


def test_a_chunked_prompt_keeps_its_row_and_decodes_only_after_its_last_chunk():
    w = make_workload("random_prompts", seed=4)            # no sharing: the same work either way
    whole = simulate(w, page_size=4, num_pages=200, prefill_budget=10**6)
    tl = simulate(w, page_size=4, num_pages=200, prefill_budget=6, chunked_prefill=True)
    _check_timeline(tl, w)
    assert whole.summary().prefill_tokens == tl.summary().prefill_tokens
    chunked = {rid for s in tl.steps for rid in s.chunked}
    assert chunked and all(s.prefill_tokens <= 6 for s in tl.steps)
    for rid in chunked:
        steps = [s for s in tl.steps if rid in s.row_rids]
        rows = {s.row_rids.index(rid) for s in steps}
        assert len(rows) == 1, f"request {rid} changed rows between chunks: {rows}"
        last_chunk = max(s.step for s in tl.steps if rid in s.chunked)
        assert all(s.step > last_chunk for s in tl.steps if rid in s.decoded)
    assert not simulate(w, page_size=4, num_pages=200, prefill_budget=6).steps[0].chunked
