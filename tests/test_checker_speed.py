"""A check answers at once: the median checker call of the course stays under half a second.

A learner runs a checker after every change, so its time is the time of one try. Each
exercise's checker runs on its reference solution with its default cases (the first call of
each, which also loads its module and compiles nothing in the interpreter, is left out), one
call each, and the median of those calls is compared with :data:`MEDIAN_LIMIT_S`. A call is
timed in CPU seconds, its child processes included (the safety net runs learner code in a
fork): the work a check costs, which on an idle machine is its wall time too, and which the
other jobs of a busy test machine do not inflate.
"""
from __future__ import annotations

import os
import statistics
import time


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system

import kvlab.check
import kvlab.solutions

MEDIAN_LIMIT_S = 0.5


def test_the_median_checker_call_takes_under_half_a_second(capsys):
    took, wall = {}, {}
    for name in kvlab.check.exercises():
        checker, solution = getattr(kvlab.check, name), kvlab.solutions.get(name)
        checker(solution)  # warm: imports, the first fork
        start, start_wall = cpu_seconds(), time.perf_counter()
        checker(solution)
        took[name], wall[name] = cpu_seconds() - start, time.perf_counter() - start_wall
    capsys.readouterr()
    median = statistics.median(took.values())
    slowest = [(n, round(t, 2)) for n, t in sorted(took.items(), key=lambda kv: -kv[1])[:3]]
    assert median < MEDIAN_LIMIT_S, f"median {median:.2f} s of CPU; slowest {slowest}"
    print(f"median checker call {median * 1e3:.0f} ms of CPU ({statistics.median(wall.values()) * 1e3:.0f} ms "
          f"of wall time) over {len(took)} exercises; slowest {slowest}")
