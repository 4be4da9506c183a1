"""Chapter 13's measurements: the tier simulator (``kvlab.serving.sim.tier_sim``) and its
conversations, and ``python -m kvlab.bench --hierarchy`` (a smoke run of the real code path on
the CPU, its claims judged from rows)."""
from __future__ import annotations

import json

import pytest

from kvlab.base.errors import InvalidArgument
from kvlab.bench import hierarchy as hb
from kvlab.bench.hierarchy_claims import claims
from kvlab.serving.sim.conversations import ChatPlan, chat_turns, working_set
from kvlab.serving.sim.tier_sim import (H200_HOST, NVME_DISK, HierarchyConfig, TierModel,
                                         simulate_hierarchy, summary)

PLAN = ChatPlan(conversations=6, turns=4, first=(40, 120), question=(8, 30), answer=(4, 10), history_cap=400)


def test_conversations_come_back_after_all_the_others():
    turns = chat_turns(PLAN)
    assert turns == chat_turns(PLAN), "seeded"
    for index in range(1, PLAN.turns):
        earlier = [t.conversation for t in turns if t.index == index - 1]
        now = [t.conversation for t in turns if t.index == index]
        assert set(now) <= set(earlier) and len(now) == len(set(now)), "one turn each per round"
    assert working_set(turns) == sum(len(t.message) + t.answer_len for t in turns)
    with pytest.raises(InvalidArgument, match="plan.first"):
        ChatPlan(first=(10, 2))
    with pytest.raises(InvalidArgument, match="plan.turns"):
        ChatPlan(turns=0)


def test_the_simulator_orders_the_hierarchies_as_the_chapter_says():
    turns = chat_turns(PLAN)
    pages = working_set(turns) // 4 // 4
    kw = dict(page_size=4, page_bytes=4096)
    gpu = summary(simulate_hierarchy(turns, HierarchyConfig(pages, **kw)))
    host = summary(simulate_hierarchy(turns, HierarchyConfig(pages, H200_HOST._replace(pages=4 * pages),
                                                            write_policy="write_through", **kw)))
    disk = summary(simulate_hierarchy(turns, HierarchyConfig(pages, H200_HOST._replace(pages=2 * pages),
                                                            NVME_DISK, write_policy="write_through", **kw)))
    ceiling = summary(simulate_hierarchy(turns, HierarchyConfig(8 * pages, **kw)))
    assert gpu["hit"] < host["hit"] <= ceiling["hit"] and disk["hit"] >= host["hit"] * 0.95
    assert host["computed"] < gpu["computed"] and host["h2d_bytes"] > 0 and gpu["h2d_bytes"] == 0
    assert disk["disk_hit"] > 0 and disk["disk_read_bytes"] > 0
    assert host["ttft_p50"] < gpu["ttft_p50"], "a load-back at 52.7 GB/s beats a prefill at 40k tokens/s"
    assert abs(host["hit"] - host["device_hit"] - host["host_hit"] - host["disk_hit"]) < 1e-12


def test_the_simulator_refuses_a_bad_machine():
    with pytest.raises(InvalidArgument, match="config.disk"):
        HierarchyConfig(16, None, NVME_DISK)
    with pytest.raises(InvalidArgument, match="config.host"):
        HierarchyConfig(16, TierModel(0, 1.0, 1.0))
    with pytest.raises(InvalidArgument, match="config.device_pages"):
        HierarchyConfig(1)
    assert H200_HOST.seconds(0) == 0.0 and H200_HOST.seconds(52_700_000) == pytest.approx(1e-3 + 9e-6)


def _rows(**over):
    base = dict(hit=0.8, computed=1000, ttft_p50=0.1, load_gbps=45.0)
    rows = [dict(config="unbounded", **base), dict(config="GPU only", **dict(base, hit=0.1, computed=9000, ttft_p50=0.5))]
    rows += [dict(config=f"+ host {p}", **base) for p in hb.POLICIES]
    rows += [dict(config="second process, warm disk", computed=100, disk_hit=0.8),
             dict(config="second process, cold disk", computed=900, disk_hit=0.0)]
    for r in rows:
        r.update(over.get(r["config"], {}))
    return rows


def test_claims_pass_and_fail_on_the_numbers():
    res = dict(smoke=False, rows=_rows(), pinned=dict(h2d_gbps=52.0), decode=dict(ratio=1.02))
    judged = [c for c in claims(res) if not c["rule"].startswith("reported")]
    assert len(judged) == 7 and all(c["passed"] for c in judged)
    res = dict(smoke=False, rows=_rows(**{"+ host write_back": dict(hit=0.5, load_gbps=30.0)}),
               pinned=dict(h2d_gbps=52.0), decode=dict(ratio=1.2))
    failed = [c["name"] for c in claims(res) if c["passed"] is False]
    assert any("write_back" in n for n in failed) and any("bandwidth" in n for n in failed)
    assert any("decode step" in n for n in failed)
    res = dict(smoke=True, rows=_rows(), pinned=dict(h2d_gbps=None), decode={})
    assert all(c["passed"] is None for c in claims(res))


@pytest.mark.slow
def test_the_smoke_run_serves_every_configuration_and_a_second_process(tmp_path):
    pytest.importorskip("transformers")
    from kvlab.bench.__main__ import hierarchy_main

    (tmp_path / "bench.json").write_text(json.dumps({"kept": 1}))
    res = hierarchy_main(str(tmp_path), smoke=True)
    h = res["hierarchy"]
    assert json.loads((tmp_path / "bench.json").read_text())["kept"] == 1
    assert not h["errors"] and [r["config"] for r in h["rows"]][:2] == ["unbounded", "GPU only"]
    by = {r["config"]: r for r in h["rows"]}
    assert "error" not in by["second process, warm disk"], by["second process, warm disk"]
    assert by["second process, warm disk"]["disk_hit"] > 0 == by["second process, cold disk"]["disk_hit"]
    assert all(c["passed"] is None for c in h["claims"])
    md = (tmp_path / "bench.md").read_text()
    assert "A KV hierarchy" in md and "Smoke run" in md and "PASS" not in md
    assert (tmp_path / "13_bench_hierarchy.png").stat().st_size > 0


def test_the_gpu_runs_model_holds_the_longest_history_and_its_answer():
    """Every prompt (a whole history and its new message) plus its answer fits the positions of
    the model the GPU run builds (its 0.5B shape alone has 4096: a 16k history did not fit)."""
    plan, turns, _ = hb._plan(smoke=False)
    history: dict[int, int] = {}
    longest = 0
    for t in turns:
        prompt = history.get(t.conversation, 0) + len(t.message)
        longest = max(longest, prompt + t.answer_len)
        history[t.conversation] = prompt + t.answer_len
    assert longest > 4096, "the chats outgrow the base shape's positions (the case this guards)"
    assert longest <= hb._positions(plan, smoke=False)
    assert hb._positions(plan, smoke=True) is None
