"""``python -m kvlab.bench``: the smoke run of the harness (CPU) and the target verdicts."""
from __future__ import annotations

import copy
import json

import pytest

from kvlab import runtime
from kvlab.bench import cases as C
from kvlab.bench import suite
from kvlab.reference.alloc import alloc_decode_ref, alloc_extend_ref


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    res = suite.run(str(out), smoke=True, log=lambda *a: None)
    return res, out


def test_smoke_writes_json_markdown_and_plots(smoke):
    res, out = smoke
    names = {p.name for p in out.iterdir()}
    assert {"bench.json", "bench.md", "09_bench_extend.png", "09_recompile_trap.png",
            "09_prefix_sum_scaling.png", "09_bench_decode.png", "09_page_table_write.png"} <= names
    saved = json.loads((out / "bench.json").read_text())
    assert saved["smoke"] is True and saved["extend"] and saved["decode"] and saved["cold"]
    md = (out / "bench.md").read_text()
    assert "Smoke run" in md and "no claim" in md  # says it is not a measurement
    assert "PASS" not in md and "FAIL" not in md    # and claims nothing


def test_smoke_paths_agree_with_each_other(smoke):
    res, _ = smoke
    assert all(r["agree"] for r in res["extend"])
    assert all(r["agree"] for r in res["decode"])
    assert all(r.get("agree") for r in res["page_table"])
    assert all(t["passed"] is None for t in res["targets"])


def _fake(res, **speed):
    """A copy of a result with chosen timings, to check the verdicts."""
    r = copy.deepcopy(res)
    r["smoke"] = False
    for row in r["extend"] + r["decode"]:
        for name, entry in row["paths"].items():
            if "median_us" in entry:
                entry["median_us"] = entry["loop_us"] = speed.get(name, 10.0)
    for row in r["page_table"]:
        row["bs"] = 256
        for name, entry in row["paths"].items():
            entry["median_us"] = entry["loop_us"] = speed.get(name, 10.0)
    for row in r["cold"]:
        row["fast_first_call_ms"] = speed.get("cold", 1.0)
    return r


def test_targets_pass_and_fail_on_the_numbers(smoke):
    res, _ = smoke
    good = suite.evaluate_targets(_fake(res, teaching=100.0, fast=50.0, host_loop=1000.0, triton=50.0))
    assert [t["passed"] for t in good] == [True, True, True, True]
    bad = suite.evaluate_targets(_fake(res, teaching=100.0, fast=90.0, host_loop=100.0, triton=50.0,
                                       cold=300.0))
    assert [t["passed"] for t in bad] == [False, False, False, False]
    # one metric failing is enough to fail
    mixed = _fake(res, teaching=100.0, fast=50.0)
    mixed["extend"][0]["paths"]["fast"]["loop_us"] = 95.0
    assert suite.evaluate_targets(mixed)[0]["passed"] is False


def test_disagreeing_outputs_fail_the_target(smoke):
    res, _ = smoke
    r = _fake(res, teaching=100.0, fast=10.0)
    r["extend"][0]["agree"] = False
    assert suite.evaluate_targets(r)[0]["passed"] is False


@pytest.mark.parametrize("P", [1, 16, 64])
def test_bench_batches_are_consistent(P):
    b = C.make_extend_batch(8, 100, P, seed=3)
    assert b.extend_num_tokens == 800  # lengths sum to exactly bs * mean
    plan = alloc_extend_ref(b.prefix_cpu, b.seq_cpu, b.last_loc.tolist(), b.free_pages.tolist(), P)
    assert plan.num_new_pages == b.num_new_pages
    d = C.make_decode_batch(50, P, seed=3)
    assert alloc_decode_ref(d.seq_cpu, d.last_loc.tolist(), d.free_pages.tolist(), P).num_new_pages \
        == d.num_new_pages


def test_cli_smoke_does_not_touch_figures(tmp_path, monkeypatch):
    if not runtime.INTERPRET:
        pytest.skip("on a GPU the CLI runs the full suite")
    from kvlab.bench.__main__ import main

    monkeypatch.setattr(suite, "run", lambda out, **kw: {"targets": [], "out": out})
    monkeypatch.chdir(tmp_path)
    assert main([]) == 0
    assert not (tmp_path / "figures").exists()
