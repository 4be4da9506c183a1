"""Chapter 12 as measured: a workload where SGLang's estimate runs short, the side-by-side table
at a notebook's width, and sentences about the GPU run that are read from ``figures/bench.json``
(never an order written from memory)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvlab.base.errors import InvalidArgument
from kvlab.course.scenes import ch12_memory as ch12
from kvlab.serving.sim import make_workload
from kvlab.serving.sim.compare import policy_table

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "notebooks" / "src" / "12_when_memory_runs_out.py"


def _bench(speeds: dict, workload: str = "eos_long_tail", pool: str = "tight", **extra) -> dict:
    rows = [{**dict(workload=workload, pool=pool, policy=p, tokens_per_s=v, stops=0, recomputed_tokens=0,
                    retractions=0), **extra.get(p, {})} for p, v in speeds.items()]
    return {"rows": rows + [dict(workload=workload, pool=pool, policy="swap", error="skipped")]}


@pytest.mark.parametrize("speeds, place", [
    (dict(reserve=822.0, recompute=1402.0, retract=699.0), "below both reserve and recompute"),
    (dict(reserve=800.0, recompute=1400.0, retract=1000.0), "between reserve and recompute"),
    (dict(reserve=942.0, recompute=459.0, retract=989.0), "above both recompute and reserve"),
    (dict(reserve=900.0, recompute=1400.0, retract=1500.0), "above both reserve and recompute"),
])
def test_where_retract_sits_is_read_from_the_rows(speeds, place):
    sentence = ch12.where_retract_sits(_bench(speeds))
    assert place in sentence and f"retract served {speeds['retract']:.0f} tokens/s" in sentence
    assert ch12.tokens_order(_bench(speeds), "eos_long_tail", "tight")[0][1] == max(speeds.values())


def test_a_run_without_the_rows_says_so_instead_of_an_order():
    assert "holds no rows" in ch12.where_retract_sits(_bench(dict(reserve=1.0, recompute=2.0)))
    assert "holds no rows" in ch12.retraction_cost({"rows": []})
    cost = ch12.retraction_cost(_bench(dict(reserve=800.0, recompute=1200.0, retract=600.0), "long_answers",
                                       retract=dict(retractions=3, recomputed_tokens=420)))
    assert "retracted 3 time(s)" in cost and "420 positions again" in cost and "reserve's 800" in cost


def test_the_chapter_states_no_gpu_order_of_its_own_and_prints_the_recorded_one():
    text = CHAPTER.read_text()
    prose = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    gpu = prose[prose.index("timed on a GPU"):prose.index("## Lift")]
    # where retract lands on the GPU comes from the rows: no order in words after the GPU run begins
    assert not re.search(r"retract (sits|lands|is) (in )?between|sits in between|below reserve|above reserve", gpu)
    assert "where_retract_sits(bench, name)" in text and "retraction_cost(bench)" in text
    # what the recorded run says, through the same function, agrees with the file's rows
    bench = ch12.bench_rows(str(ROOT / "figures" / "bench.json"))
    if bench is None:
        pytest.skip("figures/bench.json holds no GPU run of --memory")
    for name in {r["workload"] for r in bench["rows"]}:
        speed = dict(ch12.tokens_order(bench, name, "tight"))
        if {"reserve", "recompute", "retract"} <= set(speed):
            sentence = ch12.where_retract_sits(bench, name)
            low, high = sorted(("reserve", "recompute"), key=speed.get)
            r = speed["retract"]
            want = "below both" if r < speed[low] else "above both" if r > speed[high] else "between"
            assert want in sentence, (name, sentence, speed)


def test_the_side_by_side_table_fits_a_notebooks_width():
    rows = ch12.compared_rows()
    table = policy_table(rows)
    assert max(map(len, table.splitlines())) <= 88          # JupyterLab's 848 px of output
    assert {r["workload"] for r in rows} == set(ch12.CHAPTER_WORKLOADS)
    assert all(f"-- {name} " in table for name in ch12.CHAPTER_WORKLOADS)


def test_long_answers_make_retract_retract_on_the_simulator_and_nowhere_else():
    rows = ch12.compared_rows()
    retract = {(r["workload"], r["pool"]): r for r in rows if r["policy"] == "retract"}
    assert all(retract[("long_answers", pool)]["stops"] > 0 for pool in ("medium", "tight"))
    assert all(r["stops"] == 0 for (w, _), r in retract.items() if w != "long_answers")
    assert all(retract[("long_answers", pool)]["recomputed_tokens"] > 0 for pool in ("medium", "tight"))


def test_the_chapters_runs_are_kept_and_shared():
    a = ch12.policy_run("retract", "long_answers", "medium")
    assert ch12.policy_run("retract", "long_answers", "medium") is a
    assert ch12.policy_run("retract", "long_answers", "tight") is not a


def test_long_answers_run_nearly_to_their_cap_and_refuse_bad_arguments():
    w = make_workload("long_answers", seed=3, n_requests=40, max_new_tokens=50, at_least=0.9)
    assert all(45 <= len(r.output) <= 50 and r.max_new_tokens == 50 for r in w.requests)
    assert w == make_workload("long_answers", seed=3, n_requests=40, max_new_tokens=50, at_least=0.9)
    for bad in (dict(at_least=0.0), dict(at_least=1.5), dict(at_least="most"), dict(max_new_tokens=0)):
        with pytest.raises(InvalidArgument):
            make_workload("long_answers", **bad)


def test_the_swap_pictures_recomputed_request_is_named():
    run = ch12.policy_run("swap", "shared_system_prompt")
    stops = ch12.host_full_stops(run)
    assert stops and all(used > 0 for _, _, used in stops)
    for step, rid, _ in stops:                       # it waits in the queue, not in host memory
        assert rid in run.steps[step].waiting and rid not in run.steps[step].swapped
