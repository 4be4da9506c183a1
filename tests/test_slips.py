"""A checker names a slip only when that slip alone gives the learner's answer
(``kvlab.course.checking.slips``): the two wrong causes the fourth pass found, and the rule itself."""
from __future__ import annotations

import torch

from kvlab.course.checking.slips import recognised


def test_a_slip_is_named_only_when_it_alone_gives_the_answer():
    slips = {"adds one": lambda: 3, "doubles": lambda: 4, "squares": lambda: 4, "raises": lambda: 1 / 0}
    same = lambda a, b: a == b  # noqa: E731
    assert recognised(3, slips, same) == "\n  looks like adds one"
    assert recognised(4, slips, same) == ""  # two slips give 4: unsure, say nothing
    assert recognised(5, slips, same) == ""
    assert recognised(3, slips, same, also=[lambda: 3]) == ""  # a slip without a name gives 3 too


def test_a_hash_reused_for_equal_tokens_is_not_blamed_on_the_parent():
    # [7 7 | 7 7]: a page hashed without its parent and a hash reused for the same tokens give the
    # same answer, so neither is named (the third pass named the first)
    from kvlab.course.exercises.ch11_hash_chain import _hash_slips, _reusing

    ids = [7, 7, 7, 7]
    assert recognised(_reusing(ids, 2), _hash_slips(ids, 2), lambda a, b: a == b) == ""
    ids = [5, 6, 5, 6]  # page size 1: only reusing gives page 2 the hash of page 0
    assert "reuses that page's hash" in recognised(_reusing(ids, 1), _hash_slips(ids, 1), lambda a, b: a == b)


def test_a_step_that_never_stores_v_is_told_so_not_that_it_writes_at_positions():
    from kvlab.course.exercises.ch10_hf import _pool_slips, _stored, step_layout

    args = step_layout(4, [7, 2, 14], seed=3)
    no_v = _stored(args, None, (), args["k"], args["v"])
    said = recognised(no_v, _pool_slips(args), lambda x, y: all(map(torch.equal, x, y)))
    assert said == "\n  looks like it never stores V: v_pool[slots] = v is missing"
