"""Mutation suite: bugs planted in correct solutions must be rejected, with the right blame, and
correct rewrites must be accepted.

A mutant is the reference solution's source (``inspect.getsource`` of
``kvlab.solutions.get(name)``) with one textual change - the kind of slip a learner makes. The
exercise's checker must raise :class:`CheckFailed`, and the message must name where the bug is:
the argument read or written, the request, the part of ``alloc_extend``, the page-table row, the
region of ``cache_req``, the step of a decode step. The classes covered:

* wrong values (lengths, offsets, page arithmetic, rounding);
* shapes only some inputs have (a radix walk leaving a node part-way, slots past 2**31);
* memory accesses outside an argument, also reads whose value never reaches an output;
* races (every program stores ``ret_values``): right in one program order only;
* calls in the wrong order (``decode_step``).

A rewrite is a different but correct answer: the checker must accept it.
"""
from __future__ import annotations

import importlib.util
import inspect
import itertools
import re
import textwrap

import pytest
import torch

import kvlab.check
import kvlab.solutions
from kvlab.check import CheckFailed
from mutant_kinds import KINDS, Mutant, Rewrite, WrongAnswer
from mutants_ch09_12 import MUTANTS_CH09_12, REWRITES_CH09_12, WRONG_ANSWERS_CH09_12
from mutants_ch10_11 import (MUTANTS_CH10_11, OTHER_SHAPES_CH10_11, REWRITES_CH10_11,
                             WRONG_ANSWERS_CH10_11, mutant_globals)

_counter = itertools.count()


def _source(obj) -> str:
    return textwrap.dedent(inspect.getsource(getattr(obj, "fn", obj)))


def _absolute_imports(src: str, module: str) -> str:
    """``from ...serving.hf import x`` in ``module`` -> ``from kvlab.serving.hf import x``."""
    package = module.split(".")[:-1]

    def absolute(m: re.Match) -> str:
        base = package[: len(package) - (len(m.group(1)) - 1)]
        return "from " + ".".join(base + ([m.group(2)] if m.group(2) else [])) + " import"
    return re.sub(r"from (\.+)([\w.]*) import", absolute, src)


def build_mutant(exercise: str, old: str, new: str, tmp_dir):
    """The solution of ``exercise`` with ``old`` replaced by ``new``, loaded from a real file.

    A real file (not ``exec``), because ``@triton.jit`` reads its function's source, and so
    that messages can quote the mutant's lines.
    """
    solution = kvlab.solutions.get(exercise)
    fn = getattr(solution, "fn", solution)
    src = _source(solution)
    assert old in src, f"the mutation target {old!r} is not in the solution of {exercise}"
    mutated = src.replace(old, new)
    assert mutated != src
    mutated = _absolute_imports(mutated, fn.__module__)  # a relative import, as a learner writes it
    path = tmp_dir / f"mutant_{next(_counter)}_{exercise}.py"
    path.write_text(mutated)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    module.__dict__.update({k: v for k, v in fn.__globals__.items() if not k.startswith("__")})
    module.__dict__.update(mutant_globals())
    spec.loader.exec_module(module)
    return getattr(module, fn.__name__)


@pytest.fixture(scope="module")
def mutant_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mutants")


def _reject(mutant: Mutant | WrongAnswer, tmp_dir) -> str:
    """The checker rejects ``mutant``, saying what ``must_say`` says; a cause it names ("looks
    like ...") is the slip made, never another one (a diagnosis names the slip or nothing)."""
    checker = getattr(kvlab.check, mutant.exercise)
    bad = (mutant.answer if isinstance(mutant, WrongAnswer)
           else build_mutant(mutant.exercise, mutant.old, mutant.new, tmp_dir))
    with pytest.raises(CheckFailed) as info:
        checker(bad)
    msg = str(info.value)
    for needle in mutant.must_say:
        assert needle in msg, f"{mutant.why}: the message should say {needle!r}:\n{msg}"
    for cause in re.findall(r"looks like (.*)", msg):
        assert any(needle in f"looks like {cause}" for needle in mutant.must_say), (
            f"{mutant.why}: the message names a cause the mutant's must_say does not expect:\n"
            f"looks like {cause}\n(a diagnosis must name the slip made, or nothing)")
    return msg


# --- chapter 00: pages_needed -------------------------------------------------------------

CH00 = [
    Mutant("pages_needed", "div_ceil(n, page_size)", "n // page_size",
           ("pages per request: ", "(request 0 (11 tokens))"), "floor instead of ceil"),
    Mutant("pages_needed", "div_ceil(n, page_size)", "n // page_size + 1",
           ("[page_size 1 (a page is one slot)]", "(request 0 (5 tokens))"),
           "one page too many when the last page is exactly full"),
    Mutant("pages_needed", "div_ceil(n, page_size)", "n / page_size",
           ("every entry should be an int",), "true division: floats instead of page counts"),
]

# --- chapter 01: page_to_token ------------------------------------------------------------

CH01 = [
    Mutant("page_to_token", "page_starts.unsqueeze(1) + offsets", "page_starts.unsqueeze(1) + 0 * offsets",
           ("slots: ", "positions differ", "(page 0 (start"), "without the offsets: every slot is its page's start"),
    Mutant("page_to_token", "(page_starts.unsqueeze(1) + offsets).flatten()",
           "(page_starts.unsqueeze(1) + offsets).t().flatten()",
           ("slots: ", "positions differ", "(page 0 (start"), "wrong stride: slots read column by column"),
    Mutant("page_to_token", "if page_size == 1:", "if page_size <= 4:",
           ("slots has 2 values, expected 8",), "the page_size 1 shortcut taken for small pages"),
    Mutant("page_to_token", "torch.arange(page_size,", "torch.arange(1, page_size + 1,",
           ("slots: ", "positions differ", "(page 0 (start"), "offsets 1..page_size instead of 0..page_size-1"),
    Mutant("page_to_token", "(page_starts.unsqueeze(1) + offsets).flatten()",
           "(page_starts.unsqueeze(1) + offsets).flatten().to(torch.int32)",
           ("[large page ids (int64)]", "(page 0 (start"), "slots squeezed into int32"),
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
    Mutant("write_page_table", "cols[offset: offset + length] = torch.arange(first_pos, last_pos)",
           "cols[offset: offset + length] = torch.arange(first_page, first_page + length)",
           ("page table differs", "request row 1, logical column 2",
            "no allocation_info entry covers this cell"),
           "columns counted from first_page instead of first_page * page_size"),
    Mutant("write_page_table", "rows[offset: offset + length] = table_idx",
           "rows[offset: offset + length] = table_idx - 1",
           ("page table differs", "request row"), "rows off by one"),
]

# --- chapter 03: the three parts of alloc_extend_kernel ---------------------------------------

CH03 = [
    Mutant("alloc_extend_part1", "last_loc + 1 + offset_one_page", "last_loc + offset_one_page",
           ("request 0, part 1",), "part 1 starts at last_loc instead of last_loc + 1"),
    Mutant("alloc_extend_part1",
           "tl.minimum(seq_len, (pre_len + page_size - 1) // page_size * page_size) - pre_len\n",
           "tl.minimum(seq_len, (pre_len + page_size - 1) // page_size * page_size) - pre_len - 1\n",
           ("part 1",), "off-by-one in part 1's length"),
    Mutant("alloc_extend_part1",
           "tl.minimum(seq_len, (pre_len + page_size - 1) // page_size * page_size) - pre_len\n",
           "tl.minimum(seq_len, pre_len // page_size * page_size) - pre_len\n",
           ("a write before the start of `out_indices`", "by request 0"),
           "floor instead of ceil for the end of the old page"),
    Mutant("alloc_extend_part1", "mask=offset_one_page < num_part1,", "mask=offset_one_page <= num_part1,",
           ("[the chapter's worked example", "request 0, part 1 wrote 1 slot(s) outside its own "
            "positions, at out_indices[58:59], which belong to request 0, part 3", "mask"),
           "part 1's store mask off by one: the audit sees part 1 write into part 3's positions", "state"),
    Mutant("alloc_extend_part1", "    if pre_len + num_part1 == seq_len:  # everything fitted in the old page\n"
           "        return\n", "",
           ("a read before the start of `free_page_ptr`", "by request 0, part 3",
            "request 0 has no part 3 or later part in this case: should it have returned?"),
           "no early return after part 1: a request without new pages runs part 3"),
    Mutant("alloc_extend_part1", "last_loc = tl.load(last_loc_ptr + pid)",
           "last_loc = tl.load(last_loc_ptr + pid + 1)",
           ("a read past the end of `last_loc_ptr`", "part 1"),
           "loads the next request's last_loc"),
    Mutant("alloc_extend_part2", "page_start * page_size + offset_many_page % page_size",
           "page_start * page_size + offset_many_page",
           ("part 2",), "part 2 forgets that each page holds only page_size slots (k, not k % P)"),
    Mutant("alloc_extend_part2", "num_pages_before = (pre_lens + page_size - 1) // page_size",
           "num_pages_before = pre_lens // page_size",
           ("part 2",), "floor instead of ceil when counting the pages a prefix holds"),
    Mutant("alloc_extend_part2",
           "        page_start * page_size + offset_many_page % page_size,\n"
           "        mask=offset_many_page < num_part2,\n",
           "        page_start * page_size + offset_many_page % page_size,\n",
           ("a write past the end of `out_indices`", "part 2"), "missing mask on part 2's store"),
    Mutant("alloc_extend_part2", "        mask=offset_many_page < num_part2,\n        other=0,\n",
           "        mask=offset_many_page < max_num_extend_tokens,\n        other=0,\n",
           ("a read past the end of `free_page_ptr`", "by request 1, part 2", "line",
            "inputs: pre=[2, 0, 5]"),
           "part 2's page load unmasked (the store still masked): a read that never reaches an output"),
    Mutant("alloc_extend_part2",
           "seq_lens = tl.load(seq_lens_ptr + load_offset, mask=load_offset <= pid, other=0)",
           "seq_lens = tl.load(seq_lens_ptr + load_offset)",
           ("a write past the end of `out_indices`", "by request 0, part 1"),
           "the length loads unmasked: every program sums every request"),
    Mutant("alloc_extend_part2", "page_start * page_size + offset_many_page % page_size",
           "page_start.to(tl.int32) * page_size + offset_many_page % page_size",
           ("[slots past 2**31", "request 1, part 2"), "part 2's slot arithmetic in int32"),
    Mutant("alloc_extend_part2", "out_indices + output_start_loc + num_part1 + offset_many_page,",
           "out_indices + output_start_loc + offset_many_page,",
           ("request 0, part 2 wrote", "which belong to request 0, part 1"),
           "part 2's slots start where part 1's do", "blame"),
    Mutant("alloc_extend_part2", "new_page_start_loc = sum_num_new_pages - num_page_start_loc_self",
           "new_page_start_loc = sum_num_new_pages",
           ("a read past the end of `free_page_ptr`", "part 2"),
           "each request takes the pages after its own"),
    Mutant("alloc_extend_part3",
           "free_page_ptr + new_page_start_loc + num_page_start_loc_self - 1)",
           "free_page_ptr + new_page_start_loc + num_page_start_loc_self - 2)",
           ("part 3",), "wrong free-page index for part 3's page"),
    Mutant("alloc_extend_part3", "start_loc * page_size + offset_one_page",
           "start_loc * page_size + offset_one_page + 1",
           ("request 0, part 3",), "part 3 starts at offset 1 of its page"),
    Mutant("alloc_extend_part3", "tl.store(ret_values, merged_value)",
           "tl.store(ret_values, sum_extend_lens.to(tl.int64))",
           ("ret_values",), "ret_values without the page count in the high 32 bits"),
    Mutant("alloc_extend_part3", "start_loc * page_size + offset_one_page",
           "start_loc.to(tl.int32) * page_size + offset_one_page",
           ("[slots past 2**31", "request 0, part 3"), "part 3's slot arithmetic in int32"),
    Mutant("alloc_extend_part3", "if pid == tl.num_programs(0) - 1:\n        merged_value",
           "if True:\n        merged_value",
           ("depends on the order in which its programs run", "ret_values",
            "pid == tl.num_programs(0) - 1"),
           "every program stores ret_values: a race"),
    Mutant("alloc_extend_part3", "mask=offset_one_page < num_part3,", "mask=offset_one_page <= num_part3,",
           ("a write past the end of `out_indices` (up to 1 element out) by request 1, part 3",),
           "part 3's store mask off by one", "state"),
    Mutant("alloc_extend_part3",
           "merged_value = (sum_num_new_pages.to(tl.int64)) << 32 | sum_extend_lens.to(tl.int64)",
           "merged_value = (sum_extend_lens.to(tl.int64)) << 32 | sum_num_new_pages.to(tl.int64)",
           ("ret_values holds",), "pages and tokens swapped in ret_values"),
]

# --- chapter 04: alloc_decode_kernel ---------------------------------------------------------

CH04 = [
    Mutant("alloc_decode",
           "num_page_start_loc_self = (seq_len + page_size - 1) // page_size - (\n"
           "        pre_len + page_size - 1\n    ) // page_size",
           "num_page_start_loc_self = seq_len // page_size - pre_len // page_size",
           ("out_indices: ", "positions differ", "request 0, new page"),
           "decode takes a new page at the wrong boundary (seq % P == 0, not (seq - 1) % P == 0)"),
    Mutant("alloc_decode", "tl.store(out_indices + pid, last_loc + 1)",
           "tl.store(out_indices + pid, last_loc)",
           ("request 0, same page: last_loc + 1",), "decode writes last_loc instead of last_loc + 1"),
    Mutant("alloc_decode", "tl.store(out_indices + pid, page * page_size)",
           "tl.store(out_indices + pid, page)",
           ("new page: free_pages[",), "decode stores the page id, not its first slot"),
    Mutant("alloc_decode", "tl.store(out_indices + pid, page * page_size)",
           "tl.store(out_indices + pid, page.to(tl.int32) * page_size)",
           ("[page_size 64, slots past 2**31", "request 0, new page"), "decode's slot arithmetic in int32"),
    Mutant("alloc_decode", "if pid == tl.num_programs(0) - 1:", "if True:",
           ("depends on the order in which its programs run", "ret_values holds"),
           "every decode program stores ret_values: a race"),
    Mutant("alloc_decode", "seq_lens = tl.load(seq_lens_ptr + load_offset, mask=load_offset <= pid, other=0)",
           "seq_lens = tl.load(seq_lens_ptr + load_offset)",
           ("a read past the end of `seq_lens_ptr`", "by request 0"),
           "the length load unmasked: reads past seq_lens"),
    Mutant("alloc_decode", "last_loc = tl.load(last_loc_ptr + pid)",
           "last_loc = tl.load(last_loc_ptr + pid + 1)",
           ("a read past the end of `last_loc_ptr`", "by request 0"),
           "decode loads the next request's last_loc"),
    Mutant("alloc_decode", "tl.store(ret_values, sum_num_new_pages.to(tl.int64))",
           "tl.store(ret_values, num_page_start_loc_self.to(tl.int64))",
           ("ret_values holds",), "ret_values counts only the last request's page", "state"),
]

# --- chapter 05: the radix prefix cache --------------------------------------------------------

CH05 = [
    Mutant("match_prefix", "        n = n // P * P  # a partly matched page does not count\n", "",
           ("matched length", "is not a whole number of pages"),
           "a partly matched page is counted as cached"),
    Mutant("match_prefix", "and child.key[n] == input_ids[matched + n]:", ":",
           ("matched length", "tokens the cache does not hold"),
           "takes a child's whole key after its first page matched, without comparing the rest"),
    Mutant("match_prefix", "        if n < child.length:  # the prompt leaves this node part-way: stop here\n"
           "            break\n", "",
           ("[diverges on a page boundary inside a node", "leaves the node with key [1, 2, 3, 4]",
            "the match stops there"),
           "keeps walking after the prompt left a node part-way"),
    Mutant("match_prefix", "while len(input_ids) - matched >= P:", "while len(input_ids) - matched > P:",
           ("[prompt runs out at a page boundary inside a node] matched length: expected 2, got 0",),
           "stops before a last page that is exactly full"),
    Mutant("match_prefix", "        node = child\n", "        break\n",
           ("[page_size 1] matched length: expected 2, got 1",), "never goes below the first node"),
    Mutant("insert_prefix", "insert_len = len(input_ids) // P * P", "insert_len = len(input_ids)",
           ("new_entries", "not a whole page of the prompt"), "page-unaligned insert of the partial last page"),
    Mutant("insert_prefix", "new_entries[tuple(input_ids[:start + P])]",
           "new_entries[tuple(input_ids[start:start + P])]",
           ("new_entries: missing the page ending at position",),
           "keys a page by its own tokens instead of the whole prefix"),
    Mutant("insert_prefix", "cached_len += P  # this page is already there",
           "store[tuple(input_ids[:cached_len + P])] = []; cached_len += P  # this page is already there",
           ("your code changed `store`, an argument it must only read", "store[(1, 2)]"),
           "changes the store while looking pages up", "input"),
    Mutant("insert_prefix", "while cached_len < insert_len and", "while cached_len + P < insert_len and",
           ("cached_len: expected",), "stops one page short when counting cached pages"),
    Mutant("insert_prefix", "list(indices[start:start + P])", "list(indices[:P])",
           ("new_entries[", "expected slots"), "every new page gets the first page's slots"),
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
    Mutant("cache_req_regions", '"tail": (new_cached_len, req_cached_len)',
           '"tail": (already_cached_len, req_cached_len)', ("region 'tail' is wrong",),
           "tail region starts where the duplicates end"),
    Mutant("cache_req_regions", '"hit": (0, old_cached_len)', '"hit": (0, already_cached_len)',
           ("region 'hit' is wrong",), "the hit region swallows the duplicates"),
]

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
    Mutant("match_req", "input_ids[: len(input_ids) - 1]", "input_ids[1:]",
           ("[whole prompt cached (page_size 4)] matched 0 tokens; expected 12",),
           "drops the first token instead of the last"),
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
    Mutant("cache_req_remap", "free = list(row_slots[old_cached_len:already_cached_len:page_size])",
           "free = list(row_slots[old_cached_len::page_size])",
           ("free:", "nothing else is freed while the request runs"),
           "frees the inserted pages and the tail of a running request too"),
    Mutant("cache_req_remap",
           "row[old_cached_len:already_cached_len] = cached_slots[old_cached_len:already_cached_len]",
           "row[old_cached_len:] = cached_slots[old_cached_len:]",
           ("row has", "only the duplicate region changes"), "remaps past the duplicate region", "state"),
]

# --- chapters 07-09: the serving loop, attention through the page table, the scan kernel ----

_ADVANCE = ("    for req, token in zip(reqs, next_tokens):\n"
            "        req.append_token(token)           # the token this step produced\n"
            "        req.complete_one()                # cached_len = device_len; device_len += 1\n")
_FINISH = ("    for req, finished in zip(reqs, done):\n"
           "        if finished:\n"
           "            manager.cache_req(req, finished=True)")

CH07_09 = [
    Mutant("decode_step", "manager.cache_req(req, finished=True)",
           "manager.cache_req(req, finished=False)", ("request 0: finished should be True",),
           "hands a done request back as unfinished (its pages stay locked)"),
    Mutant("decode_step", "    manager.allocate_paged(reqs)          # a new page", "    # a new page",
           ("step 1 (pages): manager.allocate_paged(reqs) was never called", "page_table["),
           "advances requests without mapping their new pages"),
    Mutant("decode_step", _ADVANCE + _FINISH, _FINISH + "\n" + _ADVANCE.rstrip("\n"),
           ("request 0, step 3 (finish): cache_req", "came before its complete_one",
            "the order of a decode step"),
           "hands a done request back before advancing it"),
    Mutant("decode_step", "manager.cache_req(req, finished=True)", "manager.release_req(req)",
           ("request 0, step 3 (finish): release_req", "instead of manager.cache_req"),
           "aborts a done request instead of caching it"),
    Mutant("decode_step", "    manager.allocate_paged(reqs)          # a new page where cached_len sits on a page boundary\n"
           + _ADVANCE, _ADVANCE + "    manager.allocate_paged(reqs)\n",
           ("step 2 (advance)", "came before manager.allocate_paged(reqs)"),
           "maps pages after advancing the requests"),
    Mutant("decode_step", "        req.append_token(token)           # the token this step produced\n",
           "        req.append_token(token)\n        req.append_token(token)\n",
           ("request 0: input_ids should end",), "appends the step's token twice"),
    Mutant("paged_attention", "page_table[row, :n]", "page_table[row, :n - 1]",
           ("request 0, head", "off by", "looks like it attends to one position too few"),
           "attends to one token too few"),
    Mutant("paged_attention", " * scale, dim=-1", ", dim=-1",
           ("forgets the 1/sqrt(head_dim) scale",), "attention without the 1/sqrt(d) scale"),
    Mutant("paged_attention", "row, n = int(table_idx[b]), int(seq_lens[b])",
           "row, n = b, int(seq_lens[b])",
           ("request", "uses row b instead of row table_idx[b]"), "reads row b, not row table_idx[b]", "lucky"),
    Mutant("paged_attention", "slots = page_table[row, :n].long()", "slots = torch.arange(n)",
           ("request", "reads slots 0..seq_len-1 of the pool directly"),
           "reads the pool by position, not through the page table"),
    Mutant("paged_attention", " * scale, dim=-1)", " * scale, dim=0)",
           ("request 0, head",), "softmax over the heads instead of the positions"),
    Mutant("extend_scan", "carry_tokens + tl.cumsum(extend, axis=0) - extend",
           "carry_tokens + tl.cumsum(extend, axis=0)", ("token_start: ", "request 0"),
           "inclusive instead of exclusive prefix sum"),
    Mutant("extend_scan", "carry_pages + tl.cumsum(pages, axis=0) - pages",
           "tl.cumsum(pages, axis=0) - pages", ("page_start: ", "block 1"),
           "drops the carry from earlier blocks"),
    Mutant("extend_scan", "pre = tl.load(prefix_lens_ptr + offs, mask=mask, other=0)",
           "pre = tl.load(prefix_lens_ptr + offs)",
           ("a read past the end of `prefix_lens_ptr`", "by program 0", "line",
            "inputs: prefix_lens="),
           "unmasked load past the batch: the answer is right, the read is not"),
    Mutant("extend_scan", "pages = (seq + page_size - 1) // page_size - (pre + page_size - 1) // page_size",
           "pages = seq // page_size - pre // page_size", ("page_start: ", "request"),
           "floor instead of ceil when counting pages"),
    Mutant("extend_scan", "        carry_pages += tl.sum(pages, axis=0)\n", "",
           ("page_start: ", "block 1"), "the page carry never grows"),
]

CH08_KERNEL = [
    Mutant("paged_attention_kernel", "acc = acc * alpha + tl.sum(p[:, None] * v, 0)",
           "acc = acc + tl.sum(p[:, None] * v, 0)",
           ("request 0, head 1", "looks like acc is not rescaled"), "the online softmax forgets to rescale acc"),
    Mutant("paged_attention_kernel", "        m_i = m_new\n", "",
           ("request 0, head 1", "looks like m_i is never updated"), "the running max never moves"),
    Mutant("paged_attention_kernel", "p = tl.exp(scores - m_new)", "p = tl.exp(scores)",
           ("request 0, head 1", "looks like p = exp(scores) without the running max"),
           "block weights without the running max"),
    Mutant("paged_attention_kernel",
           "slots = tl.load(page_table_ptr + row * stride_pt_row + offs_n, mask=mask_n, other=0)",
           "slots = tl.load(page_table_ptr + row * stride_pt_row + offs_n)",
           ("a read past the end of `page_table_ptr`", "by program (0, 0)", "line"),
           "the page-table row loaded past the request's length"),
]

# --- chapter 09: decode attention at the memory floor (the first pass's loads, the merge) ------

_SLOTS = "slots = tl.load(page_table_ptr + row * stride_pt_row + offs_n, mask=mask_n, other=0).to(tl.int64)"
_KV_HEAD = "kv = slots * stride_kv_s + g * stride_kv_h  #"
_SPLIT_LEN = "split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N"

CH09_ATTENTION = [
    Mutant("split_attention", _KV_HEAD, "kv = slots * stride_kv_s + g * GROUP * stride_kv_h  #",
           ("query head 2 (K/V head 1)", "looks like program (b, g, s) reads K/V head g * GROUP"),
           "a group reads the K/V head numbered like its first query head"),
    Mutant("split_attention", _KV_HEAD, "kv = slots * stride_kv_s + 0 * stride_kv_h  #",
           ("looks like every program reads K/V head 0",), "every group reads K/V head 0"),
    Mutant("split_attention", _SLOTS,
           "slots = (tl.load(page_table_ptr + row * stride_pt_row + n0) + tl.arange(0, BLOCK_N)).to(tl.int64)",
           ("[page_size 3: every block crosses pages]", "a block that crosses a page boundary"),
           "a block reads consecutive slots from its first one (right while a block stays in one page)",
           "lucky"),
    Mutant("split_attention", "        for n0 in range(start, end, BLOCK_N):\n",
           "        tl.store(q_ptr + b.to(tl.int64) * stride_q_b + heads[:, None] * stride_q_h + offs_d[None, :], "
           "q * scale, mask=mask_h[:, None] & mask_d[None, :])\n        for n0 in range(start, end, BLOCK_N):\n",
           ("your code changed `q_ptr`",), "scales q in place", "input"),
    Mutant("split_attention", _SPLIT_LEN, "split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), 16) * 16",
           ("[BLOCK_N 32, four splits of 40 positions: one block each]",), "splits of blocks of 16 written in",
           "param"),
    Mutant("split_attention", 'm_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")', 'm_i = -float("inf")',
           ("does not compile for a GPU", "Loop-carried variable m_i"),
           "the running max starts as a scalar and becomes a vector of the group's heads", "compiled"),
    Mutant("merge_splits", "        alpha = tl.exp(m - m_new)  # rescales what was summed under the old max (0 at first)\n"
           "        w = tl.exp(lse - m_new)  # this split's weight, at most 1\n",
           "        alpha = 1.0\n        w = tl.exp(lse)  # each split weighted by its sum of exp(score)\n",
           ("[large scores: exp(lse) overflows float32 without the max]",
            "looks like the splits are weighted by exp(lse) without the max correction"),
           "a split merge without the max correction (right while scores are small)", "lucky"),
    Mutant("merge_splits", "acc = acc * alpha + w * o", "acc = acc + w * o",
           ("looks like acc is not rescaled when the max grows",), "the merge forgets to rescale acc"),
    Mutant("merge_splits", "        m = m_new\n", "",
           ("[two splits, scores of a few units]", "looks like m is never updated"), "the merge's max never moves"),
    Mutant("merge_splits", "alpha = tl.exp(m - m_new)", "alpha = 1.0",
           ("looks like alpha is 1",), "nothing summed under the old max is rescaled"),
    Mutant("merge_splits", "        m = m_new\n",
           "        m = m_new\n        tl.store(lse_ptr + b * stride_l_b + h * stride_l_h + s, lse - m)\n",
           ("your code changed `lse_ptr`",), "normalises the lse in place", "input"),
    Mutant("merge_splits", _SPLIT_LEN, "split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), 16) * 16",
           ("[BLOCK_N 32, ragged lengths, page_size 3]",), "splits of blocks of 16 written in", "param"),
    Mutant("merge_splits", "total = 0.0", "total = 0",
           ("does not compile for a GPU", "total", "write 0.0, not 0"),
           "total starts as the int 0: a loop carry that becomes a float", "compiled"),
]

# --- chapter 11: the hash-chained cache --------------------------------------------------

CH11 = [
    Mutant("page_hashes", "chain_hash(parent, input_ids", "chain_hash(None, input_ids",
           ("hash of page 1", "your hash ignores the parent"), "a page hash that ignores the parent"),
    Mutant("page_hashes", "len(input_ids) - page_size + 1", "len(input_ids)",
           ("[a partial last page has no hash]", "a partial page, which has no hash"),
           "hashes the partial last page"),
    Mutant("hash_match", "parent = chain_hash(parent, tokens)", "parent = chain_hash(None, tokens)",
           ("matched pages: expected 4, got 1", "page 1 ([3, 4]) is cached, as page"),
           "match hashes each page without its parent"),
    Mutant("hash_match", "            break  #", "            continue  #",
           ("[stop at the first miss, though later pages are cached]", "looks like it walks past a page"),
           "match walks past a page that is not cached"),
    Mutant("hash_match", "slots = [page * P + i for page in pages for i in range(P)]", "slots = list(pages)",
           ("slots of the matched pages", "looks like these are the page ids"), "returns page ids instead of slots"),
    Mutant("allocate_pages", "h = chain_hash(parent, tokens) if full else None",
           "h = chain_hash(None, tokens) if full else None",
           ("page 7 is cached under", "the chained hash of every token up to its end"),
           "allocation caches pages under a hash that ignores the parent"),
    Mutant("allocate_pages", "full = len(tokens) == P", "full = len(tokens) > 0",
           ("holds a partial page", "only full pages are cached"), "allocation caches (and matches) a partial page"),
    Mutant("allocate_pages", "            hitting = False  #", "            pass  #",
           ("[a later page cached, an earlier one not: stop at the miss]", "cached_len should be 0"),
           "allocation keeps hitting after a miss"),
    Mutant("allocate_pages", "cache.take_cached(page)  #", "cache.ref_count[page] += 1  #",
           ("[hits on free cached pages: they leave the queue]", "takes it out of the queue"),
           "a hit on a free page stays in the free queue"),
    Mutant("allocate_pages", "            if full:\n                cache.cache_page",
           "            if False:\n                cache.cache_page",
           ("should be findable under hash", "a new full page is cached"), "new full pages are never cached"),
    Mutant("free_pages", "if cache.ref_count[page] < list(pages).count(page):", "if False:",
           ("[pages freed already: refuse, change nothing]", "no count goes below zero"),
           "a reference count that goes negative"),
    Mutant("free_pages", "cache.free_queue.append(page)  #",
           "cache.free_queue.append(page); del cache.hash_to_page[cache.page_hash[page]]; "
           "cache.page_hash[page] = None  #",
           ("should be findable under hash", "a freed page keeps its hash"),
           "a freed page dropped from the hash map"),
    Mutant("free_pages", "for page in reversed(pages):", "for page in pages:",
           ("[free one sequence: last page first]", "free queue (head first) should be"),
           "frees the first page first (the chain's beginning is evicted before its end)"),
    Mutant("free_pages", "if cache.ref_count[page] == 0:", "if cache.ref_count[page] <= 1:",
           ("[shared pages stay out of the queue]", "free queue"), "queues a page another sequence still holds"),
]


# --- blind spots: one class at a time, for every exercise it applies to -------------------------

_ALIGNED_PART1 = ("tl.minimum(seq_len, (pre_len + page_size - 1) // page_size * page_size) - pre_len\n",
                  "tl.minimum(seq_len, (pre_len // page_size + 1) * page_size) - pre_len\n")
_SCAN_INIT = "carry_tokens = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)  # an int64 scalar 0"
_DECODE_BRANCHES = ("    if num_page_start_loc_self == 0:\n        # same page: right after my last token\n"
                    "        last_loc = tl.load(last_loc_ptr + pid)\n        tl.store(out_indices + pid, last_loc + 1)\n"
                    "    else:\n        # a fresh page: its first slot\n"
                    "        page = tl.load(free_page_ptr + new_page_start_loc)\n"
                    "        tl.store(out_indices + pid, page * page_size)")

BLIND_SPOTS = [
    # chapter 00
    Mutant("pages_needed", "    return [div_ceil(n, page_size) for n in lengths]",
           "    lengths[:] = [div_ceil(n, page_size) for n in lengths]\n    return lengths",
           ("your code changed `lengths`", "`lengths[0]` was 11, now 3"),
           "writes the page counts over the caller's lengths and returns them", "input"),
    Mutant("pages_needed", "div_ceil(n, page_size)", "div_ceil(n, 4)",
           ("[page_size 1 (a page is one slot)]", "(request 0 (5 tokens))"),
           "a page size of 4 written in", "param"),
    # chapter 01
    Mutant("page_to_token", "    offsets = torch.arange(page_size,",
           "    pages = page_starts.div_(page_size, rounding_mode='floor')  # (reuses the input)\n"
           "    page_starts = pages * page_size\n    offsets = torch.arange(page_size,",
           ("your code changed `page_starts`",), "turns the caller's page starts into page ids", "input"),
    Mutant("page_to_token", "torch.arange(page_size, dtype", "torch.arange(4, dtype",
           ("[a single page] slots has 4 values, expected 8",), "offsets for a page size of 4", "param"),
    Mutant("page_to_token", "return (page_starts.unsqueeze(1) + offsets).flatten()",
           "return page_starts[:1] + torch.arange(len(page_starts) * page_size, dtype=page_starts.dtype,\n"
            "                                        device=page_starts.device)",
           ("[pages out of order]", "(page 1 (start 4))"),
           "assumes the pages follow each other (true for the example's pages)", "lucky"),
    # chapter 02
    Mutant("write_page_table", "    page_table[rows.to(page_table.device)",
           "    allocation_info.clear()  # (all written)\n    page_table[rows.to(page_table.device)",
           ("your code changed `allocation_info`", "`allocation_info` had 1 item, now 0"),
           "empties the caller's allocation_info", "input"),
    Mutant("write_page_table", "first_pos, last_pos = first_page * page_size, last_page * page_size",
           "first_pos, last_pos = first_page * 4, last_page * 4",
           ("[page_size 1]", "line 11"), "a page size of 4 written in", "param"),
    Mutant("write_page_table", "rows[offset: offset + length] = table_idx",
           "rows[offset: offset + length] = allocation_info.index((table_idx, first_page, last_page))",
           ("[page_size 1]", "request row 0"), "the entry's index as its row (right while rows are in order)",
           "lucky"),
    Mutant("write_page_table", "        offset += length\n",
           "        offset += length\n        page_table[table_idx, :first_pos] = -1  # (a fresh row)\n",
           ("no allocation_info entry covers this cell: it should have been left as it was",),
           "clears the row's earlier pages", "state"),
    Mutant("write_page_table", "    page_table[rows.to(page_table.device), cols.to(page_table.device)] = allocated.to(page_table.dtype)",
           "    page_table = page_table.clone()\n"
           "    page_table[rows.to(page_table.device), cols.to(page_table.device)] = allocated.to(page_table.dtype)\n"
           "    return page_table",
           ("returned a new page table instead of writing into page_table",),
           "returns a new table instead of writing in place"),
    # chapter 03
    Mutant("alloc_extend_part1", "    offset_one_page = tl.arange(0, page_size)\n",
           "    offset_one_page = tl.arange(0, page_size)\n"
           "    tl.store(last_loc_ptr + pid, last_loc + num_part1, mask=num_part1 > 0)  # (moved on)\n",
           ("your code changed `last_loc_ptr`", "last_loc_ptr[0] was 133, now 191"),
           "moves the caller's last_loc on", "input"),
    Mutant("alloc_extend_part1", *_ALIGNED_PART1[:1],
           "tl.minimum(seq_len, (pre_len + 63) // 64 * 64) - pre_len\n",
           ("[page_size 1]", "part 1"), "part 1's length for pages of 64", "param"),
    Mutant("alloc_extend_part1", "last_loc + 1 + offset_one_page,", "pre_len + offset_one_page,",
           ("request 0, part 1",), "part 1's slots from the prefix length (right if pages were in order)",
           "lucky"),
    Mutant("alloc_extend_part1", *_ALIGNED_PART1,
           ("request 1, part 1 wrote 64 slot(s) outside its own positions, at out_indices[120:184], "
            "which belong to request 1, part 2", "num_part1 = 0"),
           "part 1 takes a whole page after a page-aligned prefix", "blame"),
    Mutant("alloc_extend_part1", "    num_part1 = (\n        tl.minimum(seq_len, (pre_len + page_size - 1) // page_size * page_size) - pre_len\n    )",
           "    num_part1 = 0\n    if pre_len % page_size != 0:\n"
           "        num_part1 = tl.minimum(seq_len, (pre_len + page_size - 1) // page_size * page_size) - pre_len",
           ("does not compile for a GPU", "num_part1", "is int32 before the `if`", "line"),
           "num_part1 = 0 (int32) before an if that makes it int64", "compiled"),
    Mutant("alloc_extend_part2", *_ALIGNED_PART1,
           ("request 1, part 1 wrote 64 slot(s) outside its own positions", "request 1, part 2"),
           "part 1's length bug, seen from the part 2 checker", "blame"),
    Mutant("alloc_extend_part2", "    tl.store(\n        out_indices + output_start_loc + num_part1 + offset_many_page,",
           "    tl.store(free_page_ptr + new_page_start_loc + offset_many_page // page_size, -1,\n"
           "             mask=offset_many_page < num_part2)  # (taken)\n"
           "    tl.store(\n        out_indices + output_start_loc + num_part1 + offset_many_page,",
           ("your code changed `free_page_ptr`", "was 3, now -1"), "marks its pages as taken in the free list",
           "input"),
    Mutant("alloc_extend_part2", "page_start * page_size + offset_many_page % page_size",
           "page_start * page_size + offset_many_page % 64", ("part 2",), "k % 64 instead of k % P", "param"),
    Mutant("alloc_extend_part2", "free_page_ptr + new_page_start_loc + offset_many_page // page_size,",
           "free_page_ptr + offset_many_page // page_size,", ("request 1, part 2",),
           "part 2 takes pages from the front of the free list (right for the first request only)", "lucky"),
    Mutant("alloc_extend_part2", "        mask=offset_many_page < num_part2,\n    )\n",
           "        mask=offset_many_page <= num_part2,\n    )\n",
           ("part 2 wrote 1 slot(s) outside its own positions", "which belong to request"),
           "part 2's store mask off by one: a slot of part 3 written, then overwritten", "state"),
    Mutant("alloc_extend_part2", "    num_part2 = (",
           "    for j in range(0, 4):  # (a leftover)\n        if j == 3:\n            break\n    num_part2 = (",
           ("does not compile for a GPU", "break", "line 66"), "a break in a kernel loop", "compiled"),
    Mutant("alloc_extend_part3", *_ALIGNED_PART1,
           ("request 1, part 1 wrote 64 slot(s) outside its own positions", "and so, in part 3's positions"),
           "part 1's length bug, seen from the part 3 checker", "blame"),
    Mutant("alloc_extend_part3", "    tl.store(\n        out_indices + output_start_loc + num_part1 + num_part2 + offset_one_page,",
           "    tl.store(free_page_ptr + new_page_start_loc + num_page_start_loc_self - 1, -1)  # (taken)\n"
           "    tl.store(\n        out_indices + output_start_loc + num_part1 + num_part2 + offset_one_page,",
           ("your code changed `free_page_ptr`",), "marks its last page as taken in the free list", "input"),
    Mutant("alloc_extend_part3", "start_loc * page_size + offset_one_page,", "start_loc * 64 + offset_one_page,",
           ("part 3",), "part 3's slots for pages of 64", "param"),
    Mutant("alloc_extend_part3", "free_page_ptr + new_page_start_loc + num_page_start_loc_self - 1)",
           "free_page_ptr + pid)", ("part 3",), "part 3 takes free page number pid", "lucky"),
    Mutant("alloc_extend_part3", "    num_part3 = seq_len - seq_len // page_size * page_size",
           "    num_part3 = 0\n    if seq_len % page_size != 0:\n"
           "        num_part3 = seq_len - seq_len // page_size * page_size",
           ("does not compile for a GPU", "num_part3", "then branch makes it int64"),
           "num_part3 = 0 (int32) before an if that makes it int64", "compiled"),
    Mutant("alloc_extend_part3", "tl.store(ret_values, merged_value)", "tl.atomic_add(ret_values, merged_value)",
           ("ret_values holds", "your kernel adds to ret_values; store it instead"),
           "adds to ret_values (right only while it starts at 0; the allocator reuses it)", "state"),
    # chapter 04
    Mutant("alloc_decode", "tl.store(ret_values, sum_num_new_pages.to(tl.int64))",
           "tl.atomic_add(ret_values, sum_num_new_pages.to(tl.int64))",
           ("ret_values holds -7777", "tl.store, not an add"),
           "adds to ret_values (right only while it starts at 0; the allocator reuses it)", "state"),
    Mutant("alloc_decode", "        tl.store(out_indices + pid, last_loc + 1)",
           "        tl.store(out_indices + pid, last_loc + 1)\n        tl.store(last_loc_ptr + pid, last_loc + 1)",
           ("your code changed `last_loc_ptr`",), "moves the caller's last_loc on", "input"),
    Mutant("alloc_decode", "pre_lens = tl.where(load_offset <= pid, seq_lens - 1, seq_lens)",
           "pre_lens = seq_lens - 1",
           ("[page_size 1", "masked-off lanes are counted as page starts"),
           "masked-off lanes counted as page starts (other=0, no mask; only page size 1 shows it)", "param"),
    Mutant("alloc_decode", "if num_page_start_loc_self == 0:",
           "if tl.load(last_loc_ptr + pid) % page_size != page_size - 1:",
           ("request 0 has no slot yet", "last_loc + 1 = 0 is slot 0"),
           "decides the page by last_loc % P (C's %): a first token gets slot 0", "lucky"),
    Mutant("alloc_decode", _DECODE_BRANCHES,
           "    if num_page_start_loc_self == 0:\n        slot = tl.load(last_loc_ptr + pid) + 1\n    else:\n"
           "        slot = (tl.load(free_page_ptr + new_page_start_loc) * page_size).to(tl.int32)\n"
           "    tl.store(out_indices + pid, slot)",
           ("does not compile for a GPU", "`slot` gets type int64 in the `if` branch and int32"),
           "the two branches give the slot different types", "compiled"),
    # chapter 05
    Mutant("match_prefix", "    P = cache.page_size\n",
           "    P = cache.page_size\n    del input_ids[len(input_ids) // P * P:]  # (a partial page never counts)\n",
           ("your code changed `input_ids`",), "trims the caller's prompt to whole pages", "input"),
    Mutant("match_prefix", "    P = cache.page_size\n", "    P = 2\n",
           ("[match ends inside a page: round down]",), "a page size of 2 written in", "param"),
    Mutant("match_prefix", "        node = child\n", "        child.last_access = cache.clock\n        node = child\n",
           ("your code changed `cache`", "LRU stamp last_access was"), "stamps the nodes it walks", "state"),
    Mutant("match_req", "return prefix_cache.match_prefix(input_ids[: len(input_ids) - 1])",
           "input_ids.pop()\n    return prefix_cache.match_prefix(input_ids)",
           ("your code changed `input_ids`", "[16] is gone"), "pops the prompt's last token", "input"),
    Mutant("match_req", "input_ids[: len(input_ids) - 1]", "input_ids[: (len(input_ids) - 1) // 4 * 4]",
           ("page_size",), "rounds to pages of 4 itself", "param"),
    Mutant("match_req", "return prefix_cache.match_prefix(input_ids[: len(input_ids) - 1])",
           "prefix_cache.match_prefix(input_ids)\n    return prefix_cache.match_prefix(input_ids[: len(input_ids) - 1])",
           ("the tree is not as one prefix_cache.match_prefix", "LRU stamp last_access should be"),
           "matches the whole prompt first, then the right prefix", "state"),
    Mutant("insert_prefix", "insert_len = len(input_ids) // P * P", "insert_len = len(input_ids) // 2 * 2",
           ("new_entries",), "whole pages of 2 tokens", "param"),
    Mutant("insert_prefix", "list(indices[start:start + P])", "list(range(start, start + P))",
           ("expected slots", "the page's slots are indices[start:start + P]"),
           "the positions as slots (right while slots equal positions)", "lucky"),
    Mutant("insert_prefix", "    for start in range(cached_len, insert_len, P):",
           "    for start in range(0, insert_len, P):", ("(already cached)",),
           "new entries for the cached pages too", "state"),
    # chapter 06
    Mutant("cache_req_regions", '    return {\n        "hit"',
           '    del row_slots[already_cached_len:]  # (handed over)\n    return {\n        "hit"',
           ("your code changed `row_slots`",), "cuts the caller's row", "input"),
    Mutant("cache_req_regions", "new_cached_len = req_cached_len // page_size * page_size",
           "new_cached_len = req_cached_len // 4 * 4", ("region 'inserted' is wrong",),
           "whole pages of 4 tokens", "param"),
    Mutant("cache_req_regions", "row_slots[old_cached_len:already_cached_len:page_size])  # duplicates",
           "range(old_cached_len, already_cached_len, page_size))  # duplicates",
           ("free: expected page starts",), "frees positions instead of slots (right while slot == position)",
           "lucky"),
    Mutant("cache_req_remap", "    row = list(row_slots)\n", "    row = row_slots\n",
           ("your code changed `row_slots`",), "rewrites the caller's row and returns it", "input"),
    Mutant("cache_req_remap", "row_slots[old_cached_len:already_cached_len:page_size])  # one entry per page",
           "row_slots[old_cached_len:already_cached_len:4])  # one entry per page",
           ("free:", "[page_size 1]"), "a page size of 4 written in", "param"),
    Mutant("cache_req_remap", "= cached_slots[old_cached_len:already_cached_len]",
           "= list(range(old_cached_len, already_cached_len))",
           ("(region: duplicate)",), "remaps to the positions (right while slot == position)", "lucky"),
    # chapter 07
    Mutant("decode_step", "    manager.allocate_paged(reqs)          # a new page",
           "    done.append(False)  # (one more step)\n    manager.allocate_paged(reqs)          # a new page",
           ("your code changed `done`", "`done` had 1 item, now 2"), "appends to the caller's done", "input"),
    Mutant("decode_step", "    manager.allocate_paged(reqs)          # a new page",
           "    manager.allocate_paged([r for r in reqs if r.cached_len % 4 == 0])  # a new page",
           ("[page_size 1: every step maps a page]",), "maps pages only on boundaries of 4", "param"),
    Mutant("decode_step", "    for req, token in zip(reqs, next_tokens):\n        req.append_token(token)",
           "    for req in reqs:\n        token = next_tokens[req.table_idx]\n        req.append_token(token)",
           ("got next_tokens[", "is not its index"), "the token of the request's row (right while rows are in order)",
           "lucky"),
    Mutant("decode_step", "    manager.allocate_paged(reqs)          # a new page",
           "    manager.prefix_cache.match_prefix(reqs[0].input_ids)\n    manager.allocate_paged(reqs)          # a new page",
           ("the prefix cache is not as the step leaves it", "LRU stamp last_access should be"),
           "matches a prompt during the step (stamps the tree)", "state"),
    Mutant("decode_step", "        if finished:\n            manager.cache_req(req, finished=True)",
           "        if finished:\n            manager.unlock(req.cache_handle, owner=req)\n"
           "            manager.cache_req(req, finished=True)",
           ("request 0: your code unlocked its cache_handle itself (unlock, call", "and then cache_req (call",
            "CacheMisuse"), "unlocks the handle before cache_req", "blame"),
    # chapter 08
    Mutant("paged_attention", "q[b].float(), k) * scale", "q[b].mul_(scale).float(), k)",
           ("your code changed `q`",), "scales q in place", "input"),
    Mutant("paged_attention", "    for b in range(q.shape[0]):", "    out.zero_()\n    for b in range(1):",
           ("[page_size 1] request 1",), "only the first request of the batch", "param"),
    Mutant("paged_attention", "page_table[row, :n]", "page_table[row]",
           ("request 0, head", "looks like it reads the whole row, past seq_len"), "reads the whole row"),
    Mutant("paged_attention", "page_table[row, :n]", "page_table[row, :n + 1]",
           ("request 0, head", "looks like it reads past seq_len"), "reads one position past seq_len"),
    Mutant("paged_attention_kernel",
           "    q = tl.load(q_ptr + b.to(tl.int64) * stride_q_b + h * stride_q_h + offs_d, mask=mask_d, other=0.0)\n",
           "    q = tl.load(q_ptr + b.to(tl.int64) * stride_q_b + h * stride_q_h + offs_d, mask=mask_d, other=0.0)\n"
           "    tl.store(q_ptr + b.to(tl.int64) * stride_q_b + h * stride_q_h + offs_d, q * scale, mask=mask_d)\n",
           ("your code changed `q_ptr`",), "scales q in place", "input"),
    Mutant("paged_attention_kernel", "tl.sum(q[None, :] * k, 1) * scale", "tl.sum(q[None, :] * k, 1) / tl.sqrt(head_dim * 1.0)",
           ("[scale 0.3", "request 0, head"), "uses 1/sqrt(head_dim) instead of the scale it is given", "param"),
    Mutant("paged_attention_kernel", "offs_n = start + tl.arange(0, BLOCK_N)", "offs_n = start + tl.arange(0, 4)",
           ("BLOCK_N 8", "request 1, head 1"), "blocks of 4 written in", "param"),
    Mutant("paged_attention_kernel", "        alpha = tl.exp(m_i - m_new)",
           "        m_i = m_new\n        alpha = tl.exp(m_i - m_new)",
           ("request 0, head 1", "looks like m_i is updated before alpha is computed"),
           "m_i updated before alpha"),
    Mutant("paged_attention_kernel", "m_new = tl.maximum(tl.max(scores, 0), m_i)", "m_new = tl.max(scores, 0)",
           ("request 0, head 0", "looks like m_new is the block's own max, without the running max"),
           "the block's max without the running max"),
    Mutant("paged_attention_kernel", "row = tl.load(table_idx_ptr + b).to(tl.int64)", "row = b.to(tl.int64)",
           ("a read before the start of `k_pool_ptr`", "by program (0, 0)"),
           "reads row b, not row table_idx[b]", "lucky"),
    Mutant("paged_attention_kernel", "l_i = 0.0", "l_i = 0",
           ("does not compile for a GPU", "l_i", "write 0.0, not 0", "line"),
           "l_i starts as the int 0: a loop carry that becomes a float", "compiled"),
    # chapter 09
    Mutant("extend_scan", "        carry_tokens += tl.sum(extend, axis=0)\n",
           "        carry_tokens += tl.sum(extend, axis=0)\n        tl.store(prefix_lens_ptr + offs, seq, mask=mask)\n",
           ("your code changed `prefix_lens_ptr`",), "marks the requests done in prefix_lens", "input"),
    Mutant("extend_scan", "for start in range(0, bs, BLOCK):", "for start in range(0, bs, 8):",
           ("[BLOCK 4:", "token_start: "), "the loop steps by 8 whatever BLOCK is", "param"),
    Mutant("extend_scan", "pages = (seq + page_size - 1) // page_size - (pre + page_size - 1) // page_size",
           "pages = extend", ("page_start: ", "request"), "new pages = new tokens (right at page size 1)",
           "lucky"),
    Mutant("extend_scan", _SCAN_INIT, "carry_tokens = 0",
           ("does not compile for a GPU", "Loop-carried variable carry_tokens", "line 7", "(line 5: carry_tokens = 0)"),
           "the carry starts as a Python 0 (int32) and becomes an int64", "compiled"),
    # chapter 10
    Mutant("paged_attention_step", "    v_pool[slots] = v\n", "    v_pool[slots] = v\n    k.mul_(0)  # (stored)\n",
           ("your code changed `k`",), "clears the caller's k after storing it", "input"),
    Mutant("paged_attention_step", "positions + 1, scale)", "positions + 1, 1.0 / q.shape[-1] ** 0.5)",
           ("[scale 0.2", "instead of the scale it is given"), "1/sqrt(head_dim) instead of scale", "param"),
    Mutant("paged_attention_step", "slots = page_table[rows, positions].long()",
           "slots = page_table[torch.arange(len(rows)), positions].long()",
           ("[one request, its first token] request 0's new K should be in slot 0",),
           "row b instead of rows[b] (right while rows[b] == b; here silent: writing one position too "
           "far gives the same pools)", "lucky"),
    Mutant("paged_attention_step", "    v_pool[slots] = v\n", "    v_pool[slots] = v\n    k_pool[slots - 1] = k\n",
           ("changed, but no new token belongs there",), "also writes the slot before each new one", "state"),
    Mutant("pad_decode_batch", "    size = next((s for s in sorted(sizes) if s >= n), n)",
           "    sizes.sort()\n    size = next((s for s in sizes if s >= n), n)",
           ("[sizes given out of order]", "your code changed `sizes`", "`sizes[0]` was 8, now 1"),
           "sorts the caller's sizes", "input"),
    Mutant("pad_decode_batch", "    size = next((s for s in sorted(sizes) if s >= n), n)",
           "    size = 1 << (n - 1).bit_length() if n <= max(sizes) else n",
           ("[one request, size 1 not captured: pads to 2]", "has 2 entries", "got lengths [1, 1, 1]"),
           "pads to the next power of two (right while the captured sizes are the powers of two)", "param"),
    Mutant("pad_decode_batch", "rows.new_full((size - n,), dummy_row)", "rows.new_full((size - n,), page_table.shape[0] - 1)",
           ("rows: ", "(padded entries)", "the dummy row is dummy_row (6)"),
           "the dummy row taken as the table's last (right while it is the last)", "param"),
    Mutant("pad_decode_batch", "s for s in sorted(sizes) if s >= n", "s for s in sizes if s >= n",
           ("[sizes given out of order]", "the first size that holds the batch in the order given"),
           "the first size that holds the batch, in the order given (right while sizes come sorted)", "lucky"),
    # chapter 11
    Mutant("page_hashes", "    hashes, parent = [], None\n",
           "    hashes, parent = [], None\n"
           "    del input_ids[len(input_ids) // page_size * page_size:]  # (a partial page has no hash)\n",
           ("[a partial last page has no hash]", "your code changed `input_ids`", "`input_ids` had 6 items, now 4"),
           "trims the caller's prompt to whole pages", "input"),
    Mutant("page_hashes", "input_ids[start:start + page_size])", "input_ids[start:start + 4])",
           ("[page_size 1: one hash per token]", "hash of page 0 ([5])"), "pages of 4 tokens written in", "param"),
    Mutant("page_hashes", "        parent = chain_hash(parent, input_ids[start:start + page_size])\n"
           "        hashes.append(parent)\n",
           "        hashes.append(chain_hash(parent, input_ids[start:start + page_size]))\n"
           "        parent = chain_hash(None, input_ids[start:start + page_size])\n",
           ("hash of page 2", "the previous page hashed alone"),
           "the parent is the previous page hashed alone (right for the first two pages)", "lucky"),
    Mutant("hash_match", "    P = cache.page_size\n",
           "    P = cache.page_size\n    del input_ids[len(input_ids) // P * P:]  # (whole pages only)\n",
           ("[cached pages freed: still findable]", "your code changed `input_ids`", "had 9 items, now 8"),
           "trims the caller's prompt to whole pages", "input"),
    Mutant("hash_match", "    P = cache.page_size\n", "    P = 2\n",
           ("[query ends in a partial page]", "matched pages: expected 1, got 0"), "a page size of 2 written in", "param"),
    Mutant("hash_match", "slots = [page * P + i for page in pages for i in range(P)]", "slots = list(range(len(pages) * P))",
           ("slots of the matched pages", "these are the positions 0, 1, 2", "the matched pages here are [10, 1, 11, 6]"),
           "the positions as slots (right while the pages are 0, 1, 2, ...)", "lucky"),
    Mutant("hash_match", "        pages.append(page)\n", "        cache.take_cached(page)  # (a hit)\n        pages.append(page)\n",
           ("your code changed `cache`", "page 1: its reference count ref_count was 1, now 2"),
           "takes a reference on every hit", "state"),
    Mutant("hash_match", "        pages.append(page)\n",
           "        if page in cache.free_queue:  # (recently used: to the back of the queue)\n"
           "            cache.free_queue.remove(page)\n            cache.free_queue.append(page)\n        pages.append(page)\n",
           ("your code changed `cache`", "the free queue (head first) was [11, 7,"),
           "moves a free page it hits to the tail of the free queue", "state"),
    Mutant("allocate_pages", "    return pages, cached_len\n",
           "    del input_ids[:cached_len]  # (what is left to compute)\n    return pages, cached_len\n",
           ("[hits on pages in use]", "your code changed `input_ids`", "had 7 items, now 3"),
           "cuts the cached prefix off the caller's prompt", "input"),
    Mutant("allocate_pages", "    P = cache.page_size\n", "    P = 2\n",
           ("[every full page cached, in use and free]", "cached_len should be 8, got 0"),
           "a page size of 2 written in", "param"),
    Mutant("allocate_pages", "            page = cache.take_free()",
           "            low = min(cache.free_queue)  # (the lowest-numbered free page)\n"
           "            cache.free_queue.remove(low)\n            cache.free_queue.appendleft(low)\n"
           "            page = cache.take_free()",
           ("[empty cache: every page new, full ones cached]", "pages should be [6, 7, 8], got [0, 1, 2]"),
           "takes the lowest-numbered free page (right while the queue is in page order)", "lucky"),
    Mutant("allocate_pages", "cache.cache_page(page, h, tokens, parent)", "cache.cache_page(page, h, tokens, None)",
           ("not as the reference solution leaves it", "page 7: its parent's hash page_parent should be"),
           "caches a new page without its parent", "state"),
    Mutant("allocate_pages", "            page = cache.take_free()",
           "            page = cache.free_queue.popleft()  # (the head, by hand)\n            cache.ref_count[page] = 1",
           ("page 4 is cached under", "it was a free cached page, and it is in use now, for other tokens, "
            "under its old hash", "cache.take_free() drops it"),
           "takes the queue's head by hand (the page keeps its old hash)", "state"),
    Mutant("free_pages", "    for page in reversed(pages):", "    pages.reverse()\n    for page in pages:",
           ("your code changed `pages`", "`pages[0]` was 9, now 11"), "reverses the caller's list", "input"),
    Mutant("free_pages", "    for page in reversed(pages):", "    for page in sorted(pages, reverse=True):",
           ("[free one sequence: last page first]", "free queue (head first) should be"),
           "frees the highest page first (right while pages were handed out in order)", "lucky"),
    Mutant("free_pages", "            cache.free_queue.append(page)  #",
           "            cache.evicted_pages += cache.page_hash[page] is not None\n            cache.free_queue.append(page)  #",
           ("evicted_pages should be 0, got 4",), "counts a freed cached page as evicted", "state"),
    Mutant("free_pages", "            cache.free_queue.append(page)  #",
           "            cache.page_tokens[page] = None\n            cache.free_queue.append(page)  #",
           ("not as the reference solution leaves it", "page 2: its tokens page_tokens should be [5, 6], is None"),
           "drops a freed page's tokens", "state"),
]

# --- chapter 12: when KV memory runs out --------------------------------------------------

_SWAP_BLOCK = ("    pages = host.take(-(-n // P))                        # one host page per P positions\n"
               "    for i, page in enumerate(pages):\n"
               "        part = slots[i * P:(i + 1) * P]\n"
               "        host.k[page, :, : len(part)] = pool.k[:, part]   # every layer of those positions\n"
               "        host.v[page, :, : len(part)] = pool.v[:, part]\n"
               "    manager.release_req(req)                             # its pages back, its lock off: once\n")

CH12 = [
    Mutant("victim_order", "order = ranked[::-1]", "order = ranked",
           ("policy 'retract'", "SGLang retracts the fewest generated tokens first"),
           "retracts the most outputs first (the sort without the pop from the end)"),
    Mutant("victim_order", "key=lambda r: r.admitted, reverse=True", "key=lambda r: r.admitted",
           ("policy 'recompute'", "the latest admitted first"), "preempts the earliest admitted first"),
    Mutant("victim_order", "order = ranked[::-1]", "order = sorted(running, key=lambda r: (r.generated, -r.prompt_len))",
           ("[retract: an exact tie: the later one in running first]",),
           "of an exact tie, retracts the earlier one first", "lucky"),
    Mutant("victim_order", "key=lambda r: r.arrived, reverse=True", "key=lambda r: r.admitted, reverse=True",
           ("policy 'swap'", "latest arrival first"), "swaps out by admission order (recompute's rule)", "param"),
    Mutant("victim_order", "order = sorted(running, key=lambda r: r.admitted, reverse=True)",
           "order = list(running)[::-1]",
           ("[recompute: the latest admitted, not the last in the list]",),
           "preempts the end of the list (right while running is in admission order)", "lucky"),
    Mutant("victim_order", "        ranked = sorted(running, key=lambda r: (r.generated, -r.prompt_len), reverse=True)\n",
           "        running.sort(key=lambda r: (r.generated, -r.prompt_len), reverse=True)\n        ranked = running\n",
           ("your code changed `running`",), "sorts the caller's list in place", "input"),
    Mutant("next_token_ratio", "    if not retracted:  ", "    if not retracted or ratio > 0:  ",
           ("the ratio recovers", "never recovers"), "keeps decaying after a retraction"),
    Mutant("next_token_ratio", "max(ratio - policy.decay, policy.min_ratio)", "ratio - policy.decay",
           ("below the minimum",), "decays below the minimum"),
    Mutant("next_token_ratio", "return min(1.0, (decoded", "return max(0.0, (decoded",
           ("capped at 1", "above 1"), "an estimate above the whole answer"),
    Mutant("next_token_ratio", "        return policy.init_ratio", "        return ratio",
           ("[nobody left after a retraction",), "keeps the old ratio when nobody is left"),
    Mutant("next_token_ratio", "policy.retract_decode_steps * len(remaining)", "20 * len(remaining)",
           ("[other constants",), "SGLang's 20 retract steps written in", "param"),
    Mutant("next_token_ratio", "max(ratio - policy.decay, policy.min_ratio)",
           "max(ratio - (0.7 - 0.098) / 600, policy.min_ratio)",
           ("[other constants",), "SGLang's decay written in", "param"),
    Mutant("next_token_ratio", "    decoded = sum(r.generated for r in remaining)\n",
           "    remaining.sort(key=lambda r: r.generated)\n    decoded = sum(r.generated for r in remaining)\n",
           ("your code changed `remaining`",), "sorts the caller's list", "input"),
    Mutant("resume_plan", "range(hit, saved)", "range(0, saved)",
           ("in the prefix cache: copying them back",), "copies back what the prefix cache still holds"),
    Mutant("resume_plan", "        start = hit  ", "        start = 0  ",
           ("which the prefix cache still holds",), "recomputes what the prefix cache still holds"),
    Mutant("resume_plan", "start = max(saved, hit)", "start = hit",
           ("the recompute the swap avoids",), "a swap that computes what it copied back"),
    Mutant("resume_plan", "host_pages[pos // P] * P + pos % P", "host_pages[(pos - hit) // P] * P + pos % P",
           ("restored to the wrong slot", "its host slot should be"), "a swapped page restored from the wrong host page"),
    Mutant("resume_plan", "copies.append((host_slot, row[pos]))", "copies.append((host_slot, row[pos - hit]))",
           ("restored to the wrong slot", "its device slot should be"), "a swapped page restored to the wrong slot"),
    Mutant("resume_plan", "host_pages[pos // P] * P + pos % P", "(pos // P) * P + pos % P",
           ("restored to the wrong slot",), "host page i taken as page i (right while the host pages are in order)",
           "lucky"),
    Mutant("resume_plan", "    P = page_size\n", "    P = 4\n",
           ("page_size 2",), "a page size of 4 written in", "param"),
    Mutant("resume_plan", "    copies = []\n", "    copies = []\n    row.sort()\n",
           ("your code changed `row`",), "sorts the new row in place", "input"),
    Mutant("swap_out", "    manager.release_req(req)                             # its pages back, its lock off: once\n",
           "    own = manager.page_table[req.table_idx, req.cache_handle.cached_len:"
           "manager.allocated_pages(req) * P][::P].clone()\n"
           "    manager.release_req(req)\n"
           "    manager.free_slots = torch.cat([manager.free_slots, own.to(manager.free_slots.dtype)])\n",
           ("freed twice",), "frees its pages by hand as well as with release_req", "state"),
    Mutant("swap_out", _SWAP_BLOCK,
           "    manager.release_req(req)  # (first: its slots were read above)\n" + _SWAP_BLOCK.replace(
               "    manager.release_req(req)                             # its pages back, its lock off: once\n", ""),
           ("you copied after release_req",), "copies after release_req (right while nobody reuses the pages)",
           "lucky"),
    Mutant("swap_out", "manager.release_req(req)                             #",
           "manager.cache_req(req, finished=True)                #",
           ("a swap-out caches nothing",), "caches the row instead of releasing it", "state"),
    Mutant("swap_out", "    P = host.page_size\n", "    P = 4\n", ("[page_size 1]",), "a page size of 4 written in", "param"),
    Mutant("swap_out", "slots = manager.page_table[req.table_idx, :n].long()",
           "slots = manager.page_table[req.table_idx, req.cache_handle.cached_len:n].long()",
           ("position 0",), "copies only its own pages, not its cached prefix"),
]


MUTANTS = (CH00 + CH01 + CH02 + CH03 + CH04 + CH05 + CH06 + CH05_06_REQ + CH07_09 + CH08_KERNEL
           + CH09_ATTENTION + CH11 + CH12 + BLIND_SPOTS + MUTANTS_CH10_11 + MUTANTS_CH09_12)
#: every wrong answer: the planted slips and the answers written out whole
WRONG = list(MUTANTS) + WRONG_ANSWERS_CH10_11 + WRONG_ANSWERS_CH09_12


@pytest.mark.parametrize("mutant", WRONG, ids=lambda m: f"{m.exercise}: {m.why}")
def test_mutant_is_rejected_and_the_message_points_at_the_bug(mutant, mutant_dir):
    _reject(mutant, mutant_dir)


def test_there_are_enough_mutants_on_every_exercise():
    assert len(MUTANTS) >= 80
    assert len({(m.exercise, m.why) for m in WRONG}) == len(WRONG)
    assert {m.exercise for m in MUTANTS} >= set(COURSE_EXERCISES)
    assert all(m.must_say for m in WRONG) and {m.kind for m in WRONG} <= set(KINDS)


def test_the_fourth_pass_adds_thirty_wrong_answers_and_ten_rewrites_over_chapters_10_and_11():
    chapter = {name: kvlab.check.EXERCISES[name].chapter for name in kvlab.check.exercises()}
    wrong = MUTANTS_CH10_11 + WRONG_ANSWERS_CH10_11
    right = REWRITES_CH10_11 + OTHER_SHAPES_CH10_11
    assert len(wrong) >= 30 and len(right) >= 10
    assert {chapter[m.exercise] for m in wrong} == {chapter[r[0]] for r in right} == {"10", "11"}
    assert {m.kind for m in wrong} >= {"type", "unseen", "blame"}


def test_the_fifth_pass_covers_every_class_of_slip_over_chapters_09_and_12():
    chapter = {name: kvlab.check.EXERCISES[name].chapter for name in kvlab.check.exercises()}
    wrong = MUTANTS_CH09_12 + WRONG_ANSWERS_CH09_12
    counts = {kind: sum(m.kind == kind for m in wrong) for kind in ("bounds", "memo", "aside", "alike", "blame")}
    assert all(counts.values()) and len(wrong) >= 20 and len(REWRITES_CH09_12) >= 5, counts
    assert {chapter[m.exercise] for m in wrong} == {"08", "09", "12"}


@pytest.mark.parametrize("why", ["reads page-table row b, the request's number, not its row",
                                 "weighs a split from the old max (inf at the first split): no overflow of a large lse"])
def test_no_interpreter_warning_comes_before_a_checkers_message(why, mutant_dir, capfd):
    # a kernel that computes NaN makes the interpreter's numpy warn line after line; the
    # checker's message is what the learner reads, and nothing comes before it
    _reject(next(m for m in MUTANTS_CH09_12 if m.why == why), mutant_dir)
    out, err = capfd.readouterr()
    assert "Warning" not in out + err and "interpreter.py" not in out + err, out + err


_FAULTS = {"input", "param"}  # every exercise has inputs and a parameter (a page size, a scale)
_PARTS = _FAULTS | {"lucky", "state", "compiled", "blame"}
#: the classes of slips each exercise can have (a kernel can fail to compile; slots and rows can
#: be right by accident; ...): each must have a mutant
APPLIES = {
    "pages_needed": _FAULTS, "page_to_token": _FAULTS | {"lucky"},
    "write_page_table": _FAULTS | {"lucky", "state"},
    "alloc_extend_part1": _PARTS, "alloc_extend_part2": _PARTS, "alloc_extend_part3": _PARTS,
    "alloc_decode": _FAULTS | {"lucky", "state", "compiled"},
    "match_prefix": _FAULTS | {"state"}, "match_req": _FAULTS | {"state"},
    "insert_prefix": _FAULTS | {"lucky", "state"}, "cache_req_regions": _FAULTS | {"lucky"},
    "cache_req_remap": _FAULTS | {"lucky", "state"},
    "decode_step": _FAULTS | {"lucky", "state", "blame"},
    "paged_attention": _FAULTS | {"lucky"}, "paged_attention_kernel": _FAULTS | {"lucky", "compiled"},
    "extend_scan": _FAULTS | {"lucky", "compiled"}, "paged_attention_step": _FAULTS | {"lucky", "state"},
    "split_attention": _FAULTS | {"lucky", "compiled"}, "merge_splits": _FAULTS | {"lucky", "compiled"},
    "pad_decode_batch": _FAULTS | {"lucky"},
    "page_hashes": _FAULTS | {"lucky"}, "hash_match": _FAULTS | {"lucky", "state"},
    "allocate_pages": _FAULTS | {"lucky", "state"},
    "free_pages": {"input", "lucky", "state"},  # no parameter of the statement enters the code
    "victim_order": {"input", "param", "lucky"}, "next_token_ratio": _FAULTS,
    "resume_plan": _FAULTS | {"lucky"},
    "swap_out": {"param", "lucky", "state"},  # its arguments are the state it must change
}
# chapters 10-11 (the fourth pass): answers whose type the statement fixes, inputs the cases
# never had, diagnoses that must name the slip made
for _name in ("paged_attention_step", "pad_decode_batch", "page_hashes", "hash_match", "allocate_pages"):
    APPLIES[_name] = APPLIES[_name] | {"type", "unseen" if _name != "paged_attention_step" else "blame"}
APPLIES["free_pages"] = APPLIES["free_pages"] | {"unseen"}
APPLIES["page_hashes"] |= {"blame"}
APPLIES["hash_match"] |= {"blame"}
APPLIES["pad_decode_batch"] |= {"blame"}
# chapters 09 and 12 (the fifth pass): reads past the end only a full pool provokes, state kept
# between calls, effects on what must be left alone, orders the cases could not tell apart
for _name, _kinds in {"paged_attention_kernel": {"bounds"}, "split_attention": {"bounds", "blame"},
                      "merge_splits": {"bounds", "blame"}, "victim_order": {"memo", "alike", "blame"},
                      "next_token_ratio": {"memo"}, "resume_plan": {"memo", "blame"},
                      "swap_out": {"aside", "blame"}}.items():
    APPLIES[_name] = APPLIES[_name] | _kinds  # a new set: some exercises share one (_FAULTS)


def test_every_class_of_slip_has_a_mutant_on_every_exercise_it_applies_to():
    assert set(APPLIES) == set(COURSE_EXERCISES) and len(APPLIES) == 28
    missing = [(name, kind) for name, kinds in APPLIES.items() for kind in sorted(kinds)
               if not any(m.exercise == name and m.kind == kind for m in WRONG)]
    assert not missing


COURSE_EXERCISES = ["pages_needed", "page_to_token", "write_page_table", "alloc_extend_part1", "alloc_extend_part2",
                    "alloc_extend_part3", "alloc_decode", "match_prefix", "match_req",
                    "insert_prefix", "cache_req_regions", "cache_req_remap", "decode_step",
                    "paged_attention", "paged_attention_kernel", "extend_scan", "split_attention", "merge_splits",
                    "paged_attention_step",
                    "pad_decode_batch", "page_hashes", "hash_match", "allocate_pages", "free_pages",
                    "victim_order", "next_token_ratio", "resume_plan", "swap_out"]


# --- correct answers written differently must pass -----------------------------------------------


REWRITES = [
    Rewrite("alloc_extend_part3", "num_part3 = seq_len - seq_len // page_size * page_size",
            "num_part3 = seq_len - pre_len - num_part1 - num_part2",
            "part 3's length as what is left after parts 1 and 2"),
    Rewrite("alloc_decode", "if num_page_start_loc_self == 0:", "if pre_len % page_size != 0:",
            "the decode branch written on pre_len % P"),
    Rewrite("cache_req_remap",
            "row[old_cached_len:already_cached_len] = cached_slots[old_cached_len:already_cached_len]",
            "row[0:already_cached_len] = cached_slots[0:already_cached_len]",
            "a remap of [0, already): the hit maps the cached slots already"),
    Rewrite("page_to_token", "return (page_starts.unsqueeze(1) + offsets).flatten()",
            "return page_starts.repeat_interleave(page_size) + offsets.repeat(len(page_starts))",
            "repeat_interleave and repeat instead of broadcasting"),
    Rewrite("alloc_extend_part1",
            "tl.minimum(seq_len, (pre_len + page_size - 1) // page_size * page_size) - pre_len\n",
            "tl.minimum(seq_len - pre_len, (page_size - pre_len % page_size) % page_size)\n",
            "part 1's length as the room left in the old page"),
    Rewrite("match_prefix",
            "        while n < child.length and matched + n < len(input_ids) and child.key[n] == input_ids[matched + n]:\n"
            "            n += 1\n        n = n // P * P  # a partly matched page does not count\n",
            "        while n < child.length and tuple(child.key[n:n + P]) == tuple(input_ids[matched + n:matched + n + P]):\n"
            "            n += P\n",
            "the walk compares whole pages instead of tokens"),
    Rewrite("extend_scan", "carry_tokens += tl.sum(extend, axis=0)",
            "carry_tokens = carry_tokens + tl.sum(tl.where(mask, extend, 0), axis=0)",
            "the carry summed with an explicit mask"),
    Rewrite("decode_step", "    manager.allocate_paged(reqs)          # a new page",
            "    for one in reqs:\n        manager.allocate_paged([one])\n    # a new page",
            "pages mapped one request at a time"),
    Rewrite("insert_prefix", "    while cached_len < insert_len and tuple(input_ids[:cached_len + P]) in store:\n"
            "        cached_len += P  # this page is already there: our copy is a duplicate\n",
            "    for end in range(P, insert_len + 1, P):\n"
            "        if tuple(input_ids[:end]) not in store:\n            break\n"
            "        cached_len = end\n",
            "cached pages counted with a for loop and break"),
    Rewrite("page_hashes", "    for start in range(0, len(input_ids) - page_size + 1, page_size):\n",
            "    for start in range(0, len(input_ids) // page_size * page_size, page_size):\n",
            "the full pages counted by floor division"),
    Rewrite("hash_match", "        page = cache.lookup(parent, tokens)\n",
            "        page = cache.hash_to_page.get(parent)\n"
            "        if page is not None and cache.page_tokens[page] != tuple(tokens):\n"
            "            page = None\n",
            "the lookup written out: the dict, then the page's tokens"),
    Rewrite("free_pages", "            raise ValueError(f\"page {page} has no reference left to drop\")",
            "            raise RuntimeError(f\"page {page}: nothing to drop\")",
            "refuses with another error"),
    Rewrite("alloc_extend_part2",
            "        page_start * page_size + offset_many_page % page_size,\n",
            "        page_start * page_size + (offset_many_page - offset_many_page // page_size * page_size),\n",
            "k % P written as k - k // P * P"),
    # rewrites that the checks of inputs, parameters, state and compiling must not refuse
    Rewrite("paged_attention_kernel", "        acc = acc * alpha + tl.sum(p[:, None] * v, 0)\n"
            "        l_i = l_i * alpha + tl.sum(p, 0)\n        m_i = m_new\n",
            "        m_i = m_new  # alpha and p are computed already\n"
            "        acc = acc * alpha + tl.sum(p[:, None] * v, 0)\n        l_i = l_i * alpha + tl.sum(p, 0)\n",
            "m_i moved on once alpha and p are computed"),
    Rewrite("extend_scan", "carry_tokens = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)  # an int64 scalar 0",
            "carry_tokens = tl.zeros((), dtype=tl.int64)", "the carry started as tl.zeros((), dtype=tl.int64)"),
    Rewrite("match_req", "return prefix_cache.match_prefix(input_ids[: len(input_ids) - 1])",
            "return prefix_cache.match_prefix(list(input_ids)[:-1]).cached_len",
            "the matched length as an int, from one match of a copy"),
    Rewrite("page_to_token", "        return page_starts  # one slot per page", "        return page_starts.clone()  # one slot per page",
            "a copy of the starts for page_size 1"),
    Rewrite("alloc_decode", _DECODE_BRANCHES,
            "    same = num_page_start_loc_self == 0\n"
            "    last_loc = tl.load(last_loc_ptr + pid, mask=same, other=0)\n"
            "    page = tl.load(free_page_ptr + new_page_start_loc, mask=not same, other=0)\n"
            "    tl.store(out_indices + pid, tl.where(same, last_loc + 1, page * page_size))",
            "one store of a tl.where, both loads masked"),
    Rewrite("insert_prefix", "    new_entries = {}\n    for start in range(cached_len, insert_len, P):\n"
            "        new_entries[tuple(input_ids[:start + P])] = list(indices[start:start + P])\n    return cached_len, new_entries",
            "    after = dict(store)\n    for start in range(cached_len, insert_len, P):\n"
            "        after.setdefault(tuple(input_ids[:start + P]), list(indices[start:start + P]))\n"
            "    return cached_len, {k: v for k, v in after.items() if k not in store}",
            "inserts into a copy of the store, returns the difference"),
    Rewrite("cache_req_remap", "    row = list(row_slots)\n    row[old_cached_len:already_cached_len] = cached_slots[old_cached_len:already_cached_len]\n",
            "    row = [cached_slots[p] if old_cached_len <= p < already_cached_len else s\n"
            "           for p, s in enumerate(row_slots)]\n", "the new row from a comprehension"),
    Rewrite("split_attention",
            "            k = tl.load(k_pool_ptr + kv[None, :] + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None],\n"
            "                        other=0.0).to(tl.float32)  # [BLOCK_D, BLOCK_N]\n",
            "            k = tl.trans(tl.load(k_pool_ptr + kv[:, None] + offs_d[None, :],\n"
            "                                 mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(tl.float32))\n",
            "K loaded as [BLOCK_N, BLOCK_D] and transposed"),
    Rewrite("split_attention", _SLOTS,
            "slots = tl.load(page_table_ptr + row * stride_pt_row + tl.where(mask_n, offs_n, n0)).to(tl.int64)",
            "masked positions read the block's first slot instead of a masked load"),
    Rewrite("merge_splits",
            "        alpha = tl.exp(m - m_new)  # rescales what was summed under the old max (0 at first)\n"
            "        w = tl.exp(lse - m_new)  # this split's weight, at most 1\n",
            "        alpha = tl.exp2((m - m_new) * 1.4426950408889634)  # exp(x) = 2 ** (x * log2(e))\n"
            "        w = tl.exp2((lse - m_new) * 1.4426950408889634)\n",
            "the exponentials written with exp2"),
    Rewrite("merge_splits",
            "    for s in range(0, live):\n        lse = tl.load(lse_ptr + b * stride_l_b + h * stride_l_h + s)\n",
            "    for s in range(0, live):  # the largest lse first: m is the final max from the start\n"
            "        m = tl.maximum(m, tl.load(lse_ptr + b * stride_l_b + h * stride_l_h + s))\n"
            "    for s in range(0, live):\n        lse = tl.load(lse_ptr + b * stride_l_b + h * stride_l_h + s)\n",
            "two loops: the largest lse first, then the weighted sums"),
    Rewrite("paged_attention_step", "    k_pool[slots] = k                                 # all of its K/V heads at once\n"
            "    v_pool[slots] = v\n", "    k_pool.index_copy_(0, slots, k)\n    v_pool.index_copy_(0, slots, v)\n",
            "the new K/V stored with index_copy_"),
    Rewrite("pad_decode_batch", "    rows = torch.cat([rows, rows.new_full((size - n,), dummy_row)])\n"
            "    positions = torch.cat([positions, positions.new_zeros(size - n)])\n"
            "    return rows, positions, page_table[rows, positions]",
            "    slots = torch.cat([page_table[rows, positions], page_table[dummy_row, 0].repeat(size - n)])\n"
            "    pad = torch.nn.functional.pad\n"
            "    return pad(rows, (0, size - n), value=dummy_row), pad(positions, (0, size - n)), slots",
            "the real slots looked up before padding, the padded ones from the dummy row; F.pad"),
    Rewrite("page_hashes", "    hashes, parent = [], None\n",
            "    hashes, parent = [], None\n    input_ids = list(input_ids)  # a copy, trimmed to whole pages\n"
            "    del input_ids[len(input_ids) // page_size * page_size:]\n",
            "the prompt trimmed to whole pages, in a copy"),
    Rewrite("free_pages", "    for page in reversed(pages):", "    for page in pages[::-1]:",
            "the pages walked through a reversed copy"),
    Rewrite("victim_order",
            "        ranked = sorted(running, key=lambda r: (r.generated, -r.prompt_len), reverse=True)\n"
            "        order = ranked[::-1]",
            "        order = sorted(reversed(running), key=lambda r: (r.generated, -r.prompt_len))",
            "SGLang's order as one ascending sort of the reversed list"),
    Rewrite("next_token_ratio",
            "    return min(1.0, (decoded + policy.retract_decode_steps * len(remaining)) / total_max_new)",
            "    estimate = (decoded + policy.retract_decode_steps * len(remaining)) / total_max_new\n"
            "    return estimate if estimate < 1 else 1.0",
            "the cap written as a conditional"),
    Rewrite("resume_plan",
            "        for pos in range(hit, saved):            # what it had computed and the cache lost\n"
            "            host_slot = host_pages[pos // P] * P + pos % P\n"
            "            copies.append((host_slot, row[pos]))\n",
            "        copies = [(host_pages[pos // P] * P + pos % P, row[pos]) for pos in range(hit, saved)]\n",
            "the copies as a comprehension"),
    Rewrite("swap_out",
            "        host.k[page, :, : len(part)] = pool.k[:, part]   # every layer of those positions\n"
            "        host.v[page, :, : len(part)] = pool.v[:, part]\n",
            "        for j, slot in enumerate(part.tolist()):       # one position at a time\n"
            "            host.k[page, :, j] = pool.k[:, slot]\n"
            "            host.v[page, :, j] = pool.v[:, slot]\n",
            "the copy position by position"),
]


def assert_passes(exercise: str, answer, **kwargs) -> None:
    """The checker of ``exercise`` passes ``answer`` (not merely: calls it not attempted)."""
    getattr(kvlab.check, exercise)(answer, **kwargs)
    assert kvlab.check.status(exercise) == "passed"


@pytest.mark.parametrize("rewrite", REWRITES + REWRITES_CH10_11 + REWRITES_CH09_12,
                         ids=lambda r: f"{r.exercise}: {r.why}")
def test_a_correct_rewrite_passes(rewrite, mutant_dir, capsys):
    good = build_mutant(rewrite.exercise, rewrite.old, rewrite.new, mutant_dir)
    assert_passes(rewrite.exercise, good)


def vectorised_attention(q, k_pool, v_pool, page_table, table_idx, seq_lens):
    """All requests at once: gather every column of the rows, mask positions >= seq_len."""
    import math

    rows = page_table[table_idx.long()].long()  # [batch, max_len]; -1 past each request's end
    k, v = k_pool[rows].float(), v_pool[rows].float()  # [batch, max_len, heads, head_dim]
    scores = torch.einsum("bhd,bnhd->bhn", q.float(), k) / math.sqrt(q.shape[-1])
    past = torch.arange(rows.shape[1]) >= seq_lens[:, None]  # [batch, max_len]
    scores = scores.masked_fill(past[:, None, :], float("-inf"))
    return torch.einsum("bhn,bnhd->bhd", torch.softmax(scores, dim=-1), v)


def write_page_table_by_rows(page_table, allocated, allocation_info, page_size):
    """Slice assignment row by row instead of one scatter."""
    at = 0
    for table_idx, first_page, last_page in allocation_info:
        n = (last_page - first_page) * page_size
        page_table[table_idx, first_page * page_size:last_page * page_size] = allocated[at:at + n]
        at += n


def cache_req_regions_with_a_loop(row_slots, old_cached_len, already_cached_len, req_cached_len,
                                  page_size, finished):
    new = req_cached_len - req_cached_len % page_size
    regions = {"hit": [0, old_cached_len], "duplicate": [old_cached_len, already_cached_len],
               "inserted": [already_cached_len, new], "tail": [new, req_cached_len]}
    free = []
    for name in ("duplicate", "tail") if finished else ("duplicate",):
        start, end = regions[name]
        free += [row_slots[p] for p in range(start, end) if p % page_size == 0]
    return {**regions, "free": free}


def decode_step_in_the_managers_words(manager, reqs, next_tokens, done):
    """The manager's own serving words: decode_step, then complete_step."""
    manager.complete_step(manager.decode_step(reqs), list(next_tokens), list(done))


def match_req_by_a_walk_of_its_own(prefix_cache, input_ids):
    """The matched length (an int) by a walk that only reads the tree: no stamps, no split."""
    from kvlab.course.exercises.ch05_match import match_prefix_solution

    return match_prefix_solution(prefix_cache, input_ids[:-1])


def hash_match_through_the_caches_match(cache, input_ids):
    """The cache's own match (it only reads), its pages turned into slots."""
    P, hit = cache.page_size, cache.match(input_ids)
    return len(hit.pages), [page * P + i for page in hit.pages for i in range(P)]


def allocate_pages_hits_first(cache, input_ids):
    """Every hit first (one match, then take_cached), then the new pages from the queue."""
    from kvlab.prefix.hash_chain import chain_hash

    P, hit = cache.page_size, cache.match(input_ids)
    for page in hit.pages:
        cache.take_cached(page)
    pages, parent = list(hit.pages), (hit.hashes[-1] if hit.hashes else None)
    for start in range(hit.cached_len, len(input_ids), P):
        tokens, page = input_ids[start:start + P], cache.take_free()
        if len(tokens) == P:
            h = chain_hash(parent, tokens)
            cache.cache_page(page, h, tokens, parent)
            parent = h
        pages.append(page)
    return pages, hit.cached_len


OTHER_SHAPES = [("paged_attention", vectorised_attention), ("write_page_table", write_page_table_by_rows),
                ("cache_req_regions", cache_req_regions_with_a_loop),
                ("decode_step", decode_step_in_the_managers_words),
                ("match_req", match_req_by_a_walk_of_its_own),
                ("hash_match", hash_match_through_the_caches_match),
                ("allocate_pages", allocate_pages_hits_first)]


@pytest.mark.parametrize("exercise, answer", OTHER_SHAPES + OTHER_SHAPES_CH10_11,
                         ids=lambda x: getattr(x, "__name__", x))
def test_a_correct_answer_of_another_shape_passes(exercise, answer, capsys):
    assert_passes(exercise, answer)


def test_there_are_enough_rewrites():
    assert len(REWRITES) + len(OTHER_SHAPES) >= 12


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
    last_line = _source(solution).splitlines()[-1]
    same = build_mutant(exercise, last_line, last_line + "  ", mutant_dir)
    checker = getattr(kvlab.check, exercise)
    fewer = {"n_random": 1} if "n_random" in inspect.signature(checker).parameters else {}
    assert_passes(exercise, same, **fewer)


# --- the safety net on planted bugs in an exercise kernel, called directly ---------------------


def test_out_of_bounds_store_in_an_exercise_kernel_is_reported(mutant_dir):
    from kvlab.course.exercises.ch03_extend_parts import extend_case_inputs, run_extend_kernel

    bad = build_mutant("alloc_extend_part1", "mask=offset_one_page < num_part1,", "", mutant_dir)
    pre, seq, P = [5], [7], 4  # part 1 only: 2 slots, but the unmasked store writes 4
    last_loc, free_pages = extend_case_inputs(pre, seq, P)
    with pytest.raises(CheckFailed) as info:
        run_extend_kernel(bad, pre, seq, last_loc, free_pages, P)
    assert "a write past the end of `out_indices` (2 writes, up to 2 elements out)" in str(info.value)


def test_a_wild_load_in_an_exercise_kernel_is_reported(mutant_dir):
    from kvlab.course.exercises.ch03_extend_parts import run_extend_kernel

    # part 2 reads the page one further on: the last token reads past the free list
    bad = build_mutant("alloc_extend_part2", "new_page_start_loc + offset_many_page // page_size,",
                       "new_page_start_loc + offset_many_page // page_size + 1,", mutant_dir)
    with pytest.raises(CheckFailed) as info:
        run_extend_kernel(bad, [0], [3], [-1], [7, 2, 5], 1)  # exactly 3 free pages
    assert "a read past the end of `free_page_ptr`" in str(info.value)


def test_a_far_away_load_is_reported_and_the_process_survives(mutant_dir):
    # part 3 takes its page from far outside free_pages: the interpreter's audit switches the
    # load off (on a GPU: an illegal address in the spawned child, found again in the interpreter)
    bad = build_mutant("alloc_extend_part3", "start_loc = tl.load(free_page_ptr + new_page_start_loc",
                       "start_loc = tl.load(free_page_ptr + (1 << 40) + new_page_start_loc", mutant_dir)
    with pytest.raises(CheckFailed) as info:
        kvlab.check.alloc_extend_part3(bad)
    msg = str(info.value)
    assert "a read far outside every tensor" in msg and "by request 0, part 3" in msg
    assert "start_loc = tl.load(free_page_ptr + (1 << 40)" in msg
    assert torch.arange(3).sum() == 3  # still alive


_PART1_CODE = ("    num_part1 = (\n"
               "        tl.minimum(seq_len, (pre_len + page_size - 1) // page_size * page_size) - pre_len\n"
               "    )\n")


@pytest.mark.parametrize("part", [2, 3])
def test_a_later_part_is_not_checked_while_part_1_is_the_starter(part, mutant_dir):
    starter = build_mutant(f"alloc_extend_part{part}", _PART1_CODE,
                           "    # YOUR CODE HERE: alloc_extend_part1\n    num_part1 = 0\n", mutant_dir)
    with pytest.raises(CheckFailed) as info:
        getattr(kvlab.check, f"alloc_extend_part{part}")(starter)
    assert str(info.value).startswith("part 1 is still the starter")
    assert "kvlab.check.alloc_extend_part1 has to pass first" in str(info.value)
    assert kvlab.check.status(f"alloc_extend_part{part}") == "failed"


def test_a_part_checker_shows_only_the_positions_its_part_owns(mutant_dir):
    # part 3 one slot off: the context lines show part 3's slots, and · at the other parts'
    bad = build_mutant("alloc_extend_part3", "start_loc * page_size + offset_one_page,",
                       "start_loc * page_size + offset_one_page + 1,", mutant_dir)
    with pytest.raises(CheckFailed) as info:
        kvlab.check.alloc_extend_part3(bad)
    msg = str(info.value)
    assert msg.startswith("[the chapter's worked example: A 70->190, B 128->260, page_size 64]")
    assert "inputs: pre=[70, 128], seq=[190, 260], last_loc=[133, 127], free_pages=[7, 3, 9, 5" in msg
    expected_line = next(line for line in msg.splitlines() if line.strip().startswith("expected[55:63]"))
    assert "[·, ·, ·, 448," in expected_line and "· marks the positions of the other parts" in msg


def test_the_remap_checker_expects_the_row_the_cache_manager_leaves():
    # the checker's expected row is what kvlab.CacheManager.cache_req(finished=False) leaves
    from kvlab import CacheManager, Req
    from kvlab.course.exercises.ch06_regions import cache_req_remap_solution
    from kvlab.alloc.paging import new_page_table

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


@pytest.mark.parametrize("why", ["part 2's page load unmasked (the store still masked): a read that "
                                 "never reaches an output", "every decode program stores ret_values: a race",
                                 "keeps walking after the prompt left a node part-way"])
def test_a_spawned_child_gives_the_same_findings(why, mutant_dir, monkeypatch):
    # KVLAB_SANDBOX=spawn: the kernel travels to a new Python by its source; the audit, the
    # program orders and the lines quoted work there as in a fork
    monkeypatch.setenv("KVLAB_SANDBOX", "spawn")
    _reject(next(m for m in MUTANTS if m.why == why), mutant_dir)
