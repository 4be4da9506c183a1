"""Chapter 05's exercises: ``kvlab.check.match_prefix(fn)``, ``kvlab.check.match_req(fn)`` and
``kvlab.check.insert_prefix(fn)``.

``match_prefix``: the learner walks a real :class:`~kvlab.radix_cache.RadixPrefixCache`
(read only: ``cache.root``, ``node.children`` keyed by a node's first page of tokens,
``node.key``) and returns the page-aligned matched length of ``input_ids``.

``match_req``: the learner matches a request's prompt the way ``CacheManager.match_req``
does: ``prefix_cache.match_prefix(input_ids[:len(input_ids) - 1])``. The last prompt token
is never taken from the cache, so the prefill always computes at least one position and
gets the logits of the next token from it.

``insert_prefix``: the learner inserts into the *page store* of the chapter's build-up: a
dict with one entry per cached page, keyed by the tokens from the start of the prompt to
the end of that page, valued by that page's slots. It returns ``(cached_len, new_entries)``:
how many tokens were already cached, and the entries to add (whole pages only).

Both are checked on named edge cases and seeded random ones against
:mod:`kvlab.reference.radix`.
"""
from __future__ import annotations

import random

import torch

from ..radix_cache import RadixPrefixCache
from ..reference.radix import PrefixStoreRef, page_aligned_len
from .core import Case, CheckFailed, call_learner, exercise, run_cases


# --- match_prefix -------------------------------------------------------------------------


def match_prefix_solution(cache: RadixPrefixCache, input_ids: list[int]) -> int:
    """Length of the longest cached prefix of ``input_ids``, in whole pages."""
    P = cache.page_size
    node, matched = cache.root, 0
    while len(input_ids) - matched >= P:
        child = node.children.get(tuple(input_ids[matched:matched + P]))  # first page finds the child
        if child is None:
            break
        n = 0
        while n < child.length and matched + n < len(input_ids) and child.key[n] == input_ids[matched + n]:
            n += 1
        n = n // P * P  # a partly matched page does not count
        matched += n
        if n < child.length:  # the prompt leaves this node part-way: stop here
            break
        node = child
    return matched


def _build_cache(page_size: int, sequences: list[list[int]]) -> RadixPrefixCache:
    cache = RadixPrefixCache(page_size, device="cpu")
    next_slot = 0
    for seq in sequences:
        n = len(seq)
        cache.insert_prefix(seq, torch.arange(next_slot, next_slot + n, dtype=torch.int32))
        next_slot += -(-n // page_size) * page_size
    return cache


def _tree_state(cache: RadixPrefixCache):
    return [(n.uid, n.key, n.ref_count) for n in cache.nodes()]


def _match_cases(seed: int, n_random: int) -> list[Case]:
    base = [1, 2, 3, 4, 5, 6, 7, 8]
    cases = [
        Case("empty cache", {"P": 2, "cached": [], "query": [1, 2, 3]}),
        Case("whole prompt cached (page_size 2)", {"P": 2, "cached": [base], "query": base}),
        Case("match ends inside a page: round down", {"P": 4, "cached": [base], "query": [1, 2, 3, 4, 5, 6, 0, 0]}),
        Case("query shorter than one page", {"P": 4, "cached": [base], "query": [1, 2, 3]}),
        Case("first page differs", {"P": 2, "cached": [base], "query": [1, 9, 3, 4]}),
        Case("page_size 1", {"P": 1, "cached": [[5, 6, 7], [5, 8]], "query": [5, 6, 9]}),
        Case("two branches, take the right one", {"P": 2, "cached": [[1, 2, 3, 4], [1, 2, 5, 6, 7, 8]],
                                                  "query": [1, 2, 5, 6, 7, 8, 9]}),
        Case("walk through several nodes", {"P": 2, "cached": [[1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]],
                                            "query": [1, 2, 3, 4, 5, 6, 7, 8]}),
        Case("query ends in the middle of a node", {"P": 2, "cached": [base], "query": [1, 2, 3, 4, 5]}),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        P = rng.choice([1, 2, 4])
        cached = [[rng.randrange(3) for _ in range(rng.randrange(0, 14))] for _ in range(rng.randrange(1, 5))]
        query = [rng.randrange(3) for _ in range(rng.randrange(0, 14))]
        cases.append(Case(f"random {i + 1} (page_size {P})", {"P": P, "cached": cached, "query": query},
                          "random"))
    return cases


@exercise(
    "match_prefix",
    chapter="05",
    hints=[
        "Start at cache.root with matched = 0. A child is found by the next whole page of the "
        "prompt: node.children.get(tuple(input_ids[matched:matched + P])). Fewer than P tokens "
        "left, or no such child: you are done.",
        "Inside a child, count how many of its key tokens equal the prompt's next tokens, then "
        "round that down to whole pages (n // P * P): a partly matched page is not cached for you.",
        "Add the rounded count to matched. If it is shorter than the child's key, the prompt "
        "leaves the tree inside this node: stop. Otherwise go down into the child and repeat.",
    ],
    solution=match_prefix_solution,
)
def match_prefix(fn, *, seed: int = 0, n_random: int = 12) -> int:
    """Check ``fn(cache, input_ids) -> int`` (page-aligned matched length; the tree unchanged)."""

    def run_one(case: Case) -> None:
        P, cached, query = case.args["P"], case.args["cached"], case.args["query"]
        cache = _build_cache(P, cached)
        ref = PrefixStoreRef(P)
        for seq in cached:
            ref.insert(seq)
        expected = ref.match_len(query)
        before = _tree_state(cache)
        got = call_learner(fn, cache, list(query))
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = int(got)
        if not isinstance(got, int) or isinstance(got, bool):
            raise CheckFailed(f"[{case.name}] return the matched length as an int, not "
                              f"{type(got).__name__}", case=case.name)
        if got != expected:
            why = ""
            if got % P:
                why = f" ({got} is not a whole number of pages of {P}: round down)"
            elif got > expected:
                why = " (you counted tokens the cache does not hold for this prompt)"
            raise CheckFailed(
                f"[{case.name}] matched length: expected {expected}, got {got}{why}\n"
                f"  page_size {P}; cached prompts: {cached}\n  query: {query}",
                case=case.name, expected=expected, got=got)
        if _tree_state(cache) != before:
            raise CheckFailed(f"[{case.name}] your function changed the tree; matching only reads it",
                              case=case.name)

    return run_cases("match_prefix", _match_cases(seed, n_random), run_one)


# --- match_req: match the prompt without its last token --------------------------------------


def match_req_solution(prefix_cache: RadixPrefixCache, input_ids: list[int]):
    """Match all but the last prompt token: the prefill must compute at least that one."""
    return prefix_cache.match_prefix(input_ids[: len(input_ids) - 1])


def _matched_len(got, case: str) -> int:
    """The learner may return a MatchResult, a handle (both have ``cached_len``) or an int."""
    if hasattr(got, "cached_len"):
        got = got.cached_len
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = int(got)
    if not isinstance(got, int) or isinstance(got, bool):
        raise CheckFailed(f"[{case}] return prefix_cache.match_prefix(...)'s MatchResult (or the "
                          f"matched length as an int), not {type(got).__name__}", case=case)
    return got


def _match_req_cases(seed: int, n_random: int) -> list[Case]:
    sixteen = list(range(1, 17))
    cases = [
        Case("whole prompt cached (page_size 4)", {"P": 4, "cached": [sixteen], "prompt": sixteen}),
        Case("page_size 1: whole prompt cached", {"P": 1, "cached": [[5, 6, 7, 8]], "prompt": [5, 6, 7, 8]}),
        Case("one-token prompt", {"P": 1, "cached": [[5, 6]], "prompt": [5]}),
        Case("prompt one page longer than the cache", {"P": 4, "cached": [sixteen[:8]], "prompt": sixteen[:12]}),
        Case("cached prompt ends inside a page", {"P": 4, "cached": [sixteen], "prompt": sixteen[:14]}),
        Case("nothing cached", {"P": 2, "cached": [], "prompt": [1, 2, 3, 4]}),
        Case("page_size 1, two branches", {"P": 1, "cached": [[5, 6, 7], [5, 8, 9]], "prompt": [5, 8, 9]}),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        P = rng.choice([1, 2, 4])
        cached = [[rng.randrange(3) for _ in range(rng.randrange(0, 14))] for _ in range(rng.randrange(1, 5))]
        if rng.random() < 0.5:  # often a prompt that is (nearly) all cached: where the last token matters
            prompt = list(rng.choice(cached))[: rng.randrange(1, 15)] or [rng.randrange(3)]
        else:
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
        cases.append(Case(f"random {i + 1} (page_size {P})", {"P": P, "cached": cached, "prompt": prompt},
                          "random"))
    return cases


@exercise(
    "match_req",
    chapter="05",
    hints=[
        "The prefill must produce the logits of the next token, and those come out of the model "
        "at the last prompt position: that position must be computed, so it cannot come from the cache.",
        "Match every token except the last one: input_ids[:len(input_ids) - 1]. The cache rounds "
        "the match down to whole pages itself.",
        "return prefix_cache.match_prefix(input_ids[:len(input_ids) - 1]) (a one-token prompt "
        "matches an empty list: nothing).",
    ],
    solution=match_req_solution,
)
def match_req(fn, *, seed: int = 0, n_random: int = 12) -> int:
    """Check ``fn(prefix_cache, input_ids) -> MatchResult`` (or the matched length) of a new request."""

    def run_one(case: Case) -> None:
        P, cached, prompt = case.args["P"], case.args["cached"], case.args["prompt"]
        cache = _build_cache(P, cached)
        ref = PrefixStoreRef(P)
        for seq in cached:
            ref.insert(seq)
        expected = ref.match_len(prompt[: len(prompt) - 1])
        whole = ref.match_len(prompt)
        got = _matched_len(call_learner(fn, cache, list(prompt)), case.name)
        if got == expected:
            return
        if got > expected and got == whole:
            why = (f": the prompt's last token must be recomputed so the prefill produces logits "
                   f"(match input_ids[:len(input_ids) - 1], not all {len(prompt)} tokens)")
        elif got > expected:
            why = " (more than the cache holds for the prompt without its last token)"
        elif got % P:
            why = f" ({got} is not a whole number of pages of {P}: the cache matches whole pages)"
        else:
            why = (" (you dropped more than the last token: only input_ids[-1] must be left "
                   "for the prefill)")
        raise CheckFailed(
            f"[{case.name}] matched {got} tokens; expected {expected}{why}\n"
            f"  page_size {P}; cached prompts: {cached}\n  prompt ({len(prompt)} tokens): {prompt}",
            case=case.name, expected=expected, got=got)

    return run_cases("match_req", _match_req_cases(seed, n_random), run_one)


# --- insert_prefix on the page store ------------------------------------------------------


def insert_prefix_solution(store: dict, input_ids: list[int], indices: list[int], page_size: int):
    """Insert the whole pages of ``input_ids`` into the page store (without changing it).

    ``store`` maps ``tuple(prefix up to the end of a page) -> that page's slots``. Returns
    ``(cached_len, new_entries)``: tokens already cached from the start, and the entries to add.
    """
    P = page_size
    insert_len = len(input_ids) // P * P  # only whole pages are cached
    cached_len = 0
    while cached_len < insert_len and tuple(input_ids[:cached_len + P]) in store:
        cached_len += P  # this page is already there: our copy is a duplicate
    new_entries = {}
    for start in range(cached_len, insert_len, P):
        new_entries[tuple(input_ids[:start + P])] = list(indices[start:start + P])
    return cached_len, new_entries


def page_store_ref(sequences_with_slots, page_size: int) -> dict:
    """The page store after inserting each ``(ids, slots)`` in order (first insert wins)."""
    store: dict = {}
    for ids, slots in sequences_with_slots:
        for start in range(0, page_aligned_len(len(ids), page_size), page_size):
            store.setdefault(tuple(ids[:start + page_size]), list(slots[start:start + page_size]))
    return store


def _insert_cases(seed: int, n_random: int) -> list[Case]:
    def case(name, P, before, ids, kind="edge"):
        return Case(name, {"P": P, "before": before, "ids": ids}, kind)

    cases = [
        case("empty store, two whole pages", 4, [], [1, 2, 3, 4, 5, 6, 7, 8]),
        case("partial last page is not inserted", 4, [], [1, 2, 3, 4, 5, 6]),
        case("shorter than a page: nothing to insert", 4, [], [1, 2, 3]),
        case("everything already cached", 2, [[1, 2, 3, 4]], [1, 2, 3, 4]),
        case("first page cached, second new", 2, [[1, 2, 3, 4]], [1, 2, 7, 8, 9]),
        case("same page tokens after a different first page", 2, [[1, 2, 3, 4]], [9, 9, 3, 4]),
        case("page_size 1", 1, [[5, 6]], [5, 6, 7]),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        P = rng.choice([1, 2, 4])
        before = [[rng.randrange(3) for _ in range(rng.randrange(0, 12))] for _ in range(rng.randrange(0, 4))]
        ids = [rng.randrange(3) for _ in range(rng.randrange(0, 14))]
        cases.append(case(f"random {i + 1} (page_size {P})", P, before, ids, "random"))
    return cases


@exercise(
    "insert_prefix",
    chapter="05",
    hints=[
        "Only whole pages are cached: insert_len = len(input_ids) // page_size * page_size.",
        "Walk page by page from the start: while the prefix up to the end of the next page, "
        "tuple(input_ids[:cached_len + P]), is a key of the store, that page is already cached "
        "(cached_len += P). Stop at the first page that is not.",
        "Every page from cached_len to insert_len is new: its key is the prefix up to the end of "
        "that page, its value the slots indices[start:start + P]. Return (cached_len, new_entries) "
        "and leave the store itself unchanged.",
    ],
    solution=insert_prefix_solution,
)
def insert_prefix(fn, *, seed: int = 0, n_random: int = 12) -> int:
    """Check ``fn(store, input_ids, indices, page_size) -> (cached_len, new_entries)``."""

    def run_one(case: Case) -> None:
        P, before, ids = case.args["P"], case.args["before"], case.args["ids"]
        with_slots, next_slot = [], 0
        for seq in before:
            with_slots.append((seq, list(range(next_slot, next_slot + len(seq)))))
            next_slot += -(-len(seq) // P) * P
        store = page_store_ref(with_slots, P)
        indices = list(range(next_slot, next_slot + len(ids)))
        exp_store = page_store_ref(with_slots + [(ids, indices)], P)
        exp_cached = PrefixStoreRef(P)
        for seq in before:
            exp_cached.insert(seq)
        expected_len = exp_cached.match_len(ids[:page_aligned_len(len(ids), P)])
        expected_new = {k: v for k, v in exp_store.items() if k not in store}
        snapshot = {k: list(v) for k, v in store.items()}
        got = call_learner(fn, store, list(ids), list(indices), P)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise CheckFailed(f"[{case.name}] return a pair (cached_len, new_entries), got {got!r}",
                              case=case.name)
        got_len, got_new = got
        if got_len != expected_len:
            raise CheckFailed(
                f"[{case.name}] cached_len: expected {expected_len}, got {got_len}\n"
                f"  page_size {P}; cached before: {before}; inserting {ids}", case=case.name,
                expected=expected_len, got=got_len)
        got_new = {tuple(k): [int(s) for s in v] for k, v in dict(got_new).items()}
        missing = [k for k in expected_new if k not in got_new]
        extra = [k for k in got_new if k not in expected_new]
        if missing or extra:
            what = (f"missing the page ending at position {len(missing[0])}: key {list(missing[0])}"
                    if missing else f"an entry that should not be added: key {list(extra[0])}"
                    + (" (already cached)" if extra[0] in store else
                       " (not a whole page of the prompt)"))
            raise CheckFailed(f"[{case.name}] new_entries: {what}\n  page_size {P}; inserting {ids}",
                              case=case.name)
        for k, v in expected_new.items():
            if got_new[k] != v:
                raise CheckFailed(f"[{case.name}] new_entries[{list(k)}]: expected slots {v}, got "
                                  f"{got_new[k]} (the page's slots are indices[start:start + P])",
                                  case=case.name)
        if store != snapshot:
            raise CheckFailed(f"[{case.name}] leave the store unchanged; return the new entries",
                              case=case.name)

    return run_cases("insert_prefix", _insert_cases(seed, n_random), run_one)
