"""The checker framework (kvlab.course.checking.core), failure pictures, hints and solutions.

The last tests run over every registered exercise, so they grow as chapters add checkers:
each must have at least two hints and a stored solution, the solution must pass its own
checker, and ``kvlab.solutions.show`` must print its source.
"""
from __future__ import annotations

import inspect

import matplotlib
import matplotlib.figure

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import kvlab  # noqa: E402
import kvlab.check  # noqa: E402
import kvlab.solutions  # noqa: E402
from kvlab.check import Case, CheckFailed, Segment, compare_flat
from kvlab.course.checking import core, picture  # noqa: E402

# --- compare_flat ------------------------------------------------------------------------


def test_compare_flat_passes_equal_values_of_any_int_dtype():
    compare_flat([1, 2, 3], torch.tensor([1, 2, 3], dtype=torch.int32), case="c")
    compare_flat(torch.empty(0), torch.empty(0, dtype=torch.int64), case="empty")


def test_compare_flat_names_the_first_wrong_position_and_its_segment():
    segments = [Segment("request 0, part 1", 0, 3), Segment("request 0, part 2", 3, 7),
                Segment("request 1, part 3", 7, 9)]
    got = torch.arange(9)
    got[4] = 99
    got[8] = 77
    with pytest.raises(CheckFailed) as info:
        compare_flat(torch.arange(9), got, case="two requests", what="out_indices",
                     segments=segments)
    err = info.value
    msg = str(err)
    assert msg.startswith("[two requests] out_indices: 2 of 9 positions differ")
    assert "first at index 4 (request 0, part 2)" in msg
    assert "expected[4] = 4, got 99" in msg
    assert "wrong values appear in: request 0, part 2; request 1, part 3" in msg
    assert err.wrong == [4, 8] and err.label == "request 0, part 2"
    assert err.case == "two requests" and err.what == "out_indices"
    assert err.segments == segments and err.shape == (9,)


def test_compare_flat_reports_a_length_mismatch():
    with pytest.raises(CheckFailed, match=r"has 2 values, expected 3"):
        compare_flat([1, 2, 3], torch.tensor([1, 2]), case="c")


def test_compare_flat_rejects_a_non_tensor_answer():
    with pytest.raises(CheckFailed, match="should be a tensor"):
        compare_flat([1, 2], object(), case="c")


def test_compare_flat_names_row_and_column_of_a_table():
    exp = torch.arange(12).reshape(3, 4)
    got = exp.clone()
    got[2, 1] = -1
    with pytest.raises(CheckFailed) as info:
        compare_flat(exp, got, case="table", what="page_table")
    assert "row 2, column 1 of the page_table" in str(info.value)
    assert info.value.shape == (3, 4)


# --- run_cases ---------------------------------------------------------------------------


def test_run_cases_prints_one_line_and_counts_edge_and_random(capsys):
    cases = [Case("a", {}), Case("b", {}), Case("r1", {}, kind="random")]
    assert core.run_cases("demo", cases, lambda c: None) == 3
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["✓ demo: all 3 cases pass (2 edge cases, 1 random)"]


def test_run_cases_stops_at_the_first_failure_and_names_the_case():
    ran = []

    def run_one(case):
        ran.append(case.name)
        if case.name == "b":
            raise ValueError("bad shape")

    with pytest.raises(CheckFailed, match=r"^\[b\] your code raised ValueError: bad shape"):
        core.run_cases("demo", [Case("a", {}), Case("b", {}), Case("c", {})], run_one)
    assert ran == ["a", "b"]


def test_run_cases_adds_the_case_name_once():
    def run_one(case):
        raise CheckFailed("[b] already named", case=None)

    with pytest.raises(CheckFailed) as info:
        core.run_cases("demo", [Case("b", {})], run_one)
    assert str(info.value) == "[b] already named" and info.value.case == "b"


def test_run_cases_shows_the_picture_of_a_failure(monkeypatch):
    shown = []
    monkeypatch.setattr(picture, "show_failure", lambda err: shown.append(err))

    def run_one(case):
        compare_flat([1, 2], torch.tensor([1, 3]), case=case.name)

    with pytest.raises(CheckFailed) as info:
        core.run_cases("demo", [Case("x", {})], run_one)
    assert shown == [info.value]


# --- pictures ----------------------------------------------------------------------------


def _failure(exp, got, **kw) -> CheckFailed:
    with pytest.raises(CheckFailed) as info:
        compare_flat(exp, got, case="c", **kw)
    return info.value


def _red_outlines(fig) -> int:
    from matplotlib.patches import Rectangle

    return sum(1 for ax in fig.axes for p in ax.patches
               if isinstance(p, Rectangle) and not p.get_fill() and p.get_edgecolor()[:3] == (1, 0, 0))


def test_strip_picture_outlines_each_wrong_cell():
    got = torch.arange(10)
    got[[2, 7]] = 0
    err = _failure(torch.arange(10), got, what="slots",
                   segments=[Segment("page 0", 0, 5), Segment("page 1", 5, 10)])
    fig = picture.failure_figure(err)
    assert _red_outlines(fig) == 2
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "page 0" in texts and "page 1" in texts
    plt.close(fig)


def test_strip_picture_of_a_long_output_shows_a_window_around_the_first_wrong_cell():
    got = torch.arange(500)
    got[300] = -1
    fig = picture.failure_figure(_failure(torch.arange(500), got))
    assert _red_outlines(fig) == 1
    assert "showing" in fig.axes[0].get_xlabel()
    plt.close(fig)


def test_strip_picture_of_different_lengths():
    fig = picture.failure_figure(_failure([1, 2, 3, 4], torch.tensor([1, 2])))
    assert fig is not None and _red_outlines(fig) == 2
    plt.close(fig)


@pytest.mark.parametrize("page_size", [None, 2])
def test_table_picture_outlines_wrong_cells_on_both_sides(page_size):
    exp = torch.arange(24).reshape(4, 6)
    got = exp.clone()
    got[1, 2] = 0
    err = _failure(exp, got, what="page table")
    err.page_size = page_size
    fig = picture.failure_figure(err)
    assert _red_outlines(fig) >= 2 or page_size  # the course heatmap draws its own outlines
    assert len([ax for ax in fig.axes if ax.get_title()]) >= 2
    plt.close(fig)


def test_band_picture_marks_each_overwritten_guard_cell():
    from kvlab.course.checking.guards import BandWrite

    err = CheckFailed("the safety net caught ...")
    err.band_writes = [BandWrite("out_indices", "after", [1, 2, 5], 8),
                       BandWrite("free_pages", "before", [3], 4)]
    fig = picture.failure_figure(err)
    red = [p for ax in fig.axes for p in ax.patches
           if p.get_fill() and tuple(round(c, 2) for c in p.get_facecolor()[:3]) == (0.84, 0.15, 0.16)]
    assert len(red) == 4
    assert "`out_indices` (8 elements): 3 write(s) past the end, up to 5 out" in fig.axes[0].get_title(loc="left")
    plt.close(fig)


def test_in_a_notebook_the_failure_picture_is_displayed(monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(picture, "front_end_present", lambda: True)
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    assert picture.show_failure(_failure([1, 2, 3], torch.tensor([1, 5, 3]))) is True
    assert len(shown) == 1 and isinstance(shown[0], matplotlib.figure.Figure)
    assert picture.show_failure(CheckFailed("no data to draw")) is False


def test_no_picture_without_data_or_without_a_front_end():
    assert picture.failure_figure(CheckFailed("crashed")) is None
    assert picture.front_end_present() is False  # plain pytest: no Jupyter kernel
    assert picture.show_failure(_failure([1], torch.tensor([2]))) is False


# --- hints and solutions ------------------------------------------------------------------


def test_hint_levels_and_unknown_names(capsys):
    @kvlab.check.exercise("_demo_exercise", chapter="99", hints=["first", "second"], solution=abs)
    def demo(fn):
        return 1

    try:
        assert kvlab.check.hint("_demo_exercise", 2) is None  # printed, not echoed
        assert capsys.readouterr().out == "Hint 2/2 for _demo_exercise: second\n"
        demo.hint(1)
        assert capsys.readouterr().out.endswith("first\n")
        kvlab.check.hint("_demo_exercise", 3)
        assert "hints 1 to 2" in capsys.readouterr().out
        assert kvlab.solutions.get("_demo_exercise") is abs
        assert kvlab.check._demo_exercise is demo
        with pytest.raises(KeyError, match="no exercise named 'nope'"):
            kvlab.check.hint("nope")
        with pytest.raises(AttributeError):
            kvlab.check.nope  # noqa: B018
    finally:
        del kvlab.check.EXERCISES["_demo_exercise"]


EXERCISE_NAMES = kvlab.check.exercises()


def test_exercises_are_registered_and_every_checker_module_imports():
    assert EXERCISE_NAMES, "no exercise checkers are registered (kvlab/course/exercises/chNN_*.py)"
    assert kvlab.check.broken_modules() == {}


def test_the_course_exercises_exist():
    names = set(EXERCISE_NAMES)
    for needed in ["page_to_token", "write_page_table", "alloc_extend_part1", "alloc_extend_part2",
                   "alloc_extend_part3", "alloc_decode", "match_prefix", "insert_prefix"]:
        assert needed in names, f"no checker for the exercise {needed!r}"
    assert any(n.startswith("cache_req") for n in names), "no checker for cache_req"


@pytest.mark.parametrize("name", EXERCISE_NAMES)
def test_every_exercise_has_steps_of_hints(name, capsys):
    ex = kvlab.check.EXERCISES[name]
    assert len(ex.hints) >= 2, f"{name} has {len(ex.hints)} hint(s); give at least 2"
    assert all(len(h) >= 20 for h in ex.hints), f"{name} has a hint too short to help"
    assert len(set(ex.hints)) == len(ex.hints)
    assert ex.chapter.isdigit()
    for level in range(1, len(ex.hints) + 1):
        kvlab.check.hint(name, level)
        assert ex.hints[level - 1] in capsys.readouterr().out


@pytest.mark.parametrize("name", EXERCISE_NAMES)
def test_every_solution_is_shown_and_passes_its_own_checker(name, capsys):
    solution = kvlab.solutions.get(name)
    assert kvlab.solutions.show(name) is None  # printed once, nothing for a notebook to echo
    out = capsys.readouterr().out
    assert out == kvlab.solutions.source(name) + "\n"
    assert "def " in out and f"Reference solution for {name!r}" in out
    checker = getattr(kvlab.check, name)
    assert checker(solution) is None
    assert f"✓ {name}" in capsys.readouterr().out
    assert kvlab.check.status(name) == "passed"


def test_every_solution_passes_in_a_spawned_child(monkeypatch, capsys):
    # what a GPU uses: the code travels to a new Python (kvlab's own code by import), the audit
    # and the program orders run there, and every reference solution still passes
    monkeypatch.setenv("KVLAB_SANDBOX", "spawn")
    for name in EXERCISE_NAMES:
        checker = getattr(kvlab.check, name)
        fewer = {"n_random": 1} if "n_random" in inspect.signature(checker).parameters else {}
        checker(kvlab.solutions.get(name), **fewer)
        assert f"✓ {name}: all" in capsys.readouterr().out, name


def test_show_says_where_the_solution_lives_and_who_shares_it(capsys):
    kvlab.solutions.show("alloc_extend_part2")
    out = capsys.readouterr().out
    assert out.startswith("# Reference solution for 'alloc_extend_part2': kvlab.alloc.alloc_kernels.")
    assert "the same code is the solution of alloc_extend_part1" in out
    assert "def alloc_extend_kernel(" in out


# --- the floors of kvlab.check: arrows go one way --------------------------------------------

def _graph() -> dict[str, set[str]]:
    """The modules of the checkers (``course/check``, ``exercises``, ``checking``: names are
    unique across them) -> the ones each imports, read as ``tests/test_layers.py`` reads them."""
    from test_layers import _import_graph

    parts = ("course.check.", "course.exercises.", "course.checking.")
    graph = _import_graph()
    return {name.rpartition(".")[2]: {d.rpartition(".")[2] for d in deps if d.startswith(parts)}
            for name, deps in graph.items() if name.startswith(parts)}


def _reachable(graph, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_import_cycle_inside_kvlab_check():
    graph = _graph()
    cycles = sorted(m for m in graph if m in _reachable(graph, m))
    assert not cycles, f"modules of kvlab.check on an import cycle: {cycles}; edges: " + "; ".join(
        f"{m} -> {sorted(graph[m])}" for m in cycles)


def test_core_calls_the_sandbox_and_never_the_other_way():
    graph = _graph()
    assert "sandbox" in graph["core"]
    for low in ("sandbox", "workers", "runner", "audit", "guards", "findings", "walk",
                "shipping", "failures", "registry", "cells", "progress_file"):
        assert "core" not in _reachable(graph, low) | {low}, low
        assert "catalog" not in _reachable(graph, low), low


# --- on a GPU: compiled first, then the audit pass in the interpreter ---------------------------


def _fake_gpu(monkeypatch, answers):
    """Pretend to be on a GPU; ``answers(interpret, order_kind)`` -> (value, accesses)."""
    from kvlab.base import runtime
    from kvlab.course.checking import sandbox
    from kvlab.course.checking.findings import Access

    calls = []

    def guarded_call(fn, args, kwargs, grid=None, *, keep_worker=False, order=None,
                     interpret=False, track=()):
        calls.append((interpret, order.kind))
        value, reads = answers(interpret, order.kind)
        accesses = [Access("read", "src", "after", 1, program=(1,))] if reads else []
        return sandbox.Outcome(value, accesses, [], [], None, 2, "spawn")

    monkeypatch.setattr(runtime, "INTERPRET", False)
    monkeypatch.setattr(sandbox, "audit_pass_enabled", lambda: True)
    monkeypatch.setattr(sandbox, "guarded_call", guarded_call)
    return calls


def _gpu_check(case_name="c"):
    def run_one(case):
        value = core.call_learner(lambda x: x, 0, grid=(2,))
        if value != "right":
            raise CheckFailed(f"the answer is {value}", label="answer")

    with pytest.raises(CheckFailed) as info:
        core.run_cases("demo", [Case(case_name, {})], run_one, quiet=True)
    return str(info.value)


def test_on_a_gpu_a_stray_read_is_found_by_the_audit_pass(monkeypatch):
    calls = _fake_gpu(monkeypatch, lambda interpret, kind: ("right", interpret))
    msg = _gpu_check()
    assert calls[:2] == [(False, "natural"), (True, "reversed")]
    assert "a read past the end of `src`" in msg and "again in Triton's interpreter" in msg


def test_on_a_gpu_a_race_is_named_by_the_audit_pass(monkeypatch):
    calls = _fake_gpu(monkeypatch, lambda interpret, kind: (
        "right" if kind == "natural" and interpret else "wrong", False))
    msg = _gpu_check()
    assert calls == [(False, "natural"), (True, "reversed"), (True, "natural")]
    assert "depends on the order in which its programs run" in msg


def test_on_a_gpu_a_wrong_answer_only_compiled_keeps_the_gpus_message(monkeypatch):
    calls = _fake_gpu(monkeypatch, lambda interpret, kind: ("right" if interpret else "odd", False))
    msg = _gpu_check()
    assert msg == "[c] the answer is odd" and calls == [(False, "natural"), (True, "reversed")]


# --- how the safety net's findings are told -------------------------------------------------------


def test_a_finding_is_placed_by_the_kernels_own_section_comments(tmp_path):
    from kvlab.course.checking.findings import Access, describe, region_of, statement_at

    src = tmp_path / "kernel.py"
    src.write_text(
        "@triton.jit\n"
        "def k(free, out):\n"
        "    pid = tl.program_id(0)\n"                                   # 3
        "    # --- your code: part 2, whole new pages ---\n"
        "    page = tl.load(free + pid,\n"                                # 5
        "                   mask=pid < 4)  # a comment (with a bracket\n"
        "    # ---- part 3: the new last page\n"
        "    # (parts 1 and 2 are done here)\n"
        "    tl.store(out + pid, page)\n"                                 # 9
        "def other():\n"
        "    pass\n")
    import linecache

    linecache.checkcache(str(src))
    assert region_of(str(src), 3) is None  # before any part: the bookkeeping
    assert region_of(str(src), 5) == "part 2"
    assert region_of(str(src), 9) == "part 3"  # "(parts 1 and 2 ...)" is no section header
    assert statement_at(str(src), 5) == "page = tl.load(free + pid, mask=pid < 4)"
    read = Access("read", "free", "after", 2, 3, (1,), str(src), 5, "k", others=1)
    layout = kvlab.check.Layout("request", inputs="free=[...]")
    assert describe(read, layout) == (
        "a read past the end of `free` (3 reads, up to 2 elements out) by request 1, part 2 "
        "(and 1 more request) (in k, line 5: page = tl.load(free + pid, mask=pid < 4))")


# --- a hash-chained cache as plain data (kvlab.course.checking.pool_state) ---------------------------


def _pool():
    from kvlab.prefix.hash_cache import HashPrefixCache

    cache = HashPrefixCache(6, 2, device="cpu")
    cache.allocate([1, 2, 3, 4, 5])  # pages 0, 1 (cached) and 2 (partial), held
    cache.free(cache.allocate([1, 2, 7, 7]).pages)  # page 3 cached and freed: in the queue
    return cache


@pytest.mark.parametrize("change, says", [
    (lambda c: c.take_cached(0), "page 0: its reference count ref_count was 1, now 2"),
    (lambda c: c.page_tokens.__setitem__(3, None), "page 3: its tokens page_tokens was [7, 7], now None"),
    (lambda c: c.page_parent.__setitem__(1, None), "page 1: its parent's hash page_parent was"),
    (lambda c: c.hash_to_page.pop(c.page_hash[3]), "; now it has no such hash"),
    (lambda c: (c.free_queue.remove(3), c.free_queue.appendleft(3)),
     "the free queue (head first) was [4, 5, 3], now [3, 4, 5]"),
    (lambda c: setattr(c, "evicted_pages", 1), "evicted_pages (cached pages handed out for other tokens) was 0, now 1"),
    (lambda c: c._locks.__setitem__(("req", (0,)), 1), "the lock table (owner, pages, count) was [], now"),
])
def test_pool_difference_names_what_changed_in_a_hash_cache(change, says):
    from kvlab.course.checking.pool_state import pool_difference, pool_state

    cache = _pool()
    before = pool_state(cache)
    assert pool_difference(before, pool_state(cache)) is None
    change(cache)
    assert says in pool_difference(before, pool_state(cache))


def test_a_read_only_hash_cache_that_changed_is_named_with_its_argument():
    cache = _pool()

    def touches(cache, input_ids):
        cache.take_cached(cache.match(input_ids).pages[0])

    with pytest.raises(CheckFailed) as info:
        core.call_learner(touches, cache, [1, 2], read_only=(0,))
    text = str(info.value)
    assert "your code changed `cache`" in text and "page 0: its reference count ref_count was 1, now 2" in text
    assert "Only read the cache" in text


# --- advice for torch's errors: one slip, the same advice on a CPU and on a GPU ---------------

#: what torch 2.11 said on an H200 when a learner's torch.zeros(n) met a GPU's inputs
_H200_DEVICE_MIX = ("RuntimeError: Expected all tensors to be on the same device, but got tensors is on "
                    "cpu, different from other tensors on cuda:0 (when checking argument in method "
                    "wrapper_CUDA_cat)")


def _torch_error(call) -> str:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the error torch raises is the point
        return f"{type(e).__name__}: {e}"
    raise AssertionError("torch raised nothing")


def test_torch_zeros_among_int64_indices_gets_the_same_advice_on_a_cpu_and_a_gpu():
    from kvlab.course.checking.messages import NEW_ENTRIES_ADVICE, torch_error_hint

    positions, table = torch.arange(3), torch.zeros(4, 4)
    cpu = _torch_error(lambda: table[positions, torch.cat([positions, torch.zeros(1)])])
    meta = _torch_error(lambda: torch.cat([positions, torch.zeros(1, dtype=torch.int64, device="meta")]))
    for summary in (cpu, meta, _H200_DEVICE_MIX):
        assert torch_error_hint(summary).endswith(NEW_ENTRIES_ADVICE), summary
    assert "float" in torch_error_hint(cpu) and "device" in torch_error_hint(_H200_DEVICE_MIX)
    assert torch_error_hint("ValueError: something else") == ""


#: what torch 2.11 said on an H200 when a learner's `host.k[...] += pool.k[...]` added a GPU
#: tensor into a CPU one (chapter 12's host pages live on the CPU)
_H200_INPLACE_MIX = ("RuntimeError: Expected all tensors to be on the same device, but found at least "
                     "two devices, cuda:0 and cpu!")


def test_arithmetic_across_devices_is_named_beside_a_tensor_made_on_the_cpu():
    """On a GPU, `+=` of the device pool into the host's CPU pages is refused by torch before any
    wrong value appears: the hint must name that slip too (an assignment copies across devices,
    arithmetic does not), not only a tensor made without device=."""
    from kvlab.course.checking.messages import NEW_ENTRIES_ADVICE, torch_error_hint

    hint = torch_error_hint(_H200_INPLACE_MIX)
    assert "arithmetic mixes a CPU tensor with a GPU one" in hint and "only an assignment" in hint
    assert "device=" in hint and hint.endswith(NEW_ENTRIES_ADVICE)
