"""Chapter 05's exercises: ``kvlab.check.match_prefix(fn)`` and ``kvlab.check.match_req(fn)``
(``insert_prefix`` is in :mod:`kvlab.course.exercises.ch05_page_store`).

``match_prefix``: the learner walks a real :class:`~kvlab.prefix.radix_cache.RadixPrefixCache`
(read only: ``cache.root``, ``node.children`` keyed by a node's first page of tokens,
``node.key``) and returns the page-aligned matched length of ``input_ids``. The tree must be
left exactly as it was, LRU stamps and the clock included (a walk that stamps or splits is
named), and so must ``input_ids``.

``match_req``: the learner matches a request's prompt the way ``CacheManager.match_req``
does: ``prefix_cache.match_prefix(input_ids[:len(input_ids) - 1])``. The last prompt token
is never taken from the cache, so the prefill always computes at least one position and
gets the logits of the next token from it. ``input_ids`` is read-only, and the tree must be left
as that one call leaves it (a second match, or a match of the whole prompt first, stamps and
splits it differently).

Both are checked on named edge cases and seeded random ones against
:mod:`kvlab.course.reference.radix_ref`.
"""
from __future__ import annotations

import random

import torch

from ...prefix.radix_cache import RadixPrefixCache
from ..reference.radix_ref import PrefixStoreRef
from ..checking.core import Case, CheckFailed, call_learner, exercise, run_cases
from ..checking.inputs import tree_difference, tree_state


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


#: a tree where a node ([1, 2, 3, 4]) has children whose first pages also occur inside it
#:     root -- [1,2,3,4] --+-- [5,6]
#:                         +-- [7,8]
#:                         +-- [3,9,9,9]
_FORK = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [1, 2, 3, 4, 3, 9, 9, 9]]


def _match_cases(seed: int, n_random: int) -> list[Case]:
    base = [1, 2, 3, 4, 5, 6, 7, 8]

    def case(name, P, cached, query):
        return Case(name, {"P": P, "cached": cached, "query": query})

    cases = [
        case("empty cache", 2, [], [1, 2, 3]),
        case("whole prompt cached (page_size 2)", 2, [base], base),
        case("match ends inside a page: round down", 4, [base], [1, 2, 3, 4, 5, 6, 0, 0]),
        case("query shorter than one page", 4, [base], [1, 2, 3]),
        case("first page differs", 2, [base], [1, 9, 3, 4]),
        case("page_size 1", 1, [[5, 6, 7], [5, 8]], [5, 6, 9]),
        case("two branches, take the right one", 2, [[1, 2, 3, 4], [1, 2, 5, 6, 7, 8]],
             [1, 2, 5, 6, 7, 8, 9]),
        case("walk through several nodes", 2, [[1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]],
             [1, 2, 3, 4, 5, 6, 7, 8]),
        case("query ends in the middle of a node", 2, [base], [1, 2, 3, 4, 5]),
        # every way a walk leaves a node: at its end, or inside it (out of prompt, or diverging
        # on a page boundary or inside a page) - and a node's child must not be taken after
        # the prompt has left the node part-way
        case("leaves a node at its end: no child for the next page", 2, _FORK, [1, 2, 3, 4, 9, 9]),
        case("leaves a node at its end, then part-way into a child", 2, _FORK, [1, 2, 3, 4, 5, 0]),
        case("prompt runs out at a page boundary inside a node", 2, _FORK, [1, 2]),
        case("diverges on a page boundary inside a node, where a child's first page follows: stop",
             2, _FORK, [1, 2, 5, 6, 7, 8]),
        case("diverges inside a page of a node, where a child's first page follows: stop",
             2, _FORK, [1, 2, 3, 9, 9, 9]),
        case("page_size 1: diverges inside a node, where a child's first token follows: stop",
             1, [[1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 5]], [1, 2, 4, 4]),
        case("page_size 4: diverges inside a node, where a child's first page follows: stop",
             4, [list(range(1, 13)) + [20, 21, 22, 23], list(range(1, 13)) + [9, 10, 11, 12]],
             [1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12]),
        case("page_size 64: two pages cached, the prompt leaves inside the second", 64,
             [list(range(128)), list(range(64)) + [7] * 64], list(range(100)) + [0] * 40),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        P = rng.choice([1, 2, 4])
        cached = [[rng.randrange(3) for _ in range(rng.randrange(0, 14))] for _ in range(rng.randrange(1, 5))]
        query = [rng.randrange(3) for _ in range(rng.randrange(0, 14))]
        if i % 2 and any(cached):  # a cached prompt cut short, then a page copied from another
            donor, other = rng.choice([c for c in cached if c]), rng.choice(cached)
            at = rng.randrange(len(donor) + 1)
            start = rng.randrange(max(1, len(other) - P + 1))
            query = donor[:at] + other[start:start + P] + query[: rng.randrange(4)]
        cases.append(Case(f"random {i + 1} (page_size {P})", {"P": P, "cached": cached, "query": query},
                          "random"))
    return cases


def _left_part_way(cache: RadixPrefixCache, query: list[int]) -> str | None:
    """Explain a match that went on after the prompt left a node part-way, if it did."""
    P = cache.page_size
    node, matched = cache.root, 0
    while len(query) - matched >= P:
        child = node.children.get(tuple(query[matched:matched + P]))
        if child is None:
            return None
        n = 0
        while n < child.length and matched + n < len(query) and child.key[n] == query[matched + n]:
            n += 1
        if n < child.length:
            at = matched + n // P * P
            nxt = tuple(query[at:at + P])
            if len(nxt) < P or nxt not in child.children:
                return None
            return (f" (the prompt leaves the node with key {list(child.key)} after {n} of its "
                    f"{child.length} tokens, at position {matched + n}: the match stops there, "
                    f"at {at}. The prompt's next page {list(nxt)} is also the first page of a "
                    "child of that node, but a child continues the node's whole key, not the "
                    "part the prompt matched)")
        matched += n
        node = child
    return None


@exercise(
    "match_prefix",
    chapter="05",
    order=1,
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
        got = call_learner(fn, cache, list(query), read_only=(0, 1))
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
                why = (_left_part_way(cache, query) or
                       " (you counted tokens the cache does not hold for this prompt)")
            raise CheckFailed(
                f"[{case.name}] matched length: expected {expected}, got {got}{why}\n"
                f"  page_size {P}; cached prompts: {cached}\n  query: {query}",
                case=case.name, expected=expected, got=got)

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
        Case("page_size 64: a prompt of exactly two cached pages",
             {"P": 64, "cached": [list(range(192))], "prompt": list(range(128))}),
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
    order=2,
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
        twin = _build_cache(P, cached)  # the tree as the one right call leaves it
        match_req_solution(twin, prompt)
        untouched = tree_state(_build_cache(P, cached))
        answer = call_learner(fn, cache, list(prompt), read_only=(1,))
        got = _matched_len(answer, case.name)
        if got == expected:
            left = tree_state(cache)
            why = tree_difference(tree_state(twin), left, old="should be", new="is")
            if why and not (isinstance(answer, int) and left == untouched):
                raise CheckFailed(
                    f"[{case.name}] the matched length is right, but the tree is not as one "
                    f"prefix_cache.match_prefix(input_ids[:len(input_ids) - 1]) leaves it: {why}\n"
                    "  every match stamps the nodes it uses and may split one: match once\n"
                    f"  page_size {P}; cached prompts: {cached}\n  prompt: {prompt}",
                    case=case.name)
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
