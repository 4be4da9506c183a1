"""The records of the mutation suite (``tests/test_mutations.py``): a planted slip, a correct
rewrite, a wrong answer written out whole, and the classes of slips."""
from __future__ import annotations

from typing import Callable, NamedTuple


class Mutant(NamedTuple):
    exercise: str  # the exercise whose solution is mutated (and whose checker must reject it)
    old: str  # text in the solution's source ...
    new: str  # ... replaced by this
    must_say: tuple[str, ...]  # the failure message names these (argument, request, part, ...)
    why: str  # the bug, in words
    kind: str = "value"  # which class of slip (KINDS)


class Rewrite(NamedTuple):
    exercise: str
    old: str
    new: str
    why: str


class WrongAnswer(NamedTuple):
    """A wrong answer of its own shape (not a text change of the solution)."""

    exercise: str
    answer: Callable
    must_say: tuple[str, ...]
    kind: str = "value"

    @property
    def why(self) -> str:
        return (self.answer.__doc__ or self.answer.__name__).strip().split("\n")[0]


#: the classes of slips: the first ones from the start; the others are blind spots a checker
#: must not have (each is compared in a way the answer alone does not show)
KINDS = {
    "value": "wrong values, shapes only some inputs have, stray accesses, races, order of calls",
    "input": "an input changed in place (the answer is right, the caller's data is not)",
    "param": "a parameter of the statement that works at one value only (page size, BLOCK, scale)",
    "lucky": "right by coincidence on unlucky inputs (page 0 first, rows in order, slot == position)",
    "state": "state the statement constrains beyond the answer (other parts' slots, LRU stamps)",
    "compiled": "runs in Triton's interpreter, but a GPU's compiler refuses it",
    "blame": "caught, but a message that must name the right part or request",
    "type": "another type than the statement's (a tuple for a list, float positions), which the "
            "next cell cannot use",
    "unseen": "an input the cases never had (token ids past 255, a page shared after another "
              "beginning in the case before, a page listed twice)",
    "bounds": "a read past the end of a tensor that only a full pool provokes (the pool's last slots "
              "in use, a head size below the block)",
    "memo": "state kept between calls: right on each call alone, wrong when the same numbers come "
            "back with other slots, keys or runs",
    "aside": "an effect on what the statement leaves alone (the device pool a swap-out only reads, "
             "host pages reused uncleared)",
    "alike": "an order the cases could not tell from the right one (ranking by generated / max_new "
             "while every max_new is equal)",
}
