"""Chapter 11's first exercises: ``kvlab.check.page_hashes(fn)`` and ``kvlab.check.hash_match(fn)``.

``page_hashes``: the chained hash of every full page of a prompt, with
:func:`kvlab.chain_hash`: ``h_k = chain_hash(h_{k-1}, page_k)``, ``h_{-1} = None``; a partial
last page has no hash. ``input_ids`` is read-only.

``hash_match``: walk a real :class:`~kvlab.hash_cache.HashPrefixCache` (read only:
``cache.lookup(h, tokens)``) page by page and return ``(matched pages, their slots)``; the walk
stops at the first page that is not cached. The cache and ``input_ids`` are read-only: every
page's count, hash and tokens, ``hash_to_page``, the free queue's order and ``evicted_pages``
are compared after the call (:mod:`kvlab.check.pool_state`).

Page sizes run from 1 to 64. The pools hand out their pages in a shuffled order (page 0 never
first), so a page id is never its prompt's page number, and a slot never its position, by
accident.

Expected answers come from :mod:`kvlab.reference.hashchain`, which knows a cached page by the
tuple of all tokens up to its end instead of a hash.
"""
from __future__ import annotations

import random

from ..hash_cache import HashPrefixCache
from ..hash_chain import FreeQueue, chain_hash, short
from ..reference.hashchain import PagePoolRef
from .core import Case, CheckFailed, call_learner, exercise, run_cases
from .failures import fmt_values


def shown_script(script) -> str:
    """A pool's script as the messages show it (long prompts cut short)."""
    return "[" + ", ".join(f"({op!r}, {fmt_values(arg, 16) if isinstance(arg, list) else arg})"
                           for op, arg in script) + "]"


# --- page_hashes --------------------------------------------------------------------------


def page_hashes_solution(input_ids, page_size):
    """The chained hash of every full page of input_ids (a partial last page has none)."""
    hashes, parent = [], None
    for start in range(0, len(input_ids) - page_size + 1, page_size):
        parent = chain_hash(parent, input_ids[start:start + page_size])
        hashes.append(parent)
    return hashes


def _hash_cases(seed: int, n_random: int) -> list[Case]:
    def case(name, ids, P, kind="edge"):
        return Case(name, {"ids": ids, "P": P}, kind)

    cases = [
        case("two full pages", [1, 2, 3, 4, 5, 6, 7, 8], 4),
        case("a partial last page has no hash", [1, 2, 3, 4, 5, 6], 4),
        case("shorter than a page: no hash at all", [1, 2, 3], 4),
        case("empty prompt", [], 2),
        case("page_size 1: one hash per token", [5, 6, 5, 6], 1),
        case("the same page twice in a row", [7, 7, 7, 7], 2),
        case("the same tokens after another first page", [9, 9, 3, 4], 2),
        case("page_size 64: two full pages and a partial one", [(7 * i) % 101 for i in range(150)], 64),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        P = rng.choice([1, 2, 3, 4, 8])
        cases.append(case(f"random {i + 1} (page_size {P})", [rng.randrange(6) for _ in range(rng.randrange(0, 14))],
                          P, "random"))
    return cases


@exercise(
    "page_hashes",
    chapter="11",
    hints=[
        "One hash per FULL page: the pages start at 0, P, 2P, ... as long as a whole page fits "
        "(start + P <= len(input_ids)); a partial last page gets no hash.",
        "Each page's hash covers everything before it: pass the previous page's hash as the "
        "parent, kvlab.chain_hash(parent, page_tokens). The first page has no parent (None).",
        "parent = None; for each full page: parent = chain_hash(parent, input_ids[start:start + P]); "
        "append parent. Return the list.",
    ],
    solution=page_hashes_solution,
)
def page_hashes(fn, *, seed: int = 0, n_random: int = 10) -> int:
    """Check ``fn(input_ids, page_size) -> list of page hashes``."""

    def run_one(case: Case) -> None:
        ids, P = case.args["ids"], case.args["P"]
        expected = page_hashes_solution(ids, P)
        got = call_learner(fn, list(ids), P, read_only=(0,))
        where = f"\n  page_size {P}, input_ids {fmt_values(ids, 24)}"
        if not isinstance(got, (list, tuple)) or not all(isinstance(h, bytes) for h in got):
            raise CheckFailed(f"[{case.name}] return a list of hashes (bytes from kvlab.chain_hash), "
                              f"not {type(got).__name__}{where}", case=case.name)
        if len(got) != len(expected):
            why = ""
            if len(got) == len(expected) + 1 and len(ids) % P:
                why = (f": the last {len(ids) % P} token(s) are a partial page, which has no hash "
                       "(it is never shared: its other slots belong to nobody yet)")
            raise CheckFailed(f"[{case.name}] {len(expected)} full page(s), so {len(expected)} "
                              f"hash(es); got {len(got)}{why}{where}", case=case.name)
        for k, (e, g) in enumerate(zip(expected, got)):
            if e == g:
                continue
            page = ids[k * P:(k + 1) * P]
            why = ""
            if k and g == chain_hash(None, page):
                why = (" (your hash ignores the parent: chain_hash(None, page) is the same for "
                       "this page after ANY beginning, so two prompts that differ earlier would "
                       "share it. Chain it: chain_hash(hash of page k-1, page))")
            elif k > 1 and g == chain_hash(chain_hash(None, ids[(k - 1) * P:k * P]), page):
                why = (" (your parent is the previous page hashed alone: it must be the previous "
                       "page's chained hash, the one you returned for page k-1, so that a hash "
                       "covers every token before it)")
            raise CheckFailed(f"[{case.name}] hash of page {k} ({fmt_values(page, 8)}) should be {short(e)}, got "
                              f"{short(g)}{why}{where}", case=case.name, label=f"page {k}")

    return run_cases("page_hashes", _hash_cases(seed, n_random), run_one)


# --- hash_match ---------------------------------------------------------------------------


def hash_match_solution(cache, input_ids):
    """(matched full pages, their slots): walk the chain from the first page, stop at a miss."""
    P = cache.page_size
    pages, parent = [], None
    for start in range(0, len(input_ids) - P + 1, P):
        tokens = input_ids[start:start + P]
        parent = chain_hash(parent, tokens)
        page = cache.lookup(parent, tokens)
        if page is None:
            break  # every later hash chains from this one: nothing further can be cached
        pages.append(page)
    slots = [page * P + i for page in pages for i in range(P)]
    return len(pages), slots


def pool_order(num_pages: int, seed: int) -> list[int]:
    """The order a case's free queue starts in: shuffled, never page 0 first."""
    order = random.Random(seed).sample(range(num_pages), num_pages)
    if order[0] == 0 and num_pages > 1:
        order.append(order.pop(0))
    return order


def build_pool(P: int, num_pages: int, script, seed: int = 0) -> tuple[HashPrefixCache, PagePoolRef, list]:
    """The package's cache and the oracle, their free queues in the same shuffled order
    (:func:`pool_order`), after the same ``script`` of ``("alloc", ids)``, ``("free", k)`` (the
    k-th allocation) and ``("orphan", ids)`` (the first page of ``ids``' cached chain is reused
    for other tokens, so the pages after it are cached but unreachable); and the pages of every
    allocation."""
    cache, ref, done = HashPrefixCache(num_pages, P, device="cpu"), PagePoolRef(num_pages, P), []
    order = pool_order(num_pages, seed)
    cache.free_queue, ref.queue = FreeQueue(order), list(order)
    for op, arg in script:
        if op == "alloc":
            done.append(cache.allocate(arg).pages)
            assert tuple(ref.allocate(arg).pages) == done[-1]
        elif op == "free":
            cache.free(done[arg])
            ref.free(done[arg])
        else:  # move the chain's first page to the head of both queues, then hand it out
            page = cache.match(arg).pages[0]
            cache.free_queue.remove(page)
            cache.free_queue.appendleft(page)
            ref.queue.remove(page)
            ref.queue.insert(0, page)
            assert cache.take_free() == ref.take_head() == page
    return cache, ref, done


_A, _B = [1, 2, 3, 4, 5, 6, 7, 8], [3, 4, 1, 2, 9, 9, 9, 9]
_LONG = [(5 * i) % 97 for i in range(130)]  # two full pages of 64, then two tokens


def _match_cases(seed: int, n_random: int) -> list[Case]:
    def case(name, P, script, query, kind="edge", num_pages=12):
        return Case(name, {"P": P, "script": script, "query": query, "pages": num_pages,
                           "seed": sum(name.encode())}, kind)  # each case its own page order

    cases = [case(*args) for args in [
        ("nothing cached", 2, [], [1, 2, 3, 4]),
        ("the whole prompt cached", 2, [("alloc", _A)], _A),
        ("cached pages freed: still findable", 2, [("alloc", _A), ("free", 0)], _A + [0]),
        ("a page cached only after another beginning", 2, [("alloc", _A), ("alloc", _B)], [1, 2, 1, 2, 9, 9]),
        ("the query's second page starts another prompt", 2, [("alloc", _A), ("alloc", _B)], [1, 2, 3, 4, 9, 9]),
        ("query ends in a partial page", 4, [("alloc", _A)], [1, 2, 3, 4, 5, 6]),
        ("stop at the first miss, though later pages are cached", 2,
         [("alloc", _A), ("free", 0), ("orphan", _A)], _A),
        ("page_size 1", 1, [("alloc", [5, 6, 7]), ("alloc", [5, 8])], [5, 8, 7]),
        ("page_size 64: two pages cached, the query leaves inside the second", 64,
         [("alloc", _LONG), ("alloc", _LONG[:64] + [7] * 70)], _LONG[:100] + [0] * 40),
    ]]
    rng = random.Random(seed)
    for i in range(n_random):
        P = rng.choice([1, 2, 4, 8])
        starts = [[rng.randrange(3) for _ in range(3 * P)] for _ in range(2)]
        script, n = [], 0
        for _ in range(rng.randrange(1, 4)):
            script.append(("alloc", rng.choice(starts)[: rng.randrange(1, 3 * P + 1)] + [rng.randrange(3)]))
            if rng.random() < 0.5:
                script.append(("free", n))
            n += 1
        query = rng.choice(starts)[: rng.randrange(0, 3 * P + 1)] + [rng.randrange(3) for _ in range(rng.randrange(3))]
        cases.append(case(f"random {i + 1} (page_size {P})", P, script, query, "random", num_pages=16))
    return cases


@exercise(
    "hash_match",
    chapter="11",
    hints=[
        "Walk the full pages of the prompt from the first: hash each one with its parent, "
        "h = kvlab.chain_hash(parent, tokens), and ask cache.lookup(h, tokens) for its page.",
        "The first page that is not cached ends the match: every later page's hash is chained "
        "from this one, so nothing after it can be a hit for this prompt.",
        "Return (len(pages), [page * P + i for page in pages for i in range(P)]): the number of "
        "matched pages and the KV slots they hold, first page first.",
    ],
    solution=hash_match_solution,
)
def hash_match(fn, *, seed: int = 0, n_random: int = 10) -> int:
    """Check ``fn(cache, input_ids) -> (matched pages, slots)`` on a HashPrefixCache (read only)."""

    def run_one(case: Case) -> None:
        a = case.args
        P = a["P"]
        cache, ref, _ = build_pool(P, a["pages"], a["script"], a["seed"])
        pages = ref.match_pages(a["query"])
        expected = (len(pages), [p * P + i for p in pages for i in range(P)])
        got = call_learner(fn, cache, list(a["query"]), read_only=(0, 1))
        where = (f"\n  page_size {P}; free queue at first {pool_order(a['pages'], a['seed'])}; cached "
                 f"with {shown_script(a['script'])}\n  query {fmt_values(a['query'], 24)}")
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise CheckFailed(f"[{case.name}] return (number of matched pages, their slots), not "
                              f"{got!r}"[:200] + where, case=case.name)
        n, slots = got[0], [int(s) for s in got[1]]
        if n != expected[0]:
            why = ""
            if n > expected[0]:
                why = (" (a page counts only if every page before it matched: its hash is "
                       "chained from theirs. Did you hash a page without its parent, or walk past "
                       "a page that was not cached?)")
            elif n < expected[0]:
                why = (" (a cached page is found by its chained hash: hash each page with the "
                       "hash you computed for the page before it as the parent)")
            raise CheckFailed(f"[{case.name}] matched pages: expected {expected[0]}, got {n}{why}{where}",
                              case=case.name, expected=expected[0], got=n)
        if slots != expected[1]:
            why = ""
            if slots == list(range(len(slots))):
                why = (" (these are the positions 0, 1, 2, ...: a slot is found through the page "
                       "that holds it, page * P + i, and the matched pages here are "
                       f"{pages})")
            raise CheckFailed(f"[{case.name}] slots of the matched pages: expected "
                              f"{fmt_values(expected[1], 24)}, got {fmt_values(slots, 24)} (page p "
                              f"holds slots p*P ... p*P+P-1){why}{where}", case=case.name)

    return run_cases("hash_match", _match_cases(seed, n_random), run_one)
