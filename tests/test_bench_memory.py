"""``python -m kvlab.bench --memory`` (chapter 12): a smoke run of the real code path on the CPU,
and the claims judged from measured rows."""
from __future__ import annotations

import json

import pytest

from kvlab.bench import memory as mem


@pytest.mark.slow
def test_memory_smoke_run_serves_every_policy_and_keeps_what_bench_json_held(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from kvlab.bench.__main__ import memory_main

    # one workload in a tight pool: every policy, the same code path as on the GPU
    monkeypatch.setattr(mem, "SMOKE_WORKLOADS", {"eos_long_tail": mem.SMOKE_WORKLOADS["eos_long_tail"]})
    monkeypatch.setattr(mem, "SMOKE_POOLS", {"tight": 0.3})
    (tmp_path / "bench.json").write_text(json.dumps({"kept": 1, "serve": None}))
    res = memory_main(str(tmp_path), smoke=True)
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["kept"] == 1 and saved["memory"]["smoke"] is True
    m = res["memory"]
    assert not m["errors"] and [r["policy"] for r in m["rows"]] == list(mem.POLICY_NAMES)
    want = m["workloads"]["eos_long_tail"]["new_tokens"]
    assert all(r["tokens"] == want for r in m["rows"])               # every answer, whatever the policy
    by = {r["policy"]: r for r in m["rows"]}
    assert by["reserve"]["stops"] == 0 and by["recompute"]["stops"] > 0 and by["swap"]["swaps"] > 0
    assert by["swap"]["swapped_out_bytes"] > 0 and by["recompute"]["mean_running"] > by["reserve"]["mean_running"]
    assert all(r["ttft_p50"] is not None and r["ttft_p50"] <= r["ttft_p99"] for r in m["rows"])
    assert all(c["passed"] is None for c in m["claims"])
    md = (tmp_path / "bench.md").read_text()
    assert "When KV memory runs out" in md and "Smoke run" in md and "PASS" not in md
    assert (tmp_path / "12_bench_memory.png").stat().st_size > 0


@pytest.mark.slow
def test_a_smoke_run_of_long_answers_retracts_and_says_what_it_cost(tmp_path, monkeypatch):
    # answers that run nearly to their cap: SGLang's estimate (0.7 x what is left) is too low,
    # so the retract policy runs short and retracts; every answer is still whole
    pytest.importorskip("transformers")
    monkeypatch.setattr(mem, "SMOKE_WORKLOADS", {"long_answers": mem.SMOKE_WORKLOADS["long_answers"]})
    monkeypatch.setattr(mem, "POLICY_NAMES", ("reserve", "retract"))
    res = mem.run_memory(smoke=True, log=lambda line: None)
    assert {r["pool"] for r in res["rows"]} == {"tight"} and not res["errors"]
    by = {r["policy"]: r for r in res["rows"]}
    assert by["retract"]["retractions"] > 0 and by["retract"]["recomputed_tokens"] > 0
    assert by["reserve"]["stops"] == 0 and by["retract"]["tokens"] == by["reserve"]["tokens"]
    claim = next(c for c in res["claims"] if c["name"].startswith("Answers longer than SGLang's estimate"))
    assert claim["measured"] == by["retract"]["retractions"] and claim["passed"] is None   # smoke: no verdict


def test_runs_past_the_time_budget_are_skipped_and_decide_nothing(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(mem, "SMOKE_WORKLOADS", {"eos_long_tail": mem.SMOKE_WORKLOADS["eos_long_tail"]})
    res = mem.run_memory(smoke=True, budget_s=0.0, log=lambda line: None)
    assert len(res["rows"]) == len(mem.SMOKE_POOLS) * len(mem.POLICY_NAMES)
    assert all(r["error"].startswith("skipped: the 0 s budget") for r in res["rows"])
    assert all(c["passed"] is None for c in mem.claims(dict(res, smoke=False)))


def _rows(over=None):
    """A full set of fake rows: every workload, pool and policy, equal unless ``over`` says."""
    rows = []
    for w in mem.WORKLOADS:
        for pool in mem.POOLS:
            for p in mem.POLICY_NAMES:
                row = dict(workload=w, pool=pool, policy=p, tokens_per_s=100.0, mean_running=4.0,
                           unused_pages=10.0 if p in ("reserve", "retract") else 0.0,
                           recomputed_tokens=0, stops=0, retractions=0)
                row.update((over or {}).get((w, pool, p), {}))
                rows.append(row)
    return rows


def test_the_claims_are_judged_from_the_measured_rows():
    good = _rows({("eos_long_tail", "tight", "recompute"): dict(mean_running=7.0, tokens_per_s=150.0,
                                                                   recomputed_tokens=900, stops=12),
                    ("eos_long_tail", "tight", "retract"): dict(unused_pages=6.0),
                    ("long_prompt_burst", "tight", "recompute"): dict(recomputed_tokens=3000, stops=5),
                    ("long_prompt_burst", "tight", "swap"): dict(tokens_per_s=120.0, stops=4),
                    ("long_answers", "tight", "retract"): dict(retractions=3, stops=3, recomputed_tokens=400,
                                                                tokens_per_s=80.0)})
    verdicts = [c["passed"] for c in mem.claims(dict(smoke=False, rows=good))]
    assert verdicts == [True] * len(verdicts)
    cost = next(c for c in mem.claims(dict(smoke=False, rows=good)) if c["name"].startswith("... at a cost"))
    assert cost["measured"] == [400, 0.8, 0.8]        # recomputed, and tokens/s against reserve, recompute
    bad = _rows({("eos_long_tail", "tight", "recompute"): dict(mean_running=3.0, tokens_per_s=90.0),
                   ("eos_long_tail", "tight", "retract"): dict(unused_pages=12.0),
                   ("long_prompt_burst", "tight", "swap"): dict(tokens_per_s=80.0),
                   ("shared_system_prompt", "tight", "reserve"): dict(stops=1),
                   ("eos_long_tail", "ample", "swap"): dict(tokens_per_s=50.0)})
    verdicts = [c["passed"] for c in mem.claims(dict(smoke=False, rows=bad))]
    assert verdicts == [False] * len(verdicts)
    # a failed run leaves its claims undecided; a smoke run decides nothing
    failed = [r for r in good if (r["workload"], r["pool"], r["policy"]) != ("eos_long_tail", "tight", "reserve")]
    assert mem.claims(dict(smoke=False, rows=failed))[0]["passed"] is None
    assert all(c["passed"] is None for c in mem.claims(dict(smoke=True, rows=good)))
    # judged on the unrounded ratio: 0.8996 of reserve's tokens/s is more than 10% slower
    close = _rows({("eos_long_tail", "ample", "swap"): dict(tokens_per_s=89.96)})
    ample = mem.claims(dict(smoke=False, rows=close))[-1]
    assert ample["measured"] == 0.9 and ample["passed"] is False


def test_pools_run_from_every_whole_answer_down_to_the_longest_alone():
    from kvlab.serving.sim import RequestSpec, Workload
    from kvlab.serving.sim.compare import memory_pools

    w = Workload("w", "", tuple(RequestSpec(i, (1,) * n, (2,), 0, max_new_tokens=21)
                                for i, n in enumerate((30, 10, 100))))
    assert memory_pools(w, 16, {"all": 1.0, "some": 0.15}) == {"all": 4 + 2 + 8, "some": 8}
    workload, prompts, ends, max_new = mem.memory_workload("eos_long_tail", smoke=True, vocab=128)
    assert len(prompts) == len(ends) == len(workload) and max(ends) <= max_new
    assert all(0 <= t < 128 for p in prompts for t in p)
