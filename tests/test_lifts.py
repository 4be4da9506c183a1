"""Each lift cell runs with every form of an answer its checker accepts.

A checker's ✓ is a promise that the chapter's later cells work with that answer. Where a
statement allows an answer in more than one form (pages as a list or a tuple, slots of the
page table's dtype or int64, an output in float64 or in another memory order, a length as an
int or a one-element tensor), the lift cell that compares the learner's function with the
package's must take each of them. Here each form passes its checker first (so that
``kvlab.check.choose`` picks it, as in the notebook), then the chapter's own lift cell runs
with it. Before it, in one namespace as in the solutions build, run the chapter's first code
cell (its imports), every cell that defines an answer (``def my_...``) and the cells the lift
needs (named by a line they hold); the others only draw or measure.
"""
from __future__ import annotations

import linecache
import re
from pathlib import Path

import pytest
import torch

import kvlab.check
import kvlab.solutions

SRC = Path(__file__).resolve().parents[1] / "notebooks" / "src"
_REGION = re.compile(r"^\s*### (BEGIN|END) (SOLUTION|STARTER)\s*$")


def code_cells(chapter: str) -> list[str]:
    """The code cells of a chapter's solutions build, in order (starters left out)."""
    path = next(SRC.glob(f"{chapter}_*.py"))
    cells, current = [], None
    for line in path.read_text().split("\n"):
        if line.startswith("# %%"):
            current = None if "[markdown]" in line else []
            if current is not None:
                cells.append(current)
        elif current is not None:
            current.append(line)
    out = []
    for lines in cells:
        kept, starter = [], False
        for line in lines:
            m = _REGION.match(line)
            if m:
                starter = m.group(1) == "BEGIN" and m.group(2) == "STARTER"
                continue
            if not starter:
                kept.append(line)
        out.append("\n".join(kept))
    return out


def run(source: str, ns: dict, name: str) -> None:
    """Run one cell, its source known to ``linecache`` (``@triton.jit`` reads it, as in IPython)."""
    filename = f"<{name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), ns)  # noqa: S102 - the chapter's own cells


def lift_cell(chapter: str, exercise: str) -> int:
    """The index of the code cell that lifts ``exercise`` (its ``kvlab.check.choose``)."""
    call = re.compile(rf'kvlab\.check\.choose\(\s*"{re.escape(exercise)}"')  # wrapped or not
    return next(i for i, c in enumerate(code_cells(chapter)) if call.search(c))


class Chapter:
    """A chapter run up to (not including) the cell that lifts ``exercise``."""

    def __init__(self, chapter: str, exercise: str, needs: tuple[str, ...] | None = None):
        """``needs``: lines of the cells the lift needs besides the imports and the answers
        (None: every cell before the lift)."""
        cells, at = code_cells(chapter), lift_cell(chapter, exercise)
        self.chapter, self.lift, self.ns = chapter, cells[at], {"__name__": f"chapter_{chapter}"}
        for i, cell in enumerate(cells[:at]):
            if (needs is None or i == 0 or "\ndef my_" in f"\n{cell}"
                    or any(line in cell for line in needs)):
                run(cell, self.ns, f"chapter {chapter} cell {i}")

    def lifting(self, exercise: str) -> "Chapter":
        self.lift = code_cells(self.chapter)[lift_cell(self.chapter, exercise)]
        return self

    def lift_with(self, exercise: str, answer_name: str, form, capsys) -> None:
        getattr(kvlab.check, exercise)(form)
        assert kvlab.check.status(exercise) == "passed"
        self.ns[answer_name] = form
        capsys.readouterr()
        run(self.lift, self.ns, f"the lift of {exercise}")
        assert f"using your {form.__name__}" in capsys.readouterr().out


# --- the forms the checkers take --------------------------------------------------------------


def _solution(name):
    return kvlab.solutions.get(name)


def allocate_pages_as_a_tuple(cache, input_ids):
    pages, cached_len = _solution("allocate_pages")(cache, input_ids)
    return tuple(pages), cached_len


def hash_match_as_a_list(cache, input_ids):
    return list(_solution("hash_match")(cache, input_ids))


def pad_decode_batch_int64_slots(rows, positions, page_table, sizes, dummy_row):
    rows, positions, slots = _solution("pad_decode_batch")(rows, positions, page_table, sizes, dummy_row)
    return rows, positions, slots.long()


def pad_decode_batch_as_a_list(rows, positions, page_table, sizes, dummy_row):
    return list(_solution("pad_decode_batch")(rows, positions, page_table, sizes, dummy_row))


def paged_attention_step_float64(*args):
    return _solution("paged_attention_step")(*args).double()


def paged_attention_step_strided(*args):
    out = _solution("paged_attention_step")(*args)
    return out.transpose(0, 1).contiguous().transpose(0, 1)


def match_prefix_as_a_tensor(cache, input_ids):
    return torch.tensor([_solution("match_prefix")(cache, input_ids)])


def match_req_as_an_int(prefix_cache, input_ids):
    return _solution("match_req")(prefix_cache, input_ids).cached_len


def insert_prefix_with_tensors(store, input_ids, indices, page_size):
    cached_len, new = _solution("insert_prefix")(store, input_ids, indices, page_size)
    return torch.tensor(cached_len), {k: torch.tensor(v) for k, v in new.items()}


def cache_req_remap_as_tensors(*args):
    done = _solution("cache_req_remap")(*args)
    return {"row": torch.tensor(done["row"]), "free": tuple(done["free"])}


def cache_req_regions_as_lists(*args):
    return {k: list(v) for k, v in _solution("cache_req_regions")(*args).items()}


def paged_attention_float64(*args):
    return _solution("paged_attention")(*args).double()


# --- the chapters -------------------------------------------------------------------------------


@pytest.mark.slow
def test_chapter_05s_lift_takes_a_length_as_a_tensor_a_match_as_an_int_and_tensor_entries(capsys):
    chapter = Chapter("05", "match_prefix")
    for exercise, answer, form in [("match_prefix", "my_match_prefix", match_prefix_as_a_tensor),
                                   ("match_req", "my_match_req", match_req_as_an_int),
                                   ("insert_prefix", "my_page_store_insert", insert_prefix_with_tensors)]:
        chapter.lift_with(exercise, answer, form, capsys)


@pytest.mark.slow
def test_chapter_06s_lift_takes_rows_and_regions_in_any_sequence(capsys):
    chapter = Chapter("06", "cache_req_regions")
    chapter.lift_with("cache_req_remap", "my_cache_req_remap", cache_req_remap_as_tensors, capsys)
    chapter.lift_with("cache_req_regions", "my_cache_req_regions", cache_req_regions_as_lists, capsys)


@pytest.mark.slow
def test_chapter_08s_lift_takes_a_float64_torch_version(capsys):
    chapter = Chapter("08", "paged_attention", needs=("attend = kvlab.check.choose",))
    chapter.lift_with("paged_attention", "my_paged_attention_torch", paged_attention_float64, capsys)


@pytest.mark.slow
def test_chapter_10s_lifts_take_every_form_of_padding_and_of_a_step(capsys):
    needs = ("model = tiny_model(", "import random\n", "gen = PagedGenerator(", "def compare_with_generate")
    chapter = Chapter("10", "paged_attention_step", needs=needs)
    for form in (paged_attention_step_float64, paged_attention_step_strided):
        chapter.lift_with("paged_attention_step", "my_paged_attention_step", form, capsys)
    chapter.lifting("pad_decode_batch")
    for form in (pad_decode_batch_int64_slots, pad_decode_batch_as_a_list):
        chapter.lift_with("pad_decode_batch", "my_pad_decode_batch", form, capsys)


@pytest.mark.slow
def test_chapter_11s_lift_takes_pages_as_a_tuple_and_a_match_as_a_list(capsys):
    chapter = Chapter("11", "page_hashes", needs=())
    chapter.lift_with("allocate_pages", "my_allocate_pages", allocate_pages_as_a_tuple, capsys)
    chapter.lift_with("hash_match", "my_hash_match", hash_match_as_a_list, capsys)


def victim_order_as_a_tuple(policy, running):
    return tuple(_solution("victim_order")(policy, running))


def resume_plan_as_lists(how, saved, hit, input_len, host_pages, row, page_size):
    copies, compute = _solution("resume_plan")(how, saved, hit, input_len, host_pages, row, page_size)
    return [list(c) for c in copies], list(compute)


@pytest.mark.slow
def test_chapter_12s_lift_takes_an_order_as_a_tuple_and_a_plan_as_lists(capsys):
    chapter = Chapter("12", "victim_order", needs=())
    chapter.lift_with("victim_order", "my_victim_order", victim_order_as_a_tuple, capsys)
    chapter.lift_with("resume_plan", "my_resume", resume_plan_as_lists, capsys)


def eviction_as_lists(nodes, need_pages, host_free, policy):
    victims, spills = _solution("write_back_eviction")(nodes, need_pages, host_free, policy)
    return [list(v) for v in victims], tuple(spills)


def load_plan_as_tuples(path, free_slots, page_size):
    pages, copies, slots = _solution("load_back_plan")(path, free_slots, page_size)
    return tuple(pages), [list(c) for c in copies], tuple(slots)


@pytest.mark.slow
def test_chapter_13s_lift_takes_victims_as_lists_and_a_plan_as_tuples(capsys):
    chapter = Chapter("13", "write_back_eviction", needs=("layout = KVLayout",))
    chapter.lift_with("write_back_eviction", "my_eviction", eviction_as_lists, capsys)
    chapter.lift_with("load_back_plan", "my_load_plan", load_plan_as_tuples, capsys)
