"""A check answers at once: the median checker call of the course stays under half a second.

A learner runs a checker after every change, so its time is the time of one try. Each
exercise's checker runs on its reference solution with its default cases (the first call of
each, which also loads its module and compiles nothing in the interpreter, is left out), one
call each, and the median of those calls is compared with :data:`MEDIAN_LIMIT_S`.
"""
from __future__ import annotations

import statistics
import time

import kvlab.check
import kvlab.solutions

MEDIAN_LIMIT_S = 0.5


def test_the_median_checker_call_takes_under_half_a_second(capsys):
    took = {}
    for name in kvlab.check.exercises():
        checker, solution = getattr(kvlab.check, name), kvlab.solutions.get(name)
        checker(solution)  # warm: imports, the first fork
        start = time.perf_counter()
        checker(solution)
        took[name] = time.perf_counter() - start
    capsys.readouterr()
    median = statistics.median(took.values())
    slowest = sorted(took.items(), key=lambda kv: -kv[1])[:3]
    assert median < MEDIAN_LIMIT_S, f"median {median:.2f} s; slowest {slowest}"
    print(f"median checker call {median * 1e3:.0f} ms over {len(took)} exercises; slowest {slowest}")
