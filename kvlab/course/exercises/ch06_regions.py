"""Chapter 06's exercises: ``kvlab.check.cache_req_regions(fn)`` and ``kvlab.check.cache_req_remap(fn)``.

The learner writes the accounting at the heart of ``CacheManager.cache_req``::

    fn(row_slots, old_cached_len, already_cached_len, req_cached_len, page_size, finished)
        -> {"hit": (s, e), "duplicate": (s, e), "inserted": (s, e), "tail": (s, e),
            "free": [page-start slots to return to the free list]}

``row_slots`` is the request's page-table row over ``[0, req_cached_len)``. The learner works
out ``new_cached_len`` (whole pages of ``req_cached_len``), the four regions, and which
pages go back: the duplicate region always, the tail only when the request finished, one
entry per page (``[::page_size]``). ``row_slots`` is read-only. Checked against
:func:`kvlab.course.reference.radix_ref.cache_req_regions_ref`; a failure names the wrong region. The rows
map shuffled pages from page 100 on, so a slot never equals its position by accident.

``cache_req_remap`` is what ``cache_req`` does to the row of a request that goes on running
(``finished=False``)::

    fn(row_slots, cached_slots, old_cached_len, already_cached_len, page_size)
        -> {"free": [page starts of the duplicate region], "row": [the row afterwards]}

``cached_slots`` are the slots the prefix cache holds for the request's tokens after the
insert (``new_handle.get_matched_indices()``); both lists are read-only (a new ``row`` is
returned). The duplicate region's pages are freed, so the row must map the cached slots there
instead; a row left pointing at freed pages is the source design's bug, and the checker says
so::

    position  0        old_cached_len      already_cached_len             req_cached_len
    before    | cached  | own pages (dup.)  | own pages (inserted, tail)     |
    after     | cached  | cached_slots[...] | own pages (inserted, tail)     |
"""
from __future__ import annotations

import random

import torch

from ..reference.radix_ref import cache_req_regions_ref, page_aligned_len
from ..checking.core import Case, CheckFailed, Segment, call_learner, compare_flat, exercise, run_cases

REGIONS = ("hit", "duplicate", "inserted", "tail")
MEANING = {
    "hit": "[0, old_cached_len): in the cache before the prefill",
    "duplicate": "[old_cached_len, already_cached_len): computed here but cached meanwhile by "
                 "another request",
    "inserted": "[already_cached_len, new_cached_len): newly inserted, new_cached_len = "
                "req_cached_len // page_size * page_size",
    "tail": "[new_cached_len, req_cached_len): the partial last page",
}


def cache_req_regions_solution(row_slots, old_cached_len, already_cached_len, req_cached_len,
                               page_size, finished):
    """The four regions of ``[0, req_cached_len)`` and the page starts to free."""
    new_cached_len = req_cached_len // page_size * page_size  # insert_prefix keeps whole pages
    free = list(row_slots[old_cached_len:already_cached_len:page_size])  # duplicates: always
    if finished:
        free += list(row_slots[new_cached_len:req_cached_len:page_size])  # the tail: when done
    return {
        "hit": (0, old_cached_len),
        "duplicate": (old_cached_len, already_cached_len),
        "inserted": (already_cached_len, new_cached_len),
        "tail": (new_cached_len, req_cached_len),
        "free": free,
    }


#: the first page id of the rows' pages: no slot equals its position (or a small number)
FIRST_PAGE = 100


def _row(rng: random.Random, n: int, P: int) -> list[int]:
    """A row of whole pages from a shuffled pool: page k holds slots p*P .. p*P+P-1."""
    pages = list(range(FIRST_PAGE, FIRST_PAGE + 2 * (n // P + 2)))
    rng.shuffle(pages)
    return [pages[i // P] * P + i % P for i in range(n)]


def _random_geometry(rng: random.Random) -> tuple[int, int, int, int]:
    """A random (page_size, old, already, req) with old <= already <= req rounded up to a page,
    both cached lengths page-aligned: the shapes cache_req meets."""
    P = rng.choice([1, 2, 4, 16, 64])
    req = rng.randrange(1, 5 * P + 3)
    new = page_aligned_len(req, P)
    already = rng.randrange(0, new // P + 1) * P
    old = rng.randrange(0, already // P + 1) * P
    return P, old, already, req


def _cases(seed: int, n_random: int) -> list[Case]:
    def case(name, P, old, already, req, finished, kind="edge", seed=0):
        return Case(name, {"P": P, "old": old, "already": already, "req": req, "finished": finished,
                           "seed": seed}, kind)

    cases = [
        case("plain hit, unfinished", 4, 8, 8, 10, False),
        case("plain hit, finished: free the tail", 4, 8, 8, 10, True),
        case("no hit, nothing cached before: all inserted", 4, 0, 0, 10, False),
        case("same prompt prefilled in one batch: duplicate", 4, 0, 8, 10, False),
        case("duplicate and finished", 4, 0, 8, 10, True),
        case("page-aligned length: empty tail", 4, 4, 4, 12, True),
        case("page_size 1: no tail ever", 1, 2, 5, 7, True),
        case("hit, then a duplicate, then new pages", 2, 2, 6, 11, True),
        case("shorter than a page", 4, 0, 0, 3, True),
        case("page_size 64: hit, duplicate, inserted and tail, finished", 64, 64, 192, 300, True),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        P, old, already, req = _random_geometry(rng)
        cases.append(case(f"random {i + 1} (page_size {P})", P, old, already, req,
                          rng.random() < 0.5, "random", rng.randrange(1000)))
    return cases


@exercise(
    "cache_req_regions",
    chapter="06",
    order=1,
    hints=[
        "First find new_cached_len: insert_prefix caches whole pages only, so it is "
        "req_cached_len // page_size * page_size.",
        "The four regions are consecutive and cover [0, req_cached_len): hit [0, old), duplicate "
        "[old, already), inserted [already, new), tail [new, req_cached_len).",
        "Free the duplicate pages always and the tail pages only when finished. row_slots holds "
        "token slots; the free list wants one page start per page: slice with [start:end:page_size].",
    ],
    solution=cache_req_regions_solution,
)
def cache_req_regions(fn, *, seed: int = 0, n_random: int = 16) -> int:
    """Check ``fn(row_slots, old_cached_len, already_cached_len, req_cached_len, page_size, finished)``."""

    def run_one(case: Case) -> None:
        a = case.args
        P = a["P"]
        row = _row(random.Random(a["seed"]), a["req"], P)
        new = page_aligned_len(a["req"], P)
        ref = cache_req_regions_ref(a["old"], a["already"], new, a["req"], a["finished"])
        got = call_learner(fn, list(row), a["old"], a["already"], a["req"], P, a["finished"],
                           read_only=(0,))
        where = (f"  page_size {P}, old_cached_len {a['old']}, already_cached_len {a['already']}, "
                 f"req_cached_len {a['req']}, finished={a['finished']}")
        if not isinstance(got, dict):
            raise CheckFailed(f"[{case.name}] return a dict with keys {list(REGIONS) + ['free']}, "
                              f"got {type(got).__name__}", case=case.name)
        for name in REGIONS:
            if name not in got:
                raise CheckFailed(f"[{case.name}] the result has no {name!r} region", case=case.name,
                                  label=f"region: {name}")
            try:
                value = tuple(int(v) for v in got[name])
            except (TypeError, ValueError):
                value = got[name]
            if value != getattr(ref, name):
                raise CheckFailed(
                    f"[{case.name}] region {name!r} is wrong: expected {getattr(ref, name)}, got "
                    f"{got[name]!r}\n  {name} = {MEANING[name]}\n{where}",
                    case=case.name, expected=getattr(ref, name), got=got[name], label=f"region: {name}")
        expected_free = [row[p] for s, e in ref.freed for p in range(s, e, P)]
        got_free = [int(v) for v in got.get("free", [])]
        if sorted(got_free) != sorted(expected_free):
            dup = [row[p] for p in range(a["old"], a["already"], P)]
            tail = [row[p] for p in range(new, a["req"], P)]
            advice = []
            if any(s % P for s in got_free):
                advice.append("the free list holds page starts (multiples of page_size): take "
                              "every page_size-th slot")
            if a["finished"] and not set(tail) <= set(got_free):
                advice.append("a finished request frees its tail")
            if not a["finished"] and set(tail) & set(got_free):
                advice.append("an unfinished request keeps its tail (it is still decoding into it)")
            if not set(dup) <= set(got_free):
                advice.append("the duplicate pages are always freed (else they leak)")
            raise CheckFailed(
                f"[{case.name}] free: expected page starts {sorted(expected_free)}, got "
                f"{sorted(got_free)}" + ("\n  " + "; ".join(advice) if advice else "") + f"\n{where}",
                case=case.name, expected=expected_free, got=got_free, label="free")

    return run_cases("cache_req_regions", _cases(seed, n_random), run_one)


# --- cache_req_remap: the row of an unfinished request -------------------------------------


def cache_req_remap_solution(row_slots, cached_slots, old_cached_len, already_cached_len, page_size):
    """Free the duplicate region's pages and point that part of the row at the cached slots."""
    free = list(row_slots[old_cached_len:already_cached_len:page_size])  # one entry per page
    row = list(row_slots)
    row[old_cached_len:already_cached_len] = cached_slots[old_cached_len:already_cached_len]
    return {"free": free, "row": row}


def _remap_inputs(a: dict) -> tuple[list[int], list[int]]:
    """A row and the cache's slots for one case, built from disjoint shuffled pages.

    ``[0, old)`` maps cached pages (the hit); ``[old, req)`` the request's own pages; the
    cache holds other pages for ``[old, already)`` (another request inserted them first) and
    the request's own for ``[already, new)`` (this insert).
    """
    P, old, already, req = a["P"], a["old"], a["already"], a["req"]
    new = page_aligned_len(req, P)
    rng = random.Random(a["seed"])
    pages = list(range(FIRST_PAGE, FIRST_PAGE + 2 * (req // P + 2)))
    rng.shuffle(pages)
    n_pages = -(-req // P)
    own, others = pages[:n_pages], pages[n_pages:]

    def slot(page_list, pos):
        return page_list[pos // P] * P + pos % P

    cached = [slot(others, p) if p < already else slot(own, p) for p in range(new)]
    row = [cached[p] if p < old else slot(own, p) for p in range(req)]
    return row, cached


def _remap_cases(seed: int, n_random: int) -> list[Case]:
    def case(name, P, old, already, req, kind="edge", seed=0):
        return Case(name, {"P": P, "old": old, "already": already, "req": req, "seed": seed}, kind)

    cases = [
        case("same prompt prefilled in one batch: duplicate", 4, 0, 8, 10),
        case("no duplicate: the row stays as it is", 4, 8, 8, 10),
        case("page_size 1", 1, 2, 5, 7),
        case("hit, then a duplicate, then new pages", 2, 2, 6, 11),
        case("duplicate up to the end (page-aligned, no tail)", 4, 4, 12, 12),
        case("nothing cached", 4, 0, 0, 3),
        case("page_size 64: hit, two duplicate pages, a tail", 64, 64, 192, 250),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        P, old, already, req = _random_geometry(rng)
        cases.append(case(f"random {i + 1} (page_size {P})", P, old, already, req, "random",
                          rng.randrange(1000)))
    return cases


@exercise(
    "cache_req_remap",
    chapter="06",
    order=2,
    hints=[
        "Only the duplicate region [old_cached_len, already_cached_len) changes. Its pages go back "
        "to the free list: one page start per page, row_slots[old_cached_len:already_cached_len:page_size].",
        "The request keeps decoding and its attention reads every position through the row: after "
        "freeing the duplicate pages, the row must not point at them any more.",
        "Copy the row, then set row[old_cached_len:already_cached_len] = "
        "cached_slots[old_cached_len:already_cached_len]: the cache's own copy of those tokens, "
        "which the request's new handle locks.",
    ],
    solution=cache_req_remap_solution,
)
def cache_req_remap(fn, *, seed: int = 0, n_random: int = 12) -> int:
    """Check ``fn(row_slots, cached_slots, old_cached_len, already_cached_len, page_size)``
    ``-> {"free": [...], "row": [...]}`` for a request that goes on running."""

    def run_one(case: Case) -> None:
        a = case.args
        P, old, already, req = a["P"], a["old"], a["already"], a["req"]
        new = page_aligned_len(req, P)
        row, cached = _remap_inputs(a)
        expected_row = cached[:already] + row[already:]
        expected_free = row[old:already:P]
        where = (f"  page_size {P}, old_cached_len {old}, already_cached_len {already}, "
                 f"req_cached_len {req} (unfinished)")
        got = call_learner(fn, list(row), list(cached), old, already, P, read_only=(0, 1))
        if not isinstance(got, dict) or "free" not in got or "row" not in got:
            raise CheckFailed(f"[{case.name}] return a dict with keys 'free' and 'row', got {got!r}",
                              case=case.name)
        got_free = [int(v) for v in got["free"]]
        if sorted(got_free) != sorted(expected_free):
            advice = ("the duplicate pages are always freed, one page start per page "
                      "(row_slots[old_cached_len:already_cached_len:page_size])")
            if set(got_free) - set(expected_free):
                advice += "; nothing else is freed while the request runs"
            raise CheckFailed(f"[{case.name}] free: expected page starts {sorted(expected_free)}, got "
                              f"{sorted(got_free)}\n  {advice}\n{where}", case=case.name,
                              expected=expected_free, got=got_free, label="free")
        segments = [Segment(f"region: {name}", s, e) for name, (s, e) in
                    [("hit", (0, old)), ("duplicate", (old, already)), ("inserted", (already, new)),
                     ("tail", (new, req))] if e > s]
        try:
            compare_flat(torch.tensor(expected_row, dtype=torch.int64), got["row"], case=case.name,
                         what="row", segments=segments)
        except CheckFailed as err:
            got_row = [int(v) for v in err.got] if err.got is not None else []
            freed_pages = {s // P for s in expected_free}
            stale = [p for p in range(old, min(already, len(got_row))) if got_row[p] // P in freed_pages]
            if stale:
                p = stale[0]
                advice = (f"region 'duplicate' [{old}, {already}): position {p} still maps slot "
                          f"{got_row[p]}, whose page you free: the row would point at freed pages "
                          f"(remap it to the cached slot {cached[p]}, "
                          f"cached_slots[old_cached_len:already_cached_len])")
            elif err.label == "region: duplicate":
                advice = (f"region 'duplicate' [{old}, {already}): each position maps the cached slot "
                          "of the same position, cached_slots[p]")
            elif err.label in ("region: hit", "region: inserted", "region: tail"):
                advice = (f"region '{err.label.split(': ')[1]}': only the duplicate region is "
                          "remapped; the rest of the row stays as it was")
            else:
                advice = "the row keeps its length and positions; only the duplicate region changes"
            err.args = (f"{err.args[0]}\n  {advice}\n{where}",) + tuple(err.args[1:])
            raise

    return run_cases("cache_req_remap", _remap_cases(seed, n_random), run_one)
