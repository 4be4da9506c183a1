"""Mutation suite: typical bugs planted in correct solutions must be rejected by the checkers.

Each mutant is the reference solution's source (``inspect.getsource`` of
``kvlab.solutions.get(name)``) with one textual change - the kind of slip a learner makes.
The relevant checker must raise :class:`CheckFailed`, and its message must point at the
right place: the part of ``alloc_extend`` (1, 2 or 3), the page, the page-table row, the
region of ``cache_req``, or, for out-of-bounds accesses, the tensor argument - reported by
the safety net while this test process keeps running.
"""
from __future__ import annotations

import importlib.util
import inspect
import itertools
import textwrap
from typing import NamedTuple

import pytest
import torch

import kvlab.check
import kvlab.solutions
from kvlab.check import CheckFailed, sandbox

_counter = itertools.count()


class Mutant(NamedTuple):
    exercise: str  # the exercise whose solution is mutated (and whose checker must reject it)
    old: str  # text in the solution's source ...
    new: str  # ... replaced by this
    must_say: tuple[str, ...]  # the failure message names these (the part, region, argument)
    why: str  # the bug, in words


def _source(obj) -> str:
    return textwrap.dedent(inspect.getsource(getattr(obj, "fn", obj)))


def build_mutant(exercise: str, old: str, new: str, tmp_dir):
    """The solution of ``exercise`` with ``old`` replaced by ``new``, loaded from a real file.

    A real file (not ``exec``), because ``@triton.jit`` reads its function's source, and so
    that crash reports can quote the mutant's lines.
    """
    solution = kvlab.solutions.get(exercise)
    fn = getattr(solution, "fn", solution)
    src = _source(solution)
    assert old in src, f"the mutation target {old!r} is not in the solution of {exercise}"
    mutated = src.replace(old, new)
    assert mutated != src
    path = tmp_dir / f"mutant_{next(_counter)}_{exercise}.py"
    path.write_text(mutated)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    module.__dict__.update({k: v for k, v in fn.__globals__.items() if not k.startswith("__")})
    spec.loader.exec_module(module)
    return getattr(module, fn.__name__)


@pytest.fixture(scope="module")
def mutant_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mutants")


def _reject(mutant: Mutant, tmp_dir) -> CheckFailed:
    checker = getattr(kvlab.check, mutant.exercise)
    bad = build_mutant(mutant.exercise, mutant.old, mutant.new, tmp_dir)
    with pytest.raises(CheckFailed) as info:
        checker(bad)
    msg = str(info.value)
    for needle in mutant.must_say:
        assert needle in msg, f"{mutant.why}: the message should say {needle!r}:\n{msg}"
    return info.value


# --- chapter 01: page_to_token ------------------------------------------------------------

CH01 = [
    Mutant("page_to_token", "page_starts.unsqueeze(1) + offsets", "page_starts.unsqueeze(1) + 0 * offsets",
           ("slots differ", "(page 0 (start"), "without the offsets: every slot is its page's start"),
    Mutant("page_to_token", "(page_starts.unsqueeze(1) + offsets).flatten()",
           "(page_starts.unsqueeze(1) + offsets).t().flatten()",
           ("slots differ", "(page 0 (start"), "wrong stride: slots read column by column"),
    Mutant("page_to_token", "if page_size == 1:", "if page_size <= 4:",
           ("slots has 2 values, expected 8",), "the page_size 1 shortcut taken for small pages"),
]

# --- chapter 02: write_page_table ----------------------------------------------------------

CH02 = [
    Mutant("write_page_table", "first_pos, last_pos = first_page * page_size, last_page * page_size",
           "first_pos, last_pos = first_page, first_page + (last_page - first_page) * page_size",
           ("page table differs", "request row 1, logical column 2"),
           "writes at column first_page instead of first_page * page_size"),
    Mutant("write_page_table", "rows[offset: offset + length] = table_idx",
           "rows[offset: offset + length] = min(table_idx, 1)",
           ("page table differs", "request row"), "writes every request past row 1 into row 1"),
]

# --- chapter 03: the three parts of alloc_extend_kernel ---------------------------------------

CH03 = [
    Mutant("alloc_extend_part1", "last_loc + 1 + offset_one_page", "last_loc + offset_one_page",
           ("part 1",), "part 1 starts at last_loc instead of last_loc + 1"),
    Mutant("alloc_extend_part1",
           "tl.minimum(seq_len, (pre_len + page_size - 1) // page_size * page_size) - pre_len\n",
           "tl.minimum(seq_len, (pre_len + page_size - 1) // page_size * page_size) - pre_len - 1\n",
           ("part 1",), "off-by-one in part 1's length"),
    Mutant("alloc_extend_part1",
           "tl.minimum(seq_len, (pre_len + page_size - 1) // page_size * page_size) - pre_len\n",
           "tl.minimum(seq_len, pre_len // page_size * page_size) - pre_len\n",
           ("part 1", "`out_indices`", "written before its start"),
           "floor instead of ceil for the end of the old page"),
    Mutant("alloc_extend_part2", "page_start * page_size + offset_many_page % page_size",
           "page_start * page_size + offset_many_page",
           ("part 2",), "part 2 forgets that each page holds only page_size slots (k, not k % P)"),
    Mutant("alloc_extend_part2", "num_pages_before = (pre_lens + page_size - 1) // page_size",
           "num_pages_before = pre_lens // page_size",
           ("part 2",), "floor instead of ceil when counting the pages a prefix holds"),
    Mutant("alloc_extend_part3",
           "free_page_ptr + new_page_start_loc + num_page_start_loc_self - 1)",
           "free_page_ptr + new_page_start_loc + num_page_start_loc_self - 2)",
           ("part 3",), "wrong free-page index for part 3's page"),
    Mutant("alloc_extend_part3", "start_loc * page_size + offset_one_page",
           "start_loc * page_size + offset_one_page + 1",
           ("part 3",), "part 3 starts at offset 1 of its page"),
    Mutant("alloc_extend_part3", "tl.store(ret_values, merged_value)",
           "tl.store(ret_values, sum_extend_lens.to(tl.int64))",
           ("ret_values",), "ret_values without the page count in the high 32 bits"),
    Mutant("alloc_extend_part2",
           "        page_start * page_size + offset_many_page % page_size,\n"
           "        mask=offset_many_page < num_part2,\n",
           "        page_start * page_size + offset_many_page % page_size,\n",
           ("`out_indices`", "written past the end"), "missing mask on part 2's store"),
]

# --- chapter 04: alloc_decode_kernel ---------------------------------------------------------

CH04 = [
    Mutant("alloc_decode",
           "num_page_start_loc_self = (seq_len + page_size - 1) // page_size - (\n"
           "        pre_len + page_size - 1\n    ) // page_size",
           "num_page_start_loc_self = seq_len // page_size - pre_len // page_size",
           ("out_indices differs", "request 0, new page"),
           "decode takes a new page at the wrong boundary (seq % P == 0, not (seq - 1) % P == 0)"),
    Mutant("alloc_decode", "tl.store(out_indices + pid, last_loc + 1)",
           "tl.store(out_indices + pid, last_loc)",
           ("same page: last_loc + 1",), "decode writes last_loc instead of last_loc + 1"),
    Mutant("alloc_decode", "tl.store(out_indices + pid, page * page_size)",
           "tl.store(out_indices + pid, page)",
           ("new page: free_pages[",), "decode stores the page id, not its first slot"),
]

# --- chapter 05: the radix prefix cache --------------------------------------------------------

CH05 = [
    Mutant("match_prefix", "        n = n // P * P  # a partly matched page does not count\n", "",
           ("matched length", "is not a whole number of pages"),
           "a partly matched page is counted as cached"),
    Mutant("match_prefix", "and child.key[n] == input_ids[matched + n]:", ":",
           ("matched length", "tokens the cache does not hold"),
           "takes a child's whole key after its first page matched, without comparing the rest"),
    Mutant("insert_prefix", "insert_len = len(input_ids) // P * P", "insert_len = len(input_ids)",
           ("new_entries", "not a whole page of the prompt"), "page-unaligned insert of the partial last page"),
    Mutant("insert_prefix", "new_entries[tuple(input_ids[:start + P])]",
           "new_entries[tuple(input_ids[start:start + P])]",
           ("new_entries",), "keys a page by its own tokens instead of the whole prefix"),
    Mutant("insert_prefix", "cached_len += P  # this page is already there",
           "store[tuple(input_ids[:cached_len + P])] = []; cached_len += P  # this page is already there",
           ("leave the store unchanged",), "changes the store while looking pages up"),
]

# --- chapter 06: cache_req region accounting ----------------------------------------------------

CH06 = [
    Mutant("cache_req_regions", "    if finished:\n", "    if True:\n",
           ("free:", "an unfinished request keeps its tail"),
           "frees the tail of an unfinished request"),
    Mutant("cache_req_regions", "free = list(row_slots[old_cached_len:already_cached_len:page_size])",
           "free = []", ("free:", "the duplicate pages are always freed"),
           "leaks the duplicate region (never freed)"),
    Mutant("cache_req_regions", "row_slots[old_cached_len:already_cached_len:page_size]",
           "row_slots[old_cached_len:already_cached_len]", ("free:", "page starts"),
           "frees token slots instead of page starts (no [::page_size])"),
    Mutant("cache_req_regions", "new_cached_len = req_cached_len // page_size * page_size",
           "new_cached_len = req_cached_len", ("region 'inserted' is wrong",),
           "inserted region not page-aligned"),
    Mutant("cache_req_regions", '"duplicate": (old_cached_len, already_cached_len)',
           '"duplicate": (0, already_cached_len)', ("region 'duplicate' is wrong",),
           "duplicate region starts at 0 (counts the hit twice)"),
]

# --- chapters 07-09: the serving loop, attention through the page table, the scan kernel ----

CH07_09 = [
    Mutant("decode_step", "manager.cache_req(req, finished=True)",
           "manager.cache_req(req, finished=False)", ("request 0: finished should be True",),
           "hands a done request back as unfinished (its pages stay locked)"),
    Mutant("decode_step", "    manager.allocate_paged(reqs)          # a new page", "    # a new page",
           ("page_table[", "allocate_paged"), "advances requests without mapping their new pages"),
    Mutant("paged_attention", "page_table[row, :n]", "page_table[row, :n - 1]",
           ("request 0, head", "off by"), "attends to one token too few"),
    Mutant("paged_attention", " * scale, dim=-1", ", dim=-1",
           ("forgets the 1/sqrt(head_dim) scale",), "attention without the 1/sqrt(d) scale"),
    Mutant("extend_scan", "carry_tokens + tl.cumsum(extend, axis=0) - extend",
           "carry_tokens + tl.cumsum(extend, axis=0)", ("token_start differs", "request 0"),
           "inclusive instead of exclusive prefix sum"),
    Mutant("extend_scan", "carry_pages + tl.cumsum(pages, axis=0) - pages",
           "tl.cumsum(pages, axis=0) - pages", ("page_start differs", "block 1"),
           "drops the carry from earlier blocks"),
]

MUTANTS = CH01 + CH02 + CH03 + CH04 + CH05 + CH06 + CH07_09


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: f"{m.exercise}: {m.why}")
def test_mutant_is_rejected_and_the_message_points_at_the_bug(mutant, mutant_dir):
    _reject(mutant, mutant_dir)


def test_there_are_enough_mutants():
    assert len(MUTANTS) >= 12
    assert len({m.why for m in MUTANTS}) == len(MUTANTS)


def _one_exercise_per_solution() -> list[str]:
    """The exercises with mutants, one per distinct solution (the parts of alloc_extend share one)."""
    chosen: dict[int, str] = {}
    for name in sorted({m.exercise for m in MUTANTS}):
        chosen.setdefault(id(kvlab.solutions.get(name)), name)
    return sorted(chosen.values())


@pytest.mark.parametrize("exercise", _one_exercise_per_solution())
def test_the_unmutated_solution_passes(exercise, mutant_dir, capsys):
    # the mutant builder itself changes nothing else: a no-op "mutation" still passes
    solution = kvlab.solutions.get(exercise)
    first_line = _source(solution).splitlines()[-1]
    same = build_mutant(exercise, first_line, first_line + "  ", mutant_dir)
    checker = getattr(kvlab.check, exercise)
    fewer = {"n_random": 1} if "n_random" in inspect.signature(checker).parameters else {}
    assert checker(same, **fewer) > 0


# --- the safety net on a planted bug in an exercise kernel ------------------------------------


def test_out_of_bounds_store_in_an_exercise_kernel_is_reported(mutant_dir):
    from kvlab.check.ch03_alloc_extend import extend_case_inputs, run_extend_kernel

    bad = build_mutant("alloc_extend_part1", "mask=offset_one_page < num_part1,", "", mutant_dir)
    pre, seq, P = [5], [7], 4  # part 1 only: 2 slots, but the unmasked store writes 4
    last_loc, free_pages = extend_case_inputs(pre, seq, P)
    with pytest.raises(CheckFailed) as info:
        run_extend_kernel(bad, pre, seq, last_loc, free_pages, P)
    assert "`out_indices`: 2 value(s) written past the end, up to 2 element(s) out" in str(info.value)


def test_wild_load_in_an_exercise_kernel_is_reported(mutant_dir):
    from kvlab.check.ch03_alloc_extend import run_extend_kernel

    # part 2 reads the page one further on: the last token reads past the free list
    bad = build_mutant("alloc_extend_part2", "new_page_start_loc + offset_many_page // page_size,",
                       "new_page_start_loc + offset_many_page // page_size + 1,", mutant_dir)
    pre, seq, P = [0], [3], 1
    with pytest.raises(CheckFailed) as info:
        run_extend_kernel(bad, pre, seq, [-1], [7, 2, 5], P)  # exactly 3 free pages
    msg = str(info.value)
    assert "`out_indices[2]` holds the guard sentinel" in msg
    assert "read past the end of `free_page_ptr`" in msg


@pytest.mark.skipif(not sandbox.can_fork(), reason="a crash is only survivable in a child process")
def test_a_crashing_exercise_kernel_is_reported_and_the_process_survives(mutant_dir):
    # part 3 takes its page from far outside free_pages: a segfault in the interpreter
    bad = build_mutant("alloc_extend_part3", "start_loc = tl.load(free_page_ptr + new_page_start_loc",
                       "start_loc = tl.load(free_page_ptr + (1 << 40) + new_page_start_loc", mutant_dir)
    with pytest.raises(CheckFailed) as info:
        kvlab.check.alloc_extend_part3(bad)
    msg = str(info.value)
    assert "crashed the interpreter" in msg and "alloc_extend_kernel" in msg
    assert torch.arange(3).sum() == 3  # still alive


# --- chapters 05-06: match_req drops the last token; cache_req remaps the duplicate region ------

CH05_06_REQ = [
    Mutant("match_req", "input_ids[: len(input_ids) - 1]", "input_ids",
           ("[whole prompt cached (page_size 4)] matched 16 tokens; expected 12",
            "the prompt's last token must be recomputed so the prefill produces logits"),
           "matches all of input_ids instead of dropping the last token"),
    Mutant("match_req", "input_ids[: len(input_ids) - 1]",
           "input_ids[: len(input_ids) - prefix_cache.page_size]",
           ("[cached prompt ends inside a page] matched 8 tokens; expected 12",
            "dropped more than the last token"),
           "drops a whole page instead of the last token"),
    Mutant("cache_req_remap",
           "    row[old_cached_len:already_cached_len] = cached_slots[old_cached_len:already_cached_len]\n",
           "", ("(region: duplicate)", "region 'duplicate'", "the row would point at freed pages"),
           "frees the duplicate region without remapping the row"),
    Mutant("cache_req_remap", "= cached_slots[old_cached_len:already_cached_len]",
           "= cached_slots[0:already_cached_len - old_cached_len]",
           ("[page_size 1]", "(region: duplicate)", "the cached slot of the same position"),
           "remaps the duplicate region to the cache's slots of the wrong positions"),
    Mutant("cache_req_remap", "free = list(row_slots[old_cached_len:already_cached_len:page_size])",
           "free = list(row_slots[old_cached_len:already_cached_len])",
           ("free:", "one page start per page"), "frees token slots of the duplicate region, not page starts"),
]


@pytest.mark.parametrize("mutant", CH05_06_REQ, ids=lambda m: f"{m.exercise}: {m.why}")
def test_match_req_and_remap_mutants_are_rejected(mutant, mutant_dir):
    _reject(mutant, mutant_dir)


@pytest.mark.parametrize("exercise", ["match_req", "cache_req_remap"])
def test_the_unmutated_match_req_and_remap_solutions_pass(exercise, mutant_dir, capsys):
    solution = kvlab.solutions.get(exercise)
    last_line = _source(solution).splitlines()[-1]
    same = build_mutant(exercise, last_line, last_line + "  ", mutant_dir)
    assert getattr(kvlab.check, exercise)(same, n_random=1) > 0


def test_the_remap_checker_expects_the_row_the_cache_manager_leaves():
    # the checker's expected row is what kvlab.CacheManager.cache_req(finished=False) leaves
    from kvlab import CacheManager, Req
    from kvlab.check.ch06_cache_req import cache_req_remap_solution
    from kvlab.paging import new_page_table

    for P in (1, 2, 4):
        cm = CacheManager(32, P, new_page_table(3, 32, P))
        first, second = Req(list(range(11)), 0), Req(list(range(11)), 1)
        for r in (first, second):  # both admitted before either is cached: a duplicate region
            cm.admit(r)
        cm.allocate_paged([first, second])
        for r in (first, second):
            r.complete_one()
        cm.cache_req(first, finished=False)
        regions = cm.cache_req(second, finished=False)
        assert regions.duplicate.length > 0 and regions.remapped
        cached = second.cache_handle.get_matched_indices().tolist()
        mine = cache_req_remap_solution(regions.row_before.tolist(), cached, regions.old_cached_len,
                                        regions.already_cached_len, P)
        assert mine["row"] == regions.row_after.tolist()
        assert sorted(mine["free"]) == sorted(regions.freed_pages.tolist())
