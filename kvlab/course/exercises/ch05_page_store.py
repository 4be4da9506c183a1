"""Chapter 05's page-store exercise: ``kvlab.check.insert_prefix(fn)``.

The learner inserts into the *page store* of the chapter's build-up: a dict with one entry per
cached page, keyed by the tokens from the start of the prompt to the end of that page, valued
by that page's slots. It returns ``(cached_len, new_entries)``: how many tokens were already
cached, and the entries to add (whole pages only). ``store``, ``input_ids`` and ``indices`` are
read-only. Checked on named edge cases and seeded random ones against
:mod:`kvlab.course.reference.radix_ref`; the slots are those of shuffled pages far from 0, so a slot is
never a token's position by accident.
"""
from __future__ import annotations

import random

from ..reference.radix_ref import PrefixStoreRef, page_aligned_len
from ..checking.core import Case, CheckFailed, call_learner, exercise, run_cases


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
        case("page_size 64: one page cached, one new, a partial third", 64,
             [list(range(64))], list(range(64)) + [3] * 64 + [4] * 10),
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
    order=3,
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
        pages = [100 + p for p in range(sum(-(-len(x) // P) for x in before + [ids]))]
        random.Random(len(pages) * 31 + P).shuffle(pages)  # slots are never positions

        def slots_for(n: int) -> list[int]:
            mine = [pages.pop() for _ in range(-(-n // P))]
            return [mine[i // P] * P + i % P for i in range(n)]

        with_slots = [(seq, slots_for(len(seq))) for seq in before]
        store = page_store_ref(with_slots, P)
        indices = slots_for(len(ids))
        exp_store = page_store_ref(with_slots + [(ids, indices)], P)
        exp_cached = PrefixStoreRef(P)
        for seq in before:
            exp_cached.insert(seq)
        expected_len = exp_cached.match_len(ids[:page_aligned_len(len(ids), P)])
        expected_new = {k: v for k, v in exp_store.items() if k not in store}
        got = call_learner(fn, store, list(ids), list(indices), P, read_only=(0, 1, 2))
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

    return run_cases("insert_prefix", _insert_cases(seed, n_random), run_one)
