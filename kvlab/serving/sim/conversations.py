"""Multi-turn conversations that come back after others pushed them out (chapter 13).

A chat re-sends its whole history with every turn: turn ``t`` of a conversation is its first
message, every earlier question and answer, and the new question. So the prompts grow, share
everything but their last question with the turn before, and come back only after the other
conversations have had their turns (each round visits the live conversations in a seeded random
order). Their working set -- every conversation's history at once -- is what a prefix cache must
hold to compute nothing twice::

    conversation 0   [ first message | q1 ]  a1
                     [ first message | q1 | a1 | q2 ]  a2      (after conversations 1, 2, ... had a turn)
                     [ first message | q1 | a1 | q2 | a2 | q3 ]  a3

The same plan feeds the tier simulator (:mod:`kvlab.serving.sim.tier_sim`), whose answers are
seeded tokens, and ``python -m kvlab.bench --hierarchy``, whose answers are the model's own.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import NamedTuple

from ...base.args import check_int
from ...base.errors import InvalidArgument

__all__ = ["ChatPlan", "Turn", "chat_turns", "working_set"]


@dataclass(frozen=True)
class ChatPlan:
    """How many conversations, how many turns each, and the lengths (``(low, high)`` ranges, in
    tokens) of the first message, each question and each answer; ``history_cap``: a conversation
    ends once its history would pass this many tokens."""

    conversations: int = 8
    turns: int = 6
    first: tuple[int, int] = (256, 1024)
    question: tuple[int, int] = (32, 256)
    answer: tuple[int, int] = (16, 64)
    history_cap: int = 16384
    vocab: int = 1000
    seed: int = 0

    def __post_init__(self):
        check_int("plan.conversations", self.conversations, minimum=1)
        check_int("plan.turns", self.turns, minimum=1)
        check_int("plan.history_cap", self.history_cap, minimum=1)
        check_int("plan.vocab", self.vocab, minimum=2)
        check_int("plan.seed", self.seed)
        for name in ("first", "question", "answer"):
            low, high = getattr(self, name)
            check_int(f"plan.{name}[0]", low, minimum=1)
            if check_int(f"plan.{name}[1]", high, minimum=1) < low:
                raise InvalidArgument(f"plan.{name}", "a range (low, high) with low <= high", f"got {(low, high)}")


class Turn(NamedTuple):
    """One turn: conversation ``conversation``'s ``index``-th, the new ``message`` (its first
    message at turn 0, a question after) and the answer's length."""

    conversation: int
    index: int
    message: tuple[int, ...]
    answer_len: int


def chat_turns(plan: ChatPlan) -> list[Turn]:
    """Every turn, in the order they arrive: round after round, each round the live conversations
    in a seeded random order (so each comes back after all the others)."""
    if not isinstance(plan, ChatPlan):
        raise InvalidArgument("plan", "a kvlab.serving.sim.conversations.ChatPlan", f"got {type(plan).__name__}")
    rng = random.Random(plan.seed)
    lengths = [0] * plan.conversations
    out: list[Turn] = []
    for index in range(plan.turns):
        order = [c for c in range(plan.conversations) if lengths[c] is not None]
        rng.shuffle(order)
        for c in order:
            n = rng.randint(*(plan.first if index == 0 else plan.question))
            answer = rng.randint(*plan.answer)
            if lengths[c] + n + answer > plan.history_cap:
                lengths[c] = None                    # this conversation has ended
                continue
            lengths[c] += n + answer
            out.append(Turn(c, index, tuple(rng.randrange(plan.vocab) for _ in range(n)), answer))
    return out


def working_set(turns: list[Turn]) -> int:
    """Tokens of every conversation's whole history at once (messages and answers)."""
    total: dict[int, int] = {}
    for t in turns:
        total[t.conversation] = total.get(t.conversation, 0) + len(t.message) + t.answer_len
    return sum(total.values())
