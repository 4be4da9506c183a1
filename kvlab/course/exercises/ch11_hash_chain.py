"""Chapter 11's first exercises: ``kvlab.check.page_hashes(fn)`` and ``kvlab.check.hash_match(fn)``.

``page_hashes``: the chained hash of every full page of a prompt, with
:func:`kvlab.chain_hash`: ``h_k = chain_hash(h_{k-1}, page_k)``, ``h_{-1} = None``; a partial
last page has no hash. Returned: a list of those hashes (``bytes``). ``input_ids`` is read-only.

``hash_match``: walk a real :class:`~kvlab.prefix.hash_cache.HashPrefixCache` (read only:
``cache.lookup(h, tokens)``) page by page and return ``(num_pages, slots)``, an int and a list
of ints; the walk stops at the first page that is not cached. The cache and ``input_ids`` are
read-only: every page's count, hash and tokens, ``hash_to_page``, the free queue's order and
``evicted_pages`` are compared after the call (:mod:`kvlab.course.checking.pool_state`), also after hits
on free pages in the middle of the queue (a reference taken and given back would move them).

Page sizes run from 1 to 64, token ids past 255 (a page is not its bytes), and two cases in a
row share a page's tokens after different beginnings (a hash kept from the case before is
wrong). The pools hand out their pages in a shuffled order (page 0 never first), so a page id is
never its prompt's page number, and a slot never its position, by accident. A recognised slip
is named only when it alone gives the answer (:mod:`kvlab.course.checking.slips`).

Expected answers come from :mod:`kvlab.course.reference.hash_chain_ref`, which knows a cached page by the
tuple of all tokens up to its end instead of a hash.
"""
from __future__ import annotations

import random

from ...prefix.hash_cache import HashPrefixCache
from ...prefix.hash_chain import FreeQueue, chain_hash, short
from ..reference.hash_chain_ref import PagePoolRef
from ..checking.answers import expect_int, expect_ints, expect_parts, fail
from ..checking.core import Case, CheckFailed, call_learner, exercise, run_cases
from ..checking.failures import fmt_values
from ..checking.slips import recognised


def random_script(rng: random.Random, free_chance: float) -> tuple[int, list, list[list[int]]]:
    """A random page size, a script of 1-3 allocations (each freed with ``free_chance``) whose
    prompts start like one of two token runs, and those two runs (for the query to follow)."""
    P = rng.choice([1, 2, 4, 8])
    big = rng.choice([0, 254, 70_000])  # token ids past a byte, sometimes
    starts = [[big + rng.randrange(3) for _ in range(3 * P)] for _ in range(2)]
    script, n = [], 0
    for _ in range(rng.randrange(1, 4)):
        script.append(("alloc", rng.choice(starts)[: rng.randrange(1, 3 * P + 1)] + [rng.randrange(3)]))
        if rng.random() < free_chance:
            script.append(("free", n))
        n += 1
    return P, script, starts


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
        case("[3, 4] after [1, 2]", [1, 2, 3, 4], 2),
        case("the same tokens after another first page: [3, 4] after [9, 9]", [9, 9, 3, 4], 2),
        case("a page repeats after other pages", [5, 1, 2, 5, 5, 1], 2),
        case("token ids past 255 (a page is not its bytes)", [300, 7, 1000, 256, 65_535, 2**40], 2),
        case("page_size 64: two full pages and a partial one", [(7 * i) % 101 for i in range(150)], 64),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        P = rng.choice([1, 2, 3, 4, 8])
        base = rng.choice([0, 0, 250, 2**20])
        cases.append(case(f"random {i + 1} (page_size {P})",
                          [base + rng.randrange(6) for _ in range(rng.randrange(0, 14))], P, "random"))
    return cases


def _pages(ids, P) -> list:
    return [ids[s:s + P] for s in range(0, len(ids) - P + 1, P)]


def _reusing(ids, P) -> list:
    """The chain, but a page whose tokens came earlier in the prompt gets that page's hash."""
    out, seen, parent = [], {}, None
    for page in _pages(ids, P):
        parent = seen.setdefault(tuple(page), chain_hash(parent, page))
        out.append(parent)
    return out


def _hash_slips(ids, P) -> dict:
    """What known slips return for this prompt (:func:`kvlab.course.checking.slips.recognised`)."""
    pages = _pages(ids, P)
    return {
        "your hash ignores the parent: chain_hash(None, page) is the same for a page after ANY "
        "beginning, so two prompts that differ earlier would share it. Chain it: "
        "chain_hash(hash of page k-1, page)": lambda: [chain_hash(None, p) for p in pages],
        "your parent is the previous page hashed alone: it must be the previous page's chained "
        "hash, the one you returned for page k-1, so that a hash covers every token before it":
            lambda: [chain_hash(chain_hash(None, pages[k - 1]) if k else None, p)
                     for k, p in enumerate(pages)],
        "a page whose tokens came earlier in the prompt reuses that page's hash: a hash stands "
        "for the page AND everything before it, so equal tokens at another place get another "
        "hash": lambda: _reusing(ids, P),
        "each page is hashed together with every token before it, not chained: use "
        "chain_hash(parent, page) with the previous page's hash as the parent":
            lambda: [chain_hash(None, ids[:(k + 1) * P]) for k in range(len(pages))],
    }


@exercise(
    "page_hashes",
    chapter="11",
    order=1,
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
        if not isinstance(got, list) or not all(isinstance(h, bytes) for h in got):
            what = type(got).__name__ if not isinstance(got, list) else "a list holding " + next(
                type(h).__name__ for h in got if not isinstance(h, bytes))
            raise fail(case.name, "return a list of hashes (the bytes kvlab.chain_hash returns), "
                                  f"got {what}")
        if len(got) != len(expected):
            why = ""
            if len(got) == len(expected) + 1 and len(ids) % P:
                why = (f": the last {len(ids) % P} token(s) are a partial page, which has no hash "
                       "(it is never shared: its other slots belong to nobody yet)")
            raise CheckFailed(f"[{case.name}] {len(expected)} full page(s), so {len(expected)} "
                              f"hash(es); got {len(got)}{why}{where}", case=case.name)
        k = next((k for k, (e, g) in enumerate(zip(expected, got)) if e != g), None)
        if k is None:
            return
        why = recognised(got, _hash_slips(ids, P), lambda a, b: a == b)
        raise CheckFailed(f"[{case.name}] hash of page {k} ({fmt_values(ids[k * P:(k + 1) * P], 8)}) "
                          f"should be {short(expected[k])}, got {short(got[k])}{why}{where}",
                          case=case.name, label=f"page {k}")

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

    mid = [("alloc", _A), ("alloc", [6, 6, 6, 6]), ("free", 0), ("free", 1)]
    cases = [case(*args) for args in [
        ("nothing cached", 2, [], [1, 2, 3, 4]),
        ("the whole prompt cached", 2, [("alloc", _A)], _A),
        ("cached pages freed: still findable", 2, [("alloc", _A), ("free", 0)], _A + [0]),
        ("hits on free pages in the middle of the queue (other pages queued after them)", 2, mid,
         _A[:6] + [0]),
        ("a page cached only after another beginning", 2, [("alloc", _A), ("alloc", _B)], [1, 2, 1, 2, 9, 9]),
        ("the query's second page starts another prompt", 2, [("alloc", _A), ("alloc", _B)], [1, 2, 3, 4, 9, 9]),
        ("[3, 4] cached after [1, 2]", 2, [("alloc", [1, 2, 3, 4])], [1, 2, 3, 4, 0]),
        ("[3, 4] cached after [9, 9] (the case before cached it after [1, 2])", 2,
         [("alloc", [9, 9, 3, 4])], [9, 9, 3, 4, 0]),
        ("query ends in a partial page", 4, [("alloc", _A)], [1, 2, 3, 4, 5, 6]),
        ("stop at the first miss, though later pages are cached", 2,
         [("alloc", _A), ("free", 0), ("orphan", _A)], _A),
        ("page_size 1", 1, [("alloc", [5, 6, 7]), ("alloc", [5, 8])], [5, 8, 7]),
        ("token ids past 255", 2, [("alloc", [256, 1, 300, 7, 1])], [256, 1, 300, 7, 44]),
        ("page_size 64: two pages cached, the query leaves inside the second", 64,
         [("alloc", _LONG), ("alloc", _LONG[:64] + [7] * 70)], _LONG[:100] + [0] * 40),
    ]]
    rng = random.Random(seed)
    for i in range(n_random):
        P, script, starts = random_script(rng, free_chance=0.5)
        query = rng.choice(starts)[: rng.randrange(0, 3 * P + 1)] + [rng.randrange(3) for _ in range(rng.randrange(3))]
        cases.append(case(f"random {i + 1} (page_size {P})", P, script, query, "random", num_pages=16))
    return cases


def _walk(cache, ids, *, parent_of=lambda h: h, go_on=False) -> list[int]:
    """The pages a walk finds: the right one, or a slip's (hashes without the chain, walks past
    a miss)."""
    P, pages, parent = cache.page_size, [], None
    for start in range(0, len(ids) - P + 1, P):
        tokens = ids[start:start + P]
        h = chain_hash(parent, tokens)
        page = cache.lookup(h, tokens)
        if page is None and not go_on:
            break
        if page is not None:
            pages.append(page)
        parent = parent_of(h)
    return pages


def _chained(ids, P: int, k: int):
    """The chained hash of page ``k - 1`` of ``ids`` (None for k == 0): page k's parent."""
    parent = None
    for start in range(0, k * P, P):
        parent = chain_hash(parent, ids[start:start + P])
    return parent


def _match_slips(cache, ids) -> dict:
    P = cache.page_size
    answer = lambda pages: (len(pages), [p * P + i for p in pages for i in range(P)])  # noqa: E731
    right = _walk(cache, ids)
    return {
        "it hashes each page without its parent: hash each page with the hash you computed for "
        "the page before it as the parent": lambda: answer(_walk(cache, ids, parent_of=lambda h: None)),
        "it walks past a page that was not cached: a page counts only if every page before it "
        "matched (its hash is chained from theirs), so the first miss ends the walk":
            lambda: answer(_walk(cache, ids, go_on=True)),
        "these are the positions 0, 1, 2, ...: a slot is found through the page that holds it, "
        f"page * P + i, and the matched pages here are {right}":
            lambda: (len(right), list(range(len(right) * P))),
        "these are the page ids: page p holds slots p*P ... p*P+P-1": lambda: (len(right), list(right)),
    }


@exercise(
    "hash_match",
    chapter="11",
    order=2,
    hints=[
        "Walk the full pages of the prompt from the first: hash each one with its parent, "
        "h = kvlab.chain_hash(parent, tokens), and ask cache.lookup(h, tokens) for its page.",
        "The first page that is not cached ends the match: every later page's hash is chained "
        "from this one, so nothing after it can be a hit for this prompt.",
        "Return (len(pages), [page * P + i for page in pages for i in range(P)]): the number of "
        "matched pages (an int) and the KV slots they hold (a list of ints), first page first.",
    ],
    solution=hash_match_solution,
)
def hash_match(fn, *, seed: int = 0, n_random: int = 10) -> int:
    """Check ``fn(cache, input_ids) -> (num_pages, slots)`` on a HashPrefixCache (read only)."""

    def run_one(case: Case) -> None:
        a = case.args
        P = a["P"]
        cache, ref, _ = build_pool(P, a["pages"], a["script"], a["seed"])
        pages = ref.match_pages(a["query"])
        expected = (len(pages), [p * P + i for p in pages for i in range(P)])
        got = call_learner(fn, cache, list(a["query"]), read_only=(0, 1))
        where = (f"\n  page_size {P}; free queue at first {pool_order(a['pages'], a['seed'])}; cached "
                 f"with {shown_script(a['script'])}\n  query {fmt_values(a['query'], 24)}")
        n, slots = expect_parts(case.name, got, ("num_pages", "slots"))
        expect_int(case.name, "num_pages", n)
        slots = expect_ints(case.name, "slots", slots, meaning="page * P + i")
        if (n, slots) == expected:
            return
        twin, _, _ = build_pool(P, a["pages"], a["script"], a["seed"])
        early = [lambda j=j: (j, expected[1][:j * P]) for j in range(expected[0])]  # any wrong hash
        why = recognised((n, slots), _match_slips(twin, list(a["query"])), lambda x, y: x == y, early)
        if 0 <= n < expected[0]:
            tokens = list(a["query"][n * P:(n + 1) * P])
            why += (f"\n  page {n} ({fmt_values(tokens, 8)}) is cached, as page {pages[n]}: "
                    f"cache.lookup(h, tokens) finds it with h the chained hash of every token up to "
                    f"its end, {short(chain_hash(_chained(a['query'], P, n), tokens))}")
        if n != expected[0]:
            raise CheckFailed(f"[{case.name}] matched pages: expected {expected[0]}, got {n}{why}{where}",
                              case=case.name, expected=expected[0], got=n)
        raise CheckFailed(f"[{case.name}] slots of the matched pages: expected "
                          f"{fmt_values(expected[1], 24)}, got {fmt_values(slots, 24)} (page p "
                          f"holds slots p*P ... p*P+P-1){why}{where}", case=case.name)

    return run_cases("hash_match", _match_cases(seed, n_random), run_one)
