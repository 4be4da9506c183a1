"""Workloads for the serving-loop simulator (chapter 07): traffic a learner recognises.

A workload is a list of :class:`RequestSpec`: a prompt (token ids), the tokens the "model"
will answer with (drawn from the seed: the simulator has no model, it only moves memory),
when the request arrives, and optionally that the client gives up after some tokens.

    shared_system_prompt   [ SYSTEM PROMPT ........ | user question ]   x many
    multi_turn_chat        turn 1: [ sys | q1 ]            -> a1
                           turn 2: [ sys | q1 | a1 | q2 ]  -> a2   (arrives after turn 1 ends)
    few_shot               [ instruction | ex1 | ex2 | ex3 | question ]   (a few templates)
    random_prompts         [ unrelated tokens ]  (no sharing: the cache only costs memory)
    eos_long_tail          answers that mostly end early at EOS, a few run to max_new_tokens
                           (chapter 12: where reserving whole answers wastes most)
    long_prompt_burst      a few short requests decode, then a burst of long prompts arrives
    long_answers           answers that run (nearly) to max_new_tokens: longer than SGLang's
                           estimate expects (chapter 12: where retraction happens)

Every generator takes a ``seed`` and returns the same workload for the same arguments; a bad
count, length, gap or fraction raises :class:`~kvlab.base.errors.InvalidArgument` naming it.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

__all__ = ["RequestSpec", "Workload", "shared_system_prompt", "multi_turn_chat", "few_shot",
           "random_prompts", "mixed", "eos_long_tail", "long_prompt_burst", "long_answers", "WORKLOADS",
           "make_workload"]

VOCAB = 100  # token ids are ints in [0, VOCAB); only equality matters to a prefix cache


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload.

    ``after``: the rid of a request that must finish first (a chat's previous turn); the
    request then arrives ``arrival`` steps after that one finishes. Otherwise ``arrival``
    is the step it arrives at. ``abort_after``: the client disconnects once this many
    output tokens were generated (``None``: it waits for the whole answer).
    ``max_new_tokens``: the cap on its answer, all a scheduler knows of its length (chapter
    12); ``output`` may end earlier, at an end-of-text token (``None``: ``len(output)``, the
    answer runs to its cap).
    """

    rid: int
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    arrival: int
    after: int | None = None
    abort_after: int | None = None
    tag: str = ""
    max_new_tokens: int | None = None

    @property
    def total_len(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def max_len(self) -> int:
        """Prompt plus the cap on its answer: what a reservation must be able to hold."""
        return len(self.prompt) + (len(self.output) if self.max_new_tokens is None else self.max_new_tokens)


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    requests: tuple[RequestSpec, ...]

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def max_total_len(self) -> int:
        """The longest request, its answer's cap included (:attr:`RequestSpec.max_len`)."""
        return max(r.max_len for r in self.requests)


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB) for _ in range(n))


def _arrivals(rng: random.Random, n: int, mean_gap: float) -> list[int]:
    """Arrival steps with random (exponential-ish) gaps, starting at step 0."""
    t, out = 0.0, []
    for _ in range(n):
        out.append(int(t))
        t += rng.expovariate(1.0 / mean_gap) if mean_gap > 0 else 0.0
    return out


def _check_counts(**kw) -> None:
    from ...base.args import is_int
    from ...base.errors import InvalidArgument

    for name, v in kw.items():
        if name == "seed":
            if not is_int(v):
                raise InvalidArgument("seed", "an int", f"got {v!r}")
            continue
        if name in ("mean_gap", "abort_fraction", "tail", "at_least"):
            from ...base.args import check_real

            check_real(name, v, below=1.0 + 1e-9 if name in ("abort_fraction", "at_least") else float("inf"),
                       minimum=1e-6 if name in ("tail", "at_least") else 0.0)
            continue
        if isinstance(v, tuple):
            lo, hi = v
            if not (is_int(lo) and is_int(hi) and 1 <= lo <= hi):
                raise InvalidArgument(name, "a range (lo, hi) of ints with 1 <= lo <= hi", f"got {v!r}")
        elif not is_int(v) or v < 1:
            raise InvalidArgument(name, "an int >= 1", f"got {v!r}")


def shared_system_prompt(seed: int = 0, n_requests: int = 12, system_len: int = 40,
                         user_len: tuple[int, int] = (4, 16), output_len: tuple[int, int] = (4, 16),
                         mean_gap: float = 1.5) -> Workload:
    """Every request starts with the same system prompt, then its own question."""
    _check_counts(seed=seed, n_requests=n_requests, system_len=system_len, user_len=user_len,
                  output_len=output_len, mean_gap=mean_gap)
    rng = random.Random(seed)
    system = _tokens(rng, system_len)
    reqs = [RequestSpec(i, system + _tokens(rng, rng.randint(*user_len)),
                        _tokens(rng, rng.randint(*output_len)), t, tag="system+question")
            for i, t in enumerate(_arrivals(rng, n_requests, mean_gap))]
    return Workload("shared_system_prompt", "one system prompt shared by every request", tuple(reqs))


def multi_turn_chat(seed: int = 0, n_conversations: int = 3, turns: int = 3, system_len: int = 16,
                    user_len: tuple[int, int] = (4, 12), output_len: tuple[int, int] = (4, 12),
                    think_steps: int = 2, mean_gap: float = 2.0) -> Workload:
    """Conversations: each turn's prompt is the whole conversation so far plus a new question.

    Turn ``k + 1`` arrives ``think_steps`` after turn ``k`` finished (the user reads, then types).
    """
    _check_counts(seed=seed, n_conversations=n_conversations, turns=turns, system_len=system_len,
                  user_len=user_len, output_len=output_len, mean_gap=mean_gap)
    if not isinstance(think_steps, int) or isinstance(think_steps, bool) or think_steps < 0:
        from ...base.errors import InvalidArgument

        raise InvalidArgument("think_steps", "an int >= 0", f"got {think_steps!r}")
    rng = random.Random(seed)
    system = _tokens(rng, system_len)
    reqs: list[RequestSpec] = []
    for conv, start in enumerate(_arrivals(rng, n_conversations, mean_gap)):
        history: tuple[int, ...] = system
        prev: int | None = None
        for turn in range(turns):
            prompt = history + _tokens(rng, rng.randint(*user_len))
            answer = _tokens(rng, rng.randint(*output_len))
            rid = len(reqs)
            reqs.append(RequestSpec(rid, prompt, answer, start if prev is None else think_steps,
                                    after=prev, tag=f"chat {conv} turn {turn + 1}"))
            history, prev = prompt + answer, rid
    return Workload("multi_turn_chat", "conversations whose turns extend the previous turn", tuple(reqs))


def few_shot(seed: int = 0, n_requests: int = 12, n_templates: int = 2, n_examples: int = 3,
             example_len: int = 12, question_len: tuple[int, int] = (4, 10),
             output_len: tuple[int, int] = (2, 8), mean_gap: float = 1.5) -> Workload:
    """A few prompt templates (instruction + worked examples) reused with different questions."""
    _check_counts(seed=seed, n_requests=n_requests, n_templates=n_templates, n_examples=n_examples,
                  example_len=example_len, question_len=question_len, output_len=output_len,
                  mean_gap=mean_gap)
    rng = random.Random(seed)
    instruction = _tokens(rng, 8)
    examples = [_tokens(rng, example_len) for _ in range(n_examples + n_templates)]
    # templates share the instruction and the first example, then differ
    templates = [instruction + sum((examples[(t + k) % len(examples)] for k in range(n_examples)), ())
                 for t in range(n_templates)]
    reqs = []
    for i, t in enumerate(_arrivals(rng, n_requests, mean_gap)):
        tpl = rng.randrange(n_templates)
        reqs.append(RequestSpec(i, templates[tpl] + _tokens(rng, rng.randint(*question_len)),
                                _tokens(rng, rng.randint(*output_len)), t, tag=f"template {tpl}"))
    return Workload("few_shot", "a few few-shot templates, each reused with new questions", tuple(reqs))


def random_prompts(seed: int = 0, n_requests: int = 12, prompt_len: tuple[int, int] = (8, 40),
                   output_len: tuple[int, int] = (4, 16), mean_gap: float = 1.5,
                   abort_fraction: float = 0.0) -> Workload:
    """Unrelated prompts: nothing to share. ``abort_fraction`` of clients give up half-way."""
    _check_counts(seed=seed, n_requests=n_requests, prompt_len=prompt_len, output_len=output_len,
                  mean_gap=mean_gap, abort_fraction=abort_fraction)
    rng = random.Random(seed)
    reqs = []
    for i, t in enumerate(_arrivals(rng, n_requests, mean_gap)):
        out = _tokens(rng, rng.randint(*output_len))
        abort = max(1, len(out) // 2) if rng.random() < abort_fraction else None
        reqs.append(RequestSpec(i, _tokens(rng, rng.randint(*prompt_len)), out, t, abort_after=abort,
                                tag="random" if abort is None else "random (aborts)"))
    return Workload("random_prompts", "unrelated prompts (no sharing)", tuple(reqs))


def mixed(seed: int = 0, scale: int = 1) -> Workload:
    """A bit of everything: a system prompt, a chat, few-shot, unrelated prompts, aborts."""
    _check_counts(seed=seed, scale=scale)
    parts: Sequence[Workload] = [
        shared_system_prompt(seed, n_requests=4 * scale, system_len=24),
        multi_turn_chat(seed + 1, n_conversations=1 * scale, turns=3, system_len=8),
        few_shot(seed + 2, n_requests=3 * scale, example_len=8),
        random_prompts(seed + 3, n_requests=3 * scale, abort_fraction=0.5),
    ]
    reqs: list[RequestSpec] = []
    for part in parts:
        base = len(reqs)
        for r in part.requests:
            reqs.append(RequestSpec(base + r.rid, r.prompt, r.output, r.arrival,
                                    None if r.after is None else base + r.after, r.abort_after,
                                    f"{part.name}: {r.tag}"))
    return Workload("mixed", "system prompt + chat + few-shot + unrelated, with aborts", tuple(reqs))


def eos_long_tail(seed: int = 0, n_requests: int = 16, prompt_len: tuple[int, int] = (8, 24),
                  max_new_tokens: int = 48, tail: float = 1.3, typical: int = 2,
                  mean_gap: float = 1.0) -> Workload:
    """Answers whose lengths are long-tailed: most end early at an end-of-text token, a few
    run to ``max_new_tokens`` (``typical`` x a Pareto draw of shape ``tail``: a smaller shape
    is a heavier tail). The scheduler knows only the cap: reserving it wastes the most here."""
    _check_counts(seed=seed, n_requests=n_requests, prompt_len=prompt_len,
                  max_new_tokens=max_new_tokens, tail=tail, typical=typical, mean_gap=mean_gap)
    rng = random.Random(seed)
    reqs = []
    for i, t in enumerate(_arrivals(rng, n_requests, mean_gap)):
        n = min(max_new_tokens, max(1, int(typical * rng.paretovariate(tail))))
        reqs.append(RequestSpec(i, _tokens(rng, rng.randint(*prompt_len)), _tokens(rng, n), t,
                                tag="eos" if n < max_new_tokens else "length",
                                max_new_tokens=max_new_tokens))
    return Workload("eos_long_tail", "long-tailed answers, most ended early by EOS", tuple(reqs))


def long_prompt_burst(seed: int = 0, n_short: int = 4, n_long: int = 6,
                      prompt_len: tuple[int, int] = (48, 80), output_len: tuple[int, int] = (8, 20),
                      burst_at: int = 4) -> Workload:
    """``n_short`` short requests start decoding; at step ``burst_at`` ``n_long`` long prompts
    arrive at once. Each answer runs to its cap (no EOS)."""
    _check_counts(seed=seed, n_short=n_short, n_long=n_long, prompt_len=prompt_len,
                  output_len=output_len, burst_at=burst_at)
    rng = random.Random(seed)
    reqs = [RequestSpec(i, _tokens(rng, rng.randint(4, 12)), _tokens(rng, rng.randint(*output_len)),
                        i % 2, tag="short") for i in range(n_short)]
    reqs += [RequestSpec(n_short + i, _tokens(rng, rng.randint(*prompt_len)),
                         _tokens(rng, rng.randint(*output_len)), burst_at, tag="long prompt")
             for i in range(n_long)]
    return Workload("long_prompt_burst", "short requests, then a burst of long prompts", tuple(reqs))


def long_answers(seed: int = 0, n_requests: int = 24, prompt_len: tuple[int, int] = (4, 12),
                 max_new_tokens: int = 32, at_least: float = 0.9, mean_gap: float = 0.25) -> Workload:
    """Answers that run nearly to their cap: each ``at_least`` x ``max_new_tokens`` to
    ``max_new_tokens`` tokens. SGLang's admission counts a running request as ``new_token_ratio``
    (0.7 at first) x what it may still generate, too little for these: in tight memory the
    running requests outgrow what was left for them and some are retracted."""
    _check_counts(seed=seed, n_requests=n_requests, prompt_len=prompt_len,
                  max_new_tokens=max_new_tokens, at_least=at_least, mean_gap=mean_gap)
    rng = random.Random(seed)
    shortest = max(1, -(-round(at_least * max_new_tokens * 1000) // 1000))
    reqs = []
    for i, t in enumerate(_arrivals(rng, n_requests, mean_gap)):
        n = rng.randint(shortest, max_new_tokens)
        reqs.append(RequestSpec(i, _tokens(rng, rng.randint(*prompt_len)), _tokens(rng, n), t,
                                tag="length" if n == max_new_tokens else "eos", max_new_tokens=max_new_tokens))
    return Workload("long_answers", "answers that run nearly to their cap, longer than the estimate", tuple(reqs))


WORKLOADS = {
    "shared_system_prompt": shared_system_prompt,
    "multi_turn_chat": multi_turn_chat,
    "few_shot": few_shot,
    "random_prompts": random_prompts,
    "mixed": mixed,
    "eos_long_tail": eos_long_tail,
    "long_prompt_burst": long_prompt_burst,
    "long_answers": long_answers,
}


def make_workload(name: str, seed: int = 0, **kwargs) -> Workload:
    """Build a workload by name (see :data:`WORKLOADS`); ``kwargs`` go to its generator."""
    import inspect

    from ...base.errors import InvalidArgument

    if not isinstance(name, str) or name not in WORKLOADS:
        raise InvalidArgument("name", f"one of {sorted(WORKLOADS)}", f"got {name!r}")
    known = list(inspect.signature(WORKLOADS[name]).parameters)
    for key in kwargs:
        if key not in known:
            raise InvalidArgument(key, f"an argument of {name} ({', '.join(known[1:])})",
                                  f"got {key}={kwargs[key]!r}")
    return WORKLOADS[name](seed, **kwargs)
