"""``python -m kvlab.bench``: the smoke run of the harness (CPU) and the target verdicts."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from kvlab.base import runtime
from kvlab.bench import cases as C
from kvlab.bench import report, suite, timing
from kvlab.bench.public import SeedAllocator
from kvlab.bench.targets import evaluate_targets
from kvlab.course.reference.alloc_ref import alloc_decode_ref, alloc_extend_ref


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    res = suite.run(smoke=True, log=lambda *a: None)
    report.write_outputs(res, str(out), log=lambda *a: None)
    return res, out


def test_run_returns_and_writes_nothing(tmp_path, monkeypatch, smoke):
    """``run`` measures; only the writer touches files (``__main__`` calls both)."""
    res, _ = smoke
    assert {"public_extend", "public_decode", "floor", "cold_process", "host_checks", "targets"} <= set(res)
    assert res["meta"]["command"].startswith(("python -m kvlab.bench", "TRITON_CACHE_DIR="))


def test_smoke_writes_json_markdown_and_plots(smoke):
    res, out = smoke
    names = {p.name for p in out.iterdir()}
    assert {"bench.json", "bench.md", "09_bench_extend.png", "09_recompile_trap.png", "09_public_call.png",
            "09_prefix_sum_scaling.png", "09_bench_decode.png", "09_page_table_write.png"} <= names
    saved = json.loads((out / "bench.json").read_text())
    assert saved["smoke"] is True and saved["extend"] and saved["decode"] and saved["cold"]
    assert saved["public_extend"] and saved["public_decode"] and saved["cold_process"]["first_calls"]
    md = (out / "bench.md").read_text()
    assert "Smoke run" in md and "no claim" in md  # says it is not a measurement
    assert "PASS" not in md and "FAIL" not in md    # and claims nothing
    assert "Produced by: `" in md and "seed wrapper" in md and "launch floor" in md


def test_smoke_paths_agree_with_each_other(smoke):
    res, _ = smoke
    assert all(r["agree"] for r in res["extend"] + res["decode"] + res["public_extend"] + res["public_decode"])
    assert all(r.get("agree") for r in res["page_table"])
    assert all(t["passed"] is None for t in res["targets"])
    row = res["public_extend"][0]["paths"]
    assert {"fast", "fast_host_lens", "teaching", "teaching_host_lens", "seed_wrapper"} <= set(row)


def _fake(res, **speed):
    """A copy of a result with chosen timings (µs per call; ``cold`` in ms), to check the verdicts."""
    r = copy.deepcopy(res)
    r["smoke"] = False
    for row in r["extend"] + r["decode"] + r["public_extend"] + r["public_decode"]:
        for name, entry in row["paths"].items():
            if "loop_us" in entry:
                entry["median_us"] = entry["loop_us"] = speed.get(name, 10.0)
                entry.pop("loop_rounds_us", None)
            entry["syncs"] = {"fast": 1, "fast_host_lens": 0}.get(name, 1)
    for row in r["public_extend"] + r["public_decode"]:
        row["bs"] = 1024 if row is not r["public_extend"][-1] else 4096
    for row in r["page_table"]:
        row["bs"] = 256
        for name, entry in row["paths"].items():
            entry["median_us"] = entry["loop_us"] = speed.get(name, 10.0)
    for row in r["cold_process"]["first_calls"]:
        for k in row:
            if k not in ("bs", "page_size"):
                row[k] = speed.get("cold", 1.0)
    r["host_checks"] = [{"bs": 4096, "extend_cpu_tensor_us": speed.get("host", 30.0), "decode_cpu_tensor_us": 20.0,
                         "extend_list_us": 150.0, "decode_list_us": 140.0}]
    return r


GOOD = dict(teaching=100.0, fast=50.0, fast_host_lens=30.0, seed_wrapper=100.0, host_loop=1000.0, triton=50.0)


def test_targets_pass_and_fail_on_the_numbers(smoke):
    res, _ = smoke
    good = evaluate_targets(_fake(res, **GOOD))
    assert [t["passed"] for t in good] == [True] * len(good), [t for t in good if not t["passed"]]
    bad = evaluate_targets(_fake(res, teaching=100.0, fast=90.0, fast_host_lens=95.0, seed_wrapper=100.0,
                                 host_loop=100.0, triton=50.0, cold=300.0, host=70.0))
    assert [t["passed"] for t in bad][:-1] == [False] * (len(bad) - 1)  # (the sync count is still right)
    # one metric failing is enough to fail
    mixed = _fake(res, **GOOD)
    mixed["public_extend"][0]["paths"]["fast_host_lens"]["loop_us"] = 46.0
    assert evaluate_targets(mixed)[0]["passed"] is False
    synced = _fake(res, **GOOD)
    synced["public_decode"][0]["paths"]["fast_host_lens"]["syncs"] = 1
    assert evaluate_targets(synced)[2]["passed"] is False
    two = _fake(res, **GOOD)
    two["public_extend"][0]["paths"]["fast"]["syncs"] = 2
    assert evaluate_targets(two)[-1]["passed"] is False


def test_disagreeing_outputs_fail_the_target(smoke):
    res, _ = smoke
    r = _fake(res, **GOOD)
    r["public_extend"][0]["agree"] = False
    r["extend"][0]["agree"] = False
    verdicts = {t["name"]: t["passed"] for t in evaluate_targets(r)}
    assert verdicts["public alloc_extend, host lengths, checks on"] is False
    assert verdicts["bare fast alloc_extend vs teaching kernel"] is False


def test_the_seed_wrapper_is_the_seed_host_code():
    """Launch, ``ret_values.item()``, then the slice; None (nothing sliced) when pages are short."""
    P = 4
    free = C.make_extend_batch(2, 3, P, seed=1)
    seed = SeedAllocator(free.free_pages, P)
    out = seed.alloc_extend(free.prefix_lens, free.seq_lens, free.last_loc, free.extend_num_tokens)
    plan = alloc_extend_ref(free.prefix_cpu, free.seq_cpu, free.last_loc.tolist(), free.free_pages.tolist(), P)
    assert out.tolist() == plan.out_indices
    assert seed.free_pages.tolist() == free.free_pages.tolist()[plan.num_new_pages:]
    # pages short: the seed launches first (its kernel reads past the free list: here into the
    # rest of a larger tensor, so nothing outside memory is touched) and then returns None
    d = C.make_decode_batch(3, 1)
    pool = torch.cat([d.free_pages, d.free_pages])
    short = SeedAllocator(pool[:1], 1)
    assert short.alloc_decode(d.seq_lens, d.last_loc) is None and short.free_pages.numel() == 1


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
    """Without CUDA every run is a smoke run; on a GPU, --smoke asks for one."""
    from kvlab.bench.__main__ import main

    import kvlab.bench.__main__ as cli

    written = []
    monkeypatch.setattr(cli, "run", lambda **kw: {"targets": []})
    monkeypatch.setattr(cli, "write_outputs", lambda res, out: written.append(out))
    monkeypatch.chdir(tmp_path)
    assert main([] if runtime.INTERPRET else ["--smoke"]) == 0
    assert not (tmp_path / "figures").exists() and written and "figures" not in written[0]


# --- side-by-side timing: the rounds of a case's paths are interleaved ------------------------


def test_interleaved_rounds_rotate_and_time_every_path_each_round():
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("teaching", "fast", "fast_sync", "torch")}
    got = timing.interleaved_loop_us(fns, smoke=True, calls=2, rounds=5,
                                    time_block=lambda fn, n, smoke: [fn() for _ in range(n)] and 1.0)
    names = list(fns)
    assert calls[:4] == names  # one untimed warm call each, first
    blocks = [calls[i:i + 2] for i in range(4, len(calls), 2)]
    assert all(b[0] == b[1] for b in blocks)  # each block: `calls` back-to-back calls of one path
    order = [b[0] for b in blocks]
    assert order == [n for i in range(5) for n in names[i % 4:] + names[:i % 4]]
    assert all(len(e["loop_rounds_us"]) == 5 and e["loop_us"] == 1.0 for e in got.values())


def test_interleaving_cancels_drift_that_timing_one_path_after_the_other_does_not():
    """A host that slows down steadily while the case is measured: 3% more per timed block."""
    true_us = {"teaching": 50.0, "fast": 35.0}  # true ratio 0.70
    rounds = 9

    def drifting_clock():
        blocks = [0]

        def time_block(fn, calls, smoke):
            blocks[0] += 1
            return true_us[fn()] * (1 + 0.03 * blocks[0])
        return time_block

    fns = {name: (lambda name=name: name) for name in true_us}
    side_by_side = timing.interleaved_loop_us(fns, smoke=True, calls=1, rounds=rounds,
                                             time_block=drifting_clock())
    ratio = side_by_side["fast"]["loop_us"] / side_by_side["teaching"]["loop_us"]
    assert abs(ratio - 0.70) < 0.02
    # the old way, each path in its own block of rounds: the drift lands on the second path only
    clock = drifting_clock()
    one_after_other = {name: timing.median([clock(fn, 1, True) for _ in range(rounds)])
                       for name, fn in fns.items()}
    assert one_after_other["fast"] / one_after_other["teaching"] > 0.80


def test_smoke_rows_carry_side_by_side_rounds(smoke):
    res, out = smoke
    for row in res["extend"] + res["decode"] + res["page_table"] + res["scaling"] + res["public_extend"]:
        for name, entry in row["paths"].items():
            if "skipped" in entry:
                continue
            assert len(entry["loop_rounds_us"]) == timing.SMOKE_LOOP_ROUNDS, (row, name)
            assert entry["loop_us"] == timing.median(entry["loop_rounds_us"])
    md = (out / "bench.md").read_text()
    assert "quotient of those two medians" in md


def test_loop_us_of_one_path_still_works():
    n = []
    assert timing.loop_us(lambda: n.append(1), smoke=True, calls=3, rounds=2) >= 0
    assert len(n) == 1 + 3 * 2


def test_round_ratios_pair_rounds_timed_together():
    row = {"paths": {"fast": {"loop_rounds_us": [10.0, 30.0, 12.0]},
                     "teaching": {"loop_rounds_us": [20.0, 40.0, 24.0]}}}
    assert timing.round_ratios(row, "fast", "teaching") == [0.5, 0.75, 0.5]
    assert timing.round_ratios(row, "fast", "torch") is None  # not measured: no ratio


# --- the serving benchmark of chapter 10 (python -m kvlab.bench --serve) ----------------------

@pytest.mark.slow
def test_serve_smoke_adds_its_section_to_an_existing_result(tmp_path):
    """A smoke run through the same code paths as the GPU's: every kvlab path serves the whole
    workload (offline, online at each rate, the busy-share runs), the result joins what
    bench.json held, bench.md says it is no measurement, the plot is drawn."""
    pytest.importorskip("transformers")
    from kvlab.bench.__main__ import serve_main
    from kvlab.bench.serve_workloads import SMOKE_BUSY, SMOKE_OFFLINE, SMOKE_ONLINE, offline_workload

    (tmp_path / "bench.json").write_text(json.dumps({"kept": 1}))
    res = serve_main(str(tmp_path), smoke=True)
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["kept"] == 1 and saved["serve"]["smoke"] is True
    assert not (tmp_path / "bench.serve-partial.json").exists()
    s = res["serve"]
    off = s["offline"]["paths"]
    # transformers' static cache + torch.compile runs on a GPU only (compiling in the
    # interpreter takes minutes): there it serves the same tokens and says which way compiled
    static = {"generate_static_compiled"} if torch.cuda.is_available() else set()
    assert set(off) == {"kvlab", "kvlab_no_overlap", "kvlab_subset", "generate"} | static
    if static:
        assert off["generate_static_compiled"]["tokens"] == off["generate"]["tokens"]
        assert "static" in off["generate_static_compiled"]["path"]
    _, answers = offline_workload(**SMOKE_OFFLINE)
    for name in ("kvlab", "kvlab_no_overlap"):
        assert off[name]["tokens"] == sum(answers) == s["offline"]["workload"]["output_tokens"]
        assert off[name]["stats"]["prefill_computed"] == s["offline"]["workload"]["prompt_tokens"]
    assert off["kvlab_subset"]["tokens"] == off["generate"]["tokens"] == s["offline"]["workload"]["baseline_tokens"]
    for name in ("kvlab", "kvlab_no_overlap"):
        rates = s["online"]["paths"][name]
        assert sorted(map(float, rates)) == sorted(SMOKE_ONLINE["rates"])
        assert all(r["ttft_ms"]["p50"] > 0 and r["requests_per_s"] > 0 for r in rates.values())
    for n in SMOKE_BUSY["running"]:
        for mode in ("overlap", "no_overlap"):
            r = s["busy"]["paths"][f"{mode}_{n}"]
            assert 0 < r["busy"] <= 1 and r["steps"] > 0
    assert s["timeline"] and all(w and "device" in w[0] for w in s["timeline"].values())
    assert all(t["passed"] is None for t in s["targets"]) and len(s["targets"]) == 7
    floor = s["offline"]["floor"]                    # every step of the run counted, none twice
    assert floor["steps"] == off["kvlab"]["stats"]["steps"] and floor["seconds"] > 0
    assert floor["prompt_tokens"] == s["offline"]["workload"]["prompt_tokens"]
    assert off["kvlab"]["ratio_to_floor"] == off["kvlab"]["seconds"] / off["kvlab"]["floor_s"]
    md = (tmp_path / "bench.md").read_text()
    assert "Serving a real model" in md and "Smoke run" in md and "PASS" not in md
    assert (tmp_path / "10_bench_serve.png").stat().st_size > 0


def test_the_offline_workload_is_nano_vllms():
    """random.seed(0); prompts randint(100, 1024) tokens of randint(0, 10000), then answers
    randint(100, 1024): the totals nano-vllm's README reports (133,966 output tokens)."""
    from kvlab.bench.serve_workloads import OFFLINE, arrivals_at, offline_workload, online_workload

    prompts, answers = offline_workload(**OFFLINE)
    assert len(prompts) == 256 and sum(answers) == 133966 and sum(map(len, prompts)) == 142827
    assert min(map(len, prompts)) >= 100 and max(answers) <= 1024
    _, _, gaps = online_workload(requests=400, shortest=1, longest=2, answer_shortest=1,
                                 answer_longest=2, seed=3, max_token=5)
    times = arrivals_at(gaps, rate=50.0)
    assert times[0] == 0 and all(b > a for a, b in zip(times, times[1:]))
    assert 6.0 < times[-1] < 10.0            # 400 arrivals at 50/s: about 8 s


def test_latency_percentiles_and_busy_shares_are_computed_as_stated():
    from kvlab.bench.serve_workloads import busy_fraction, latency_summary, percentiles

    assert percentiles([0.001 * i for i in range(1, 101)]) == {"p50": pytest.approx(50.0), "p99": pytest.approx(99.0)}
    assert percentiles([]) == {"p50": None, "p99": None}
    s = latency_summary([0.0, 1.0], [[0.5, 0.6, 0.8], [1.1, 1.4]], tokens=5)
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0) and s["ttft_ms"]["p99"] == pytest.approx(500.0)
    assert s["itl_ms"]["p99"] == pytest.approx(300.0) and s["requests_per_s"] == pytest.approx(2 / 1.4)

    def step(i, requests, dev):
        return dict(index=i, requests=requests, decode_only=True, device=dev)

    Step = __import__("collections").namedtuple("Step", "index requests decode_only device")
    tl = [Step(**step(0, 4, (0.0, 1.0))), Step(**step(1, 4, (1.5, 2.0))), Step(**step(2, 4, (2.0, 3.0))),
          Step(**step(3, 3, (3.0, 4.0)))]
    r = busy_fraction(tl, 4)
    assert r["steps"] == 2 and r["busy"] == pytest.approx((0.5 + 1.0) / 2)   # 0.5 of 1.0, 1.0 of 1.0
    assert busy_fraction(tl, 7)["busy"] is None


def test_serve_targets_pass_and_fail_on_the_numbers():
    from kvlab.bench.serve import targets

    def fake(busy64, busy256, on, off, subset, batch, padded=500, floor=1.4, static=800):
        return {"smoke": False,
                "busy": {"paths": {"overlap_64": {"busy": busy64}, "overlap_256": {"busy": busy256}}},
                "offline": {"paths": {"kvlab": {"tokens_per_s": on, "ratio_to_floor": floor},
                                      "kvlab_no_overlap": {"tokens_per_s": off},
                                      "kvlab_subset": {"tokens_per_s": subset},
                                      "generate_batch": {"tokens_per_s": batch},
                                      "generate": {"tokens_per_s": padded},
                                      "generate_static_compiled": {"tokens_per_s": static}}}}

    # floor, busy 64, busy 256, overlap vs not, vs generate_batch, vs generate, vs static + compile
    assert [t["passed"] for t in targets(fake(0.95, 0.91, 1200, 1000, 900, 300))] == [True] * 7
    assert [t["passed"] for t in targets(fake(0.89, 0.95, 1100, 1000, 800, 300, 801, 1.6, 801))] == \
        [False, False, True, False, False, False, False]
    assert [t["measured"] for t in targets(fake(0.95, 0.91, 1500, 1000, 900, 300))][3:] == [1.5, 3.0, 1.8, 1.12]
    missing = fake(None, 0.95, 1200, 1000, 900, None, None, None, None)
    assert [t["passed"] for t in targets(missing)] == [False, False, True, True, False, False, False]
    assert targets(missing)[4]["measured"] is None


# --- the decode-attention benchmark of chapter 09 (python -m kvlab.bench --attention) -----------


def test_attention_smoke_adds_its_section_and_plot(tmp_path):
    """A smoke run: every kernel case and decode step measured (no claim), the targets listed
    as n/a, the kernels agreeing, the result joining what bench.json held."""
    from kvlab.bench.__main__ import attention_main
    from kvlab.bench.decode import KERNEL_TARGETS, SMOKE_BATCHES, SMOKE_CONTEXTS, SMOKE_STEP_BATCHES
    from kvlab.bench.decode_call import SMOKE_CASES

    (tmp_path / "bench.json").write_text(json.dumps({"kept": 1}))
    res = attention_main(str(tmp_path), smoke=True)
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["kept"] == 1 and saved["attention"]["smoke"] is True
    a = res["attention"]
    assert [(r["batch"], r["ctx"]) for r in a["kernel"]] == [(b, c) for b in SMOKE_BATCHES for c in SMOKE_CONTEXTS]
    for r in a["kernel"]:
        assert set(r["paths"]) == {"teaching", "fast", "sdpa"} and r["agree_max_abs"] < 1e-4
        assert r["bytes"]["floor"] < r["bytes"]["teaching_design"]
        assert r["floor_us"] == pytest.approx(r["bytes"]["floor"] / a["bandwidth"]["gb_per_s"] / 1e3)
    assert [r["batch"] for r in a["step"]["rows"]] == list(SMOKE_STEP_BATCHES)
    assert all(set(r["paths"]) == {"fast", "teaching"} for r in a["step"]["rows"])
    assert [(r["batch"], r["ctx"]) for r in a["public"]] == SMOKE_CASES
    for r in a["public"]:            # the checked call, unchecked, chapter 08's and SDPA, side by side
        assert set(r["paths"]) == {"fast", "fast_unchecked", "teaching", "sdpa"} and r["agree_max_abs"] < 1e-4
        assert r["paths"]["sdpa"]["vs_sdpa"] == 1.0
    for run in ("cold", "warm"):     # two fresh processes built the serving generator
        assert a["startup"][run]["seconds"] > 0 and a["startup"][run]["sizes"] > 0, a["startup"]
    assert len(a["targets"]) == len(KERNEL_TARGETS) + len(SMOKE_STEP_BATCHES) + 2 * len(SMOKE_CASES) + 2
    assert all(t["passed"] is None for t in a["targets"])
    md = (tmp_path / "bench.md").read_text()
    assert "Decode attention at the memory floor" in md and "Smoke run" in md
    assert (tmp_path / "09_bench_attention.png").stat().st_size > 0


def test_attention_targets_compare_with_the_floor():
    from kvlab.bench.decode import targets

    kernel = [dict(batch=b, ctx=c, paths={"fast": {"ratio_to_floor": 1.5 if c < 32768 else 2.5}})
              for b, c in [(64, 512), (64, 4096), (64, 32768), (256, 4096), (256, 32768)]]
    step = {"rows": [dict(batch=64, paths={"fast": {"ratio_to_floor": 3.5},
                                           "fast_compiled": {"ratio_to_floor": 1.9},
                                           "teaching": {"ratio_to_floor": 1.0}}),
                     dict(batch=256, paths={"fast_compiled": {"ratio_to_floor": 1.6}})],
            "graphs_built_while_serving": 0}
    public = [dict(batch=1, ctx=512, paths={"fast": {"vs_sdpa": 1.4, "syncs": 0}}),
              dict(batch=64, ctx=512, paths={"fast": {"vs_sdpa": 1.6, "syncs": 0}})]
    startup = {"cold": {"seconds": 25.0}, "warm": {"seconds": 9.0}}
    found = {t["name"]: t for t in targets(dict(smoke=False, kernel=kernel, step=step, public=public,
                                                startup=startup))}
    assert found["fast decode attention, batch 64, context 512"]["passed"] is True
    assert found["fast decode attention, batch 256, context 32768"]["passed"] is False
    step_target = found["CUDA-graph decode step (fast_compiled), 64 running requests"]
    assert step_target["passed"] is True and step_target["measured"] == 1.9   # the teaching kernel is not counted
    assert found["CUDA-graph decode step (fast_compiled), 256 running requests"]["passed"] is False   # 1.5x there
    assert found["torch.compile recompiles after start-up"]["passed"] is True
    calls = [t for name, t in found.items() if name.startswith("public fast_paged_decode_attention")]
    assert [t["passed"] for t in calls] == [True, False]                     # 1.5x SDPA's time
    assert found["start-up of the compiled serving generator, warm (compile artefacts reused)"]["passed"] is True
    assert found["start-up: compile artefacts reused across runs (warm / cold)"]["measured"] == 0.36


class _FakeGenerator:
    """A model whose ``generate`` fails the way nested CUDA-graph trees do: a compiled
    ``forward`` under transformers' own compile of the static cache's steps."""

    def __init__(self, manual_works: bool):
        from types import SimpleNamespace

        self.generation_config = SimpleNamespace(cache_implementation=None, disable_compile=False)
        self.device = torch.device("cpu")
        self.manual_works = manual_works
        self.seen = []

    def forward(self, *args, **kwargs):  # pragma: no cover - never called: compile is lazy
        raise AssertionError

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        config, manual = self.generation_config, "forward" in self.__dict__
        self.seen.append((config.cache_implementation, config.disable_compile, manual))
        assert config.cache_implementation == "static"
        if manual and (not config.disable_compile or not self.manual_works):
            raise RuntimeError("accessing tensor output of CUDAGraphs that has been overwritten")
        return torch.zeros(input_ids.shape[0], input_ids.shape[1] + max_new_tokens, dtype=torch.long)


@pytest.mark.parametrize("manual_works", [True, False])
def test_the_static_cache_baseline_never_nests_two_compiles_and_restores_the_model(manual_works):
    from kvlab.bench.serve_baselines import static_compiled_generate

    model = _FakeGenerator(manual_works)
    out = static_compiled_generate(model, [[1, 2, 3], [4]], [2, 3])
    assert out["tokens"] == 5 and out["compile_s"] >= 0
    assert ("torch.compile(model.forward" in out["path"]) == manual_works
    if manual_works:
        assert "earlier_ways_failed" not in out
    else:                                            # the first way's error is kept, not lost
        assert out["earlier_ways_failed"] == ["manual: RuntimeError: accessing tensor output of "
                                              "CUDAGraphs that has been overwritten"]
    # the documented way first, with transformers' own compile off; its own compile alone next
    assert model.seen[0] == ("static", True, True)
    assert manual_works or model.seen[-1] == ("static", False, False)
    assert model.generation_config.cache_implementation is None
    assert model.generation_config.disable_compile is False and "forward" not in vars(model)


def test_the_serve_report_says_which_static_cache_way_ran_and_why_the_first_did_not():
    from kvlab.bench.serve_report import _static_cache_lines

    static = dict(compile_s=4.5, path='cache_implementation="static", compiled by generate itself',
                  earlier_ways_failed=["manual: RuntimeError: accessing tensor output of CUDAGraphs"])
    lines = "\n".join(_static_cache_lines({"paths": {"generate_static_compiled": static}}))
    assert "compiled by generate itself" in lines and "4.5 s" in lines
    assert "Tried first and failed here: manual: RuntimeError: accessing tensor output" in lines
