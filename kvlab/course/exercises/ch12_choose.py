"""Chapter 12's first exercises: ``kvlab.check.victim_order(fn)`` and ``kvlab.check.next_token_ratio(fn)``.

``victim_order``: ``fn(policy, running) -> keys``, the running requests (a list of
:class:`kvlab.serving.pressure.RequestView`, read-only) in the order ``policy`` stops them:
``"recompute"`` the latest admitted first (vLLM v1's ``self.running.pop()``); ``"swap"`` the
latest arrival first (vLLM v0 pops its FCFS-sorted running queue); ``"retract"`` the fewest
generated tokens first, among those the longest prompt, and of two that tie exactly the later
one in ``running`` (SGLang sorts ``(len(output_ids), -len(origin_input_ids))`` in reverse and
pops from the end). ``running`` is never in admission order, so its order proves nothing; the
caps (``max_new``) differ, so ranking by progress (``generated / max_new``) or by what is left
is not ranking by outputs; and every case is called twice, the second time with the same
numbers under other keys (another batch of requests), so an answer kept from call to call shows.

``next_token_ratio``: ``fn(policy, ratio, retracted, remaining) -> float``, SGLang's ratio after
one decode step: ``max(ratio - policy.decay, policy.min_ratio)`` when nothing was retracted,
else ``min(1, (sum of generated + policy.retract_decode_steps * n) / sum of max_new)`` over the
``n`` requests still running (``policy.init_ratio`` when none is left). The checker runs
scripts of steps with SGLang's constants and with others, and compares every step; in one case
two runs of one policy take turns, so a ratio kept between calls instead of read from ``ratio``
shows.

Expected answers come from :mod:`kvlab.serving.pressure`.
"""
from __future__ import annotations

import random

from ...serving.pressure import RequestView, RetractDecode, next_token_ratio as pressure_ratio, victim_order as pressure_order
from ..checking.core import Case, CheckFailed, call_learner, exercise, run_cases

RULES = {"recompute": "vLLM preempts the latest admitted first (the highest `admitted`)",
         "swap": "vLLM v0 swaps out the latest arrival first (the highest `arrived`)",
         "retract": "SGLang retracts the fewest generated tokens first; of equal outputs the longest "
                    "prompt; of an exact tie, the later one in `running`"}


def victim_order_solution(policy, running):
    """The keys of the running requests, in the order ``policy`` stops them."""
    if policy == "recompute":    # vLLM v1: self.running.pop() -- the latest admitted goes first
        order = sorted(running, key=lambda r: r.admitted, reverse=True)
    elif policy == "swap":       # vLLM v0: FCFS-sorted running_queue.pop() -- the latest arrival
        order = sorted(running, key=lambda r: r.arrived, reverse=True)
    else:                        # SGLang retract_decode: sort (outputs, -prompt) in reverse, pop()
        ranked = sorted(running, key=lambda r: (r.generated, -r.prompt_len), reverse=True)
        order = ranked[::-1]     # pop() takes from the end: fewest outputs, longest prompt first
    return [r.key for r in order]


#: caps the views take in turn: no two neighbours share one, so ranking by progress
#: (generated / max_new) or by what is left (max_new - generated) is not ranking by outputs
CAPS = (64, 16, 256, 8, 32, 128)


def _views(rows) -> list[RequestView]:
    """``(key, prompt_len, generated, admitted, arrived[, max_new])`` -> views (positions from
    the lengths; the cap from :data:`CAPS` when not given, never below what was generated)."""
    out = []
    for i, (k, n, g, a, t, *cap) in enumerate(rows):
        max_new = cap[0] if cap else max(CAPS[i % len(CAPS)], g + 1)
        out.append(RequestView(k, n, g, max_new, n + g, (n + g + 3) // 4, a, t))
    return out


def _renamed(views: list[RequestView], offset: int = 1000) -> list[RequestView]:
    """The same requests, numbers and order under other keys (another batch of requests)."""
    return [v._replace(key=v.key + offset) for v in views]


def _order_cases(seed: int, n_random: int) -> list[Case]:
    def case(name, policy, rows, kind="edge"):
        return Case(name, {"policy": policy, "running": _views(rows)}, kind)

    cases = [
        case("one request", "recompute", [(7, 10, 3, 0, 0)]),
        case("recompute: the latest admitted, not the last in the list", "recompute",
             [(4, 9, 2, 2, 1), (1, 20, 9, 3, 3), (6, 5, 5, 0, 0), (2, 7, 1, 1, 2)]),
        case("swap: the latest arrival, not the latest admitted", "swap",
             [(3, 12, 4, 3, 0), (5, 8, 1, 0, 2), (8, 6, 2, 1, 1), (9, 14, 3, 2, 3)]),
        case("retract: the fewest outputs first", "retract",
             [(1, 10, 7, 0, 0), (2, 10, 1, 1, 1), (3, 10, 4, 2, 2)]),
        case("retract: equal outputs: the longer prompt first", "retract",
             [(5, 6, 2, 0, 0), (6, 30, 2, 1, 1), (7, 12, 2, 2, 2), (8, 9, 5, 3, 3)]),
        case("retract: an exact tie: the later one in running first", "retract",
             [(4, 8, 3, 2, 0), (9, 8, 3, 0, 1), (2, 16, 1, 1, 2)]),
        case("retract: not the longest output, not the shortest prompt", "retract",
             [(0, 40, 9, 0, 0), (1, 3, 0, 1, 1), (2, 25, 0, 2, 2), (3, 3, 9, 3, 3)]),
        # the caps differ: by outputs is neither by progress (generated / max_new) nor by what is left
        case("retract: by outputs, not by progress or by what is left to generate", "retract",
             [(3, 10, 6, 0, 0, 128), (5, 10, 2, 1, 1, 4), (7, 10, 4, 2, 2, 512), (1, 10, 1, 3, 3, 2)]),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        n = rng.randint(1, 8)
        admitted, arrived = rng.sample(range(20), n), rng.sample(range(20), n)
        keys = rng.sample(range(100), n)
        rows = [(keys[j], rng.randint(1, 12), rng.randint(0, 6), admitted[j], arrived[j], rng.choice(CAPS))
                for j in range(n)]
        policy = ("recompute", "retract", "swap")[i % 3]
        cases.append(case(f"random {i + 1} ({policy}, {n} requests)", policy, rows, "random"))
    return cases


def _describe(r: RequestView) -> str:
    return (f"request {r.key} (admitted {r.admitted}, arrived {r.arrived}, generated {r.generated} "
            f"of at most {r.max_new}, prompt {r.prompt_len})")


def _order_why(policy: str, running: list[RequestView], got: list) -> str:
    """What order ``got`` follows, when it is one the rule is often taken for."""
    by = {r.key: r for r in running}
    if policy != "retract" or not all(k in by for k in got):
        return ""
    mistaken = {"progress, the smallest share generated / max_new first":
                lambda r: (r.generated / r.max_new, -r.prompt_len),
                "the most tokens still to generate (max_new - generated) first":
                lambda r: (r.generated - r.max_new, -r.prompt_len)}
    for what, key in mistaken.items():
        if got == [r.key for r in sorted(running, key=key)]:
            return (f" (your order ranks by {what}: SGLang's retract_decode sorts by len(output_ids), "
                    "the tokens generated, whatever the cap)")
    return ""


def _second_call(fn, case: Case, policy: str, running: list[RequestView], first: list) -> None:
    """The same numbers under other keys (another batch): the answer must follow the keys."""
    others = _renamed(running)
    expected = pressure_order(policy, others)
    got = call_learner(fn, policy, list(others), read_only=(1,))
    if isinstance(got, (list, tuple)) and list(got) == expected:
        return
    same = isinstance(got, (list, tuple)) and list(got) == first
    why = (" -- it returned the keys of the call before: an answer kept from call to call (a cache "
           "keyed on the numbers, a global) answers for requests that are gone. Rank this call's "
           "`running` and return its keys" if same else "")
    raise CheckFailed(
        f"[{case.name}] called again with the same numbers under other keys (each key + 1000: another "
        f"batch of requests), policy {policy!r}: the order should be {expected}, got {got!r}{why}",
        case=case.name, expected=expected, got=got, label="second call")


@exercise(
    "victim_order",
    chapter="12",
    hints=[
        "Each policy ranks by one field of RequestView: recompute by `admitted`, swap by `arrived`, "
        "retract by (`generated`, `prompt_len`). Return the keys, first to go first.",
        "recompute and swap: the highest value goes first: sorted(running, key=..., reverse=True). "
        "Never rely on the order of `running`: it is not the admission order.",
        "retract: SGLang sorts key=(generated, -prompt_len) with reverse=True and pops from the END: "
        "reverse that sorted list. Python's sort keeps ties in order, so the later of two exact ties "
        "comes out first.",
    ],
    solution=victim_order_solution,
)
def victim_order(fn, *, seed: int = 0, n_random: int = 9) -> int:
    """Check ``fn(policy, running) -> list of keys`` (who is stopped first)."""

    def run_one(case: Case) -> None:
        policy, running = case.args["policy"], case.args["running"]
        expected = pressure_order(policy, running)
        got = call_learner(fn, policy, list(running), read_only=(1,))
        where = "\n  running:\n" + "\n".join(f"    {_describe(r)}" for r in running)
        if not isinstance(got, (list, tuple)) or sorted(map(repr, got)) != sorted(map(repr, expected)):
            raise CheckFailed(f"[{case.name}] return the key of every running request, each once "
                              f"(keys {sorted(r.key for r in running)}); got {got!r}{where}", case=case.name)
        got = list(got)
        if got == expected:
            _second_call(fn, case, policy, running, got)
            return
        i = next(j for j, (e, g) in enumerate(zip(expected, got)) if e != g)
        by = {r.key: r for r in running}
        why = _order_why(policy, running, got)
        if got == expected[::-1]:
            why = " (the whole order is reversed: the FIRST key is the first request to stop)"
        raise CheckFailed(
            f"[{case.name}] policy {policy!r}: the order should be {expected}, got {got}; at position {i} "
            f"{_describe(by[expected[i]])} goes before {_describe(by[got[i]])}: {RULES[policy]}{why}{where}",
            case=case.name, expected=expected, got=got, label=f"position {i}")

    return run_cases("victim_order", _order_cases(seed, n_random), run_one)


# --- next_token_ratio -----------------------------------------------------------------------


def next_token_ratio_solution(policy, ratio, retracted, remaining):
    """SGLang's new_token_ratio after one decode step."""
    if not retracted:            # the step fit: estimate a little lower, down to the minimum
        return max(ratio - policy.decay, policy.min_ratio)
    total_max_new = sum(r.max_new for r in remaining)
    if total_max_new == 0:       # nobody left to estimate from (kvlab's rule)
        return policy.init_ratio
    decoded = sum(r.generated for r in remaining)
    return min(1.0, (decoded + policy.retract_decode_steps * len(remaining)) / total_max_new)


def _script(rng, steps: int, every: int):
    """``steps`` steps; every ``every``-th a retraction with 1-4 requests left."""
    out = []
    for k in range(steps):
        left = [RequestView(j, 10, rng.randint(0, 60), rng.choice([16, 64, 128]), 20, 5)
                for j in range(rng.randint(0 if k % 7 == 6 else 1, 4))]
        out.append((k % every == every - 1, left))
    return out


def _ratio_cases(seed: int, n_random: int) -> list[Case]:
    rng = random.Random(seed)

    def case(name, policy, script, kind="edge", *more):
        return Case(name, {"policy": policy, "scripts": [script, *more]}, kind)

    sglang = RetractDecode()
    short = [RequestView(0, 10, 3, 16, 13, 4)]
    cases = [
        case("SGLang's constants: 700 quiet steps reach the minimum", sglang, [(False, [])] * 700),
        case("a retraction after a long decline: the ratio recovers", sglang,
             [(False, [])] * 300 + [(True, [RequestView(0, 10, 40, 128, 50, 13), RequestView(1, 8, 2, 64, 10, 3)])]
             + [(False, [])] * 5),
        case("a retraction that needs more than everything: capped at 1", sglang, [(True, short)]),
        case("nobody left after a retraction: back to the initial ratio", sglang, [(False, [])] * 10 + [(True, [])]),
        case("other constants (init 0.5, factor 0.2, 10 decay steps, 5 retract steps)",
             RetractDecode(init_ratio=0.5, min_ratio_factor=0.2, decay_steps=10, retract_decode_steps=5),
             _script(rng, 40, 9)),
        # two runs in turns with one policy: each call's ratio is its own run's (an answer that
        # keeps the ratio between calls follows the other run)
        case("two runs in turns, one policy: each call gets its own run's ratio", sglang,
             [(False, [])] * 12, "edge", _script(random.Random(seed + 7), 12, 3)),
    ]
    for i in range(n_random):
        policy = RetractDecode(init_ratio=rng.choice([0.3, 0.7, 1.0]), min_ratio_factor=rng.choice([0.1, 0.14, 0.5]),
                               decay_steps=rng.choice([5, 50, 600]), retract_decode_steps=rng.choice([0, 20, 3]))
        cases.append(case(f"random {i + 1}", policy, _script(rng, rng.randint(5, 60), rng.randint(2, 12)), "random"))
    return cases


@exercise(
    "next_token_ratio",
    chapter="12",
    hints=[
        "Two cases. The step fit (nothing retracted): lower the ratio by policy.decay, but never below "
        "policy.min_ratio. A retraction: compute a fresh estimate from the requests still running.",
        "The fresh estimate is what they generated so far plus policy.retract_decode_steps more tokens "
        "each, over the sum of their max_new: (sum(r.generated) + steps * len(remaining)) / sum(r.max_new), "
        "at most 1.0.",
        "Read the constants from `policy` (init_ratio, min_ratio, decay, retract_decode_steps): the "
        "checker also runs constants other than SGLang's. With nobody left, return policy.init_ratio.",
    ],
    solution=next_token_ratio_solution,
)
def next_token_ratio(fn, *, seed: int = 0, n_random: int = 6) -> int:
    """Check ``fn(policy, ratio, retracted, remaining) -> float`` over scripts of decode steps."""

    def run_one(case: Case) -> None:
        policy, scripts = case.args["policy"], case.args["scripts"]
        ratios = [[policy.init_ratio, policy.init_ratio] for _ in scripts]   # per run: [want, got]
        turns = len(scripts) > 1
        for k in range(max(map(len, scripts))):
            for run, script in enumerate(scripts):
                if k < len(script):
                    where = f"run {run + 1}, step {k}" if turns else f"step {k}"
                    _one_step(fn, case, policy, script[k], ratios[run], where, turns)

    return run_cases("next_token_ratio", _ratio_cases(seed, n_random), run_one)


def _one_step(fn, case: Case, policy, step, ratio: list, where: str, turns: bool) -> None:
    """One call: ``ratio`` is ``[want, got]`` of its run before the step, updated in place."""
    retracted, remaining = step
    before = ratio[1]
    want = ratio[0] = pressure_ratio(policy, ratio[0], retracted=retracted, remaining=remaining)
    got = ratio[1] = call_learner(fn, policy, before, retracted, list(remaining), read_only=(3,))
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        raise CheckFailed(f"[{case.name}] {where}: return a number, got {got!r}", case=case.name)
    if abs(got - want) <= 1e-9:
        return
    what = "a retraction" if retracted else "a step that fit"
    why = ""
    if retracted and abs(got - max(before - policy.decay, policy.min_ratio)) <= 1e-9:
        why = (" -- it kept decaying after a retraction: a ratio that never recovers keeps "
               "admitting on estimates that just ran out. After a retraction SGLang starts again "
               "from what the running requests generated (retract_decode)")
    elif not retracted and got < policy.min_ratio - 1e-12:
        why = f" -- below the minimum policy.min_ratio={policy.min_ratio:.4f}"
    elif retracted and got > 1:
        why = " -- above 1: the estimate is capped at the whole answer, min(1, ...)"
    elif turns:
        why = (" -- two runs take turns here, and each call gets its own run's ratio as `ratio`: an "
               "answer that keeps the ratio between calls (a global, an attribute, a cache) goes on "
               "from the other run's. Compute from the arguments alone")
    left = ", ".join(f"(generated {r.generated}, max_new {r.max_new})" for r in remaining) or "none"
    raise CheckFailed(
        f"[{case.name}] {where} ({what}; running after it: {left}): the ratio should go from "
        f"{before:.6f} to {want:.6f}, got {got:.6f}{why}\n  policy: init {policy.init_ratio}, "
        f"min {policy.min_ratio:.4f}, decay {policy.decay:.6f}, retract_decode_steps "
        f"{policy.retract_decode_steps}", case=case.name, expected=want, got=got, label=where)

