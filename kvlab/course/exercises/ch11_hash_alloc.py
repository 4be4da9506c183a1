"""Chapter 11's allocation exercises: ``kvlab.check.allocate_pages(fn)`` and
``kvlab.check.free_pages(fn)``, on a real :class:`~kvlab.prefix.hash_cache.HashPrefixCache`.

``allocate_pages(cache, input_ids) -> (pages, cached_len)``: nano-vllm's ``allocate`` from the
cache's building blocks (``lookup``, ``take_cached``, ``take_free``, ``cache_page``): the cached
chain first (hits), then pages from the head of the free queue, each new full page cached.

``free_pages(cache, pages)``: drop one reference per page, last page first; a page nobody holds
joins the tail of ``cache.free_queue`` and keeps its hash; a count never goes below zero (the
call refuses, changing nothing).

Each case builds the same cache three times (with :func:`kvlab.course.exercises.ch11_hash_chain.build_pool`,
the free queue in a shuffled order, page 0 never first): the learner's function runs on one,
the oracle (:mod:`kvlab.course.reference.hash_chain_ref`) and the reference solution on the others. The
answer and every reference count, the free queue in order, which pages are cached under which
hash and ``evicted_pages`` are compared with the oracle (a recognised slip is named), then
everything else the cache keeps (each page's parent hash and tokens, the locks) with the
reference's cache (:mod:`kvlab.course.checking.pool_state`). ``input_ids`` and ``pages`` are read-only.
Page sizes run from 1 to 64.
"""
from __future__ import annotations

import random

from ...prefix.hash_chain import chain_hash, page_hashes, short
from ..checking.answers import expect_int, expect_ints, expect_parts
from .ch11_hash_chain import _A, _B, _LONG, build_pool, pool_order, random_script, shown_script
from ..checking.core import Case, CheckFailed, call_learner, exercise, run_cases
from ..checking.failures import fmt_values
from ..checking.pool_state import pool_difference, pool_state


def compare_pool(case: str, cache, ref, twin, where: str, before=None) -> None:
    """The learner's cache against the oracle (counts, queue, cached pages and their hashes,
    evictions), then against ``twin``, the cache the reference solution left (all the rest).
    ``before``: the cache's :func:`pool_state` before the call, to tell what became of a page."""
    P = cache.page_size
    for p, (r, g) in enumerate(zip(ref.refs, cache.ref_count)):
        if r != g:
            why = " (it went below zero: a page with no reference left was freed)" if g < 0 else ""
            raise CheckFailed(f"[{case}] page {p}: ref_count should be {r}, got {g}{why}{where}",
                              case=case, label=f"page {p}", expected=r, got=g)
    if ref.queue != list(cache.free_queue):
        raise CheckFailed(f"[{case}] free queue (head first) should be {ref.queue}, got "
                          f"{list(cache.free_queue)} (a hit on a free page takes it out of the queue, "
                          "new pages come from its head, a page nobody holds any more joins its tail, "
                          f"last page first){where}", case=case, label="free queue")
    expected = {p: page_hashes(list(key), P)[-1] for key, p in ref.page_of.items()}
    got = {p: h for h, p in cache.hash_to_page.items()}
    for p in sorted(set(expected) | set(got)):
        if expected.get(p) == got.get(p) and cache.page_hash[p] == expected.get(p):
            continue
        if p not in expected:
            tokens = cache.page_tokens[p]
            old = before.pages[p] if before is not None else None
            if tokens is not None and len(tokens) < P:
                why = f"it holds a partial page {list(tokens)}: only full pages are cached"
            elif (ref.refs[p] > 0 and old is not None and old.ref_count == 0
                  and old.page_hash == got.get(p)):
                why = ("it was a free cached page, and it is in use now, for other tokens, under "
                       "its old hash: a page handed out loses its old hash (cache.take_free() "
                       "drops it)")
            else:
                why = "it should not be cached"
            raise CheckFailed(f"[{case}] page {p} is cached under {short(got.get(p))}, but {why}{where}",
                              case=case, label=f"page {p}")
        if p not in got:
            raise CheckFailed(f"[{case}] page {p} should be findable under hash {short(expected[p])}, "
                              "but hash_to_page does not send that hash to it (a new full page is "
                              "cached when it is allocated, and a freed page keeps its hash until the "
                              f"free queue hands it out){where}", case=case,
                              label=f"page {p}")
        raise CheckFailed(f"[{case}] page {p} is cached under {short(got[p])}, expected "
                          f"{short(expected[p])} (the chained hash of every token up to its end){where}",
                          case=case, label=f"page {p}")
    if cache.evicted_pages != ref.evicted:
        raise CheckFailed(f"[{case}] evicted_pages should be {ref.evicted}, got {cache.evicted_pages} "
                          "(it counts the cached pages handed out for other tokens: take_free counts "
                          "one when it hands out a page that still has a hash; a freed page keeps "
                          f"its hash and is not evicted yet){where}", case=case, label="evicted_pages",
                          expected=ref.evicted, got=cache.evicted_pages)
    why = pool_difference(pool_state(twin), pool_state(cache), old="should be", new="is")
    if why:
        raise CheckFailed(f"[{case}] the cache is not as the reference solution leaves it: {why}"
                          f"{where}", case=case, label="cache")
    try:
        cache.check_integrity()
    except AssertionError as e:
        raise CheckFailed(f"[{case}] the cache's integrity check fails: {e}{where}", case=case) from None


def _where(a: dict, what: str) -> str:
    """The case's setting, for a failure message: page size, first queue order, script, call."""
    order = fmt_values(pool_order(a["pages"], a["seed"]), 16)
    return (f"\n  page_size {a['P']}; free queue at first {order}; cached with "
            f"{shown_script(a['script'])}\n  {what}")


# --- allocate_pages -----------------------------------------------------------------------


def allocate_pages_solution(cache, input_ids):
    """Pages for a new sequence: its cached chain (hits), then new pages; returns (pages, cached_len)."""
    P = cache.page_size
    pages, parent, cached_len, hitting = [], None, 0, True
    for start in range(0, len(input_ids), P):
        tokens = input_ids[start:start + P]
        full = len(tokens) == P
        h = chain_hash(parent, tokens) if full else None
        page = cache.lookup(h, tokens) if hitting and full else None
        if page is not None:
            cache.take_cached(page)  # a hit: one more reference (a free page leaves the queue)
            cached_len += P
        else:
            hitting = False  # after a miss nothing further can hit: the chain is broken
            page = cache.take_free()  # the head of the free queue; a cached one loses its hash
            if full:
                cache.cache_page(page, h, tokens, parent)
        pages.append(page)
        parent = h
    return pages, cached_len


def _alloc_cases(seed: int, n_random: int) -> list[Case]:
    def case(name, P, script, ids, kind="edge", num_pages=12):
        return Case(name, {"P": P, "script": script, "ids": ids, "pages": num_pages,
                           "seed": sum(name.encode())}, kind)  # each case its own page order

    head = [("alloc", [1, 2, 3, 4]), ("alloc", [8]), ("alloc", [9, 9, 9, 9]), ("free", 0), ("free", 1)]
    cases = [
        case("empty cache: every page new, full ones cached", 2, [], [1, 2, 3, 4, 5]),
        case("hits on pages in use", 2, [("alloc", _A)], _A[:4] + [0, 0, 0]),
        case("hits on free cached pages: they leave the queue", 2, [("alloc", _A), ("free", 0)], _A[:6] + [0]),
        case("every page of the prompt cached: all hits, nothing new", 2, [("alloc", _A)], _A),
        case("every full page cached, in use and free", 4, [("alloc", _A), ("alloc", _A[:4]), ("free", 0)], _A),
        case("the queue's head is a cached page this prompt hits: hits first, then new pages", 2,
             head, [1, 2, 3, 4, 5], num_pages=5),
        case("the partial last page is never cached", 4, [("alloc", _A)], _A[:6]),
        case("same tokens after another beginning: a miss", 2, [("alloc", _B)], [1, 2, 9, 9, 9, 9]),
        case("a later page cached, an earlier one not: stop at the miss", 2,
             [("alloc", _A), ("free", 0), ("orphan", _A)], _A),
        case("the queue hands out a cached page: its hash goes", 2,
             [("alloc", _A), ("free", 0), ("alloc", _B)], [7, 7, 7, 7, 7], num_pages=7),
        case("page_size 1", 1, [("alloc", [5, 6, 7]), ("free", 0)], [5, 6, 8]),
        case("token ids past 255", 2, [("alloc", [256, 1, 300, 7])], [256, 1, 300, 7, 999, 1000]),
        case("full pages handed out again: each one evicted", 2,
             [("alloc", _A), ("free", 0), ("alloc", [9] * 8)], [8] * 8, num_pages=10),
        case("page_size 64: a hit, then a new full page and a partial one", 64,
             [("alloc", _LONG), ("free", 0)], _LONG[:64] + [3] * 70),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        P, script, starts = random_script(rng, free_chance=0.6)
        ids = rng.choice(starts)[: rng.randrange(0, 3 * P + 1)] + [rng.randrange(3) for _ in range(rng.randrange(1, 3))]
        cases.append(case(f"random {i + 1} (page_size {P})", P, script, ids, "random", num_pages=14))
    return cases


@exercise(
    "allocate_pages",
    chapter="11",
    order=3,
    hints=[
        "Walk the prompt page by page (the last page may be partial). While every page so far "
        "was a hit, hash a full page with its parent and cache.lookup(h, tokens): a page found "
        "is a hit, cache.take_cached(page) gives it one more reference.",
        "The first miss ends the hits for good. From there on every page is new: "
        "cache.take_free() hands out the head of the free queue; a new FULL page becomes "
        "findable with cache.cache_page(page, h, tokens, parent). A partial page gets no hash.",
        "Keep parent = h after every page (hit or not) so the next hash chains from it; return "
        "(pages, cached_len) with cached_len = P * number of hits.",
    ],
    solution=allocate_pages_solution,
)
def allocate_pages(fn, *, seed: int = 0, n_random: int = 10) -> int:
    """Check ``fn(cache, input_ids) -> (pages, cached_len)`` (nano-vllm's allocate): pages a
    list (or tuple) of ints, cached_len an int."""

    def run_one(case: Case) -> None:
        a = case.args
        cache, ref, _ = build_pool(a["P"], a["pages"], a["script"], a["seed"])
        twin, _, _ = build_pool(a["P"], a["pages"], a["script"], a["seed"])
        expected = ref.allocate(a["ids"])
        allocate_pages_solution(twin, list(a["ids"]))
        before = pool_state(cache)
        got = call_learner(fn, cache, list(a["ids"]), read_only=(1,))
        where = _where(a, f"input_ids {fmt_values(a['ids'], 24)}")
        pages, cached_len = expect_parts(case.name, got, ("pages", "cached_len"))
        pages = expect_ints(case.name, "pages", pages, (list, tuple), "page ids")
        expect_int(case.name, "cached_len", cached_len)
        if cached_len != expected.cached_len:
            raise CheckFailed(f"[{case.name}] cached_len should be {expected.cached_len}, got "
                              f"{cached_len} (hits are the cached chain from the first page, in whole "
                              f"pages){where}", case=case.name, expected=expected.cached_len, got=cached_len)
        if pages != list(expected.pages):
            raise CheckFailed(f"[{case.name}] pages should be {list(expected.pages)}, got {pages} (hits "
                              f"first, then the head of the free queue){where}", case=case.name)
        compare_pool(case.name, cache, ref, twin, where, before)

    return run_cases("allocate_pages", _alloc_cases(seed, n_random), run_one)


# --- free_pages ---------------------------------------------------------------------------


def free_pages_solution(cache, pages):
    """Drop one reference from each page, last page first; a page nobody holds joins the queue."""
    for page in set(pages):  # refuse before changing anything: a count never goes below zero
        if cache.ref_count[page] < list(pages).count(page):
            raise ValueError(f"page {page} has no reference left to drop")
    for page in reversed(pages):  # the tail of a chain is evicted before its beginning
        cache.ref_count[page] -= 1
        if cache.ref_count[page] == 0:
            cache.free_queue.append(page)  # it keeps its hash: still findable until reused


def _free_cases(seed: int, n_random: int) -> list[Case]:
    """``free``: which pages to free, ``k`` (all of allocation k) or ``[(k, i), ...]`` (page i
    of allocation k; ``i`` None: all of its pages)."""
    def case(name, P, script, free, kind="edge"):
        return Case(name, {"P": P, "script": script, "free": free, "pages": 12,
                           "seed": sum(name.encode())}, kind)  # each case its own page order

    two = [("alloc", _A), ("alloc", _A[:4] + [6, 6, 6])]
    cases = [
        case("free one sequence: last page first", 2, [("alloc", _A)], 0),
        case("shared pages stay out of the queue", 2, two, 1),
        case("the last holder frees the shared pages", 2, two + [("free", 1)], 0),
        case("a partial page queues too (without a hash)", 4, [("alloc", _A[:6])], 0),
        case("pages freed already: refuse, change nothing", 2, [("alloc", _A), ("free", 0)], 0),
        case("only the first page has no reference left: refuse, change nothing", 2,
             [("alloc", [5, 5]), ("free", 0), ("alloc", _A)], [(0, 0), (1, None)]),
        case("a page listed twice, with one reference: refuse, change nothing", 2,
             [("alloc", _A)], [(0, None), (0, 3)]),
        case("a page listed twice, with two references: both go", 2, two, [(1, None), (0, 0)]),
        case("page_size 1", 1, [("alloc", [5, 6, 7]), ("alloc", [5, 6, 9])], 0),
        case("token ids past 255", 2, [("alloc", [256, 1, 300, 7, 2])], 0),
        case("page_size 64: the shared first page stays, the rest queue", 64,
             [("alloc", _LONG), ("alloc", _LONG[:64] + [1] * 64)], 1),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        P = rng.choice([1, 2, 4, 8])
        start = [rng.randrange(3) for _ in range(3 * P)]
        script = [("alloc", start[: rng.randrange(1, 3 * P + 1)] + [rng.randrange(3)]) for _ in range(3)]
        free = rng.randrange(3) if i % 3 else [(rng.randrange(3), None), (rng.randrange(3), 0)]
        cases.append(case(f"random {i + 1} (page_size {P})", P, script, free, "random"))
    return cases


def _chosen(allocations, free) -> tuple[list[int], str]:
    """The pages a free case frees, and how the messages say which."""
    if isinstance(free, int):
        return list(allocations[free]), f"the pages of allocation {free}"
    pages = [p for k, i in free for p in (allocations[k] if i is None else [allocations[k][i]])]
    said = " + ".join(f"allocation {k}'s pages" if i is None else f"page {i} of allocation {k}"
                      for k, i in free)
    return pages, said


@exercise(
    "free_pages",
    chapter="11",
    order=4,
    hints=[
        "For each page, from the LAST to the first: cache.ref_count[page] -= 1. The deep end of a "
        "chain then queues before its beginning, so it is evicted first.",
        "A page whose count reaches 0 goes to the tail: cache.free_queue.append(page). Leave its "
        "hash alone: a later prompt with the same prefix can still hit it, until the queue hands "
        "the page out again.",
        "Before changing anything, check that every page has a reference to drop "
        "(cache.ref_count[page] >= how often it appears); if not, raise an error.",
    ],
    solution=free_pages_solution,
)
def free_pages(fn, *, seed: int = 0, n_random: int = 10) -> int:
    """Check ``fn(cache, pages)`` (nano-vllm's deallocate: reference counts and the free queue)."""

    def run_one(case: Case) -> None:
        a = case.args
        script = a["script"]
        cache, ref, allocations = build_pool(a["P"], a["pages"], script, a["seed"])
        twin, _, _ = build_pool(a["P"], a["pages"], script, a["seed"])
        pages, said = _chosen(allocations, a["free"])
        where = _where(a, f"free {pages} ({said})")
        refused = False
        try:
            ref.free(pages)
            free_pages_solution(twin, list(pages))
        except Exception:  # noqa: BLE001 - the oracle refuses: the learner must too
            refused = True
        try:
            call_learner(fn, cache, list(pages), read_only=(1,))
        except CheckFailed:
            raise
        except Exception as e:  # noqa: BLE001
            if not refused:
                raise CheckFailed(f"[{case.name}] your code raised {type(e).__name__}: {e}{where}",
                                  case=case.name) from e
            where = (f"\n  your code raised, as it must, but only after changing the cache: free "
                     f"must check every page before it changes anything{where}")
        else:
            if refused:
                short_of = next(p for p in pages if twin.ref_count[p] < pages.count(p))
                raise CheckFailed(f"[{case.name}] page {short_of} is listed {pages.count(short_of)} "
                                  f"time(s) but holds {twin.ref_count[short_of]} reference(s): free "
                                  "must refuse (raise) before changing anything, so that no count "
                                  f"goes below zero{where}", case=case.name)
        compare_pool(case.name, cache, ref, twin, where)

    return run_cases("free_pages", _free_cases(seed, n_random), run_one)
