"""When KV memory runs out: four policies in one vocabulary (chapter 12).

A server admits a request without knowing how long its answer will be (it ends at an
end-of-text token, or at ``max_new_tokens``). Every running request takes one more token slot
per step, so memory that looked ample at admission can run out in the middle of a decode
step. A policy answers two questions: **how much may still be promised at admission**, and
**whom to stop when a step does not fit**. The simulator (:mod:`kvlab.serving.sim`) and
:class:`kvlab.serving.hf.PagedGenerator` both ask these objects, so both run the same four rules:

    policy      admission counts, per request that holds a row        when a step does not fit
    ─────────   ────────────────────────────────────────────────────   ─────────────────────────────
    reserve     every position it may ever map: prompt + max_new - 1   never happens
                (mini-sglang's PrefillAdder)
    recompute   only the positions of the coming step (vLLM v1)        preempt the latest admitted;
                                                                       its whole pages stay cached;
                                                                       it re-prefills at the front
    retract     ratio x what it may still generate (SGLang's           retract fewest outputs, then
                new_token_ratio; a newcomer counts its whole output)   longest prompt; re-queued last
    swap        only the coming step                                   copy the latest arrival's KV
                                                                       to host memory; copy it back
                                                                       before anyone new is admitted

Where each rule comes from (the code, not the papers):

* **reserve**: mini-sglang ``python/minisgl/scheduler/prefill.py`` (``PrefillAdder``,
  sgl-project/mini-sglang ``20fcd7f`` on main): a request waits while ``estimated_len + reserved_size >
  available_size``, where ``estimated_len`` is its uncached prompt plus its whole ``output_len``
  and ``reserved_size`` starts at what the running requests may still decode.
* **recompute**: vLLM ``vllm/v1/core/sched/scheduler.py`` (vllm-project/vllm ``00024d31``):
  when ``allocate_slots`` fails for a running request, ``preempted_req = self.running.pop()``
  (FCFS: the last one appended, i.e. the latest admitted or resumed) until it fits or the
  request preempts itself; ``_preempt_request`` frees its blocks, sets ``num_computed_tokens =
  0`` and ``self.waiting.prepend_request`` (front of the queue); no waiting request is scheduled
  in a step that preempted (``if not preempted_reqs``). Its full blocks were hashed as they were
  computed, so they stay findable in the free queue (chapter 11): kvlab's ``keep_computed=True``
  caches the victim's whole pages with ``cache_req(finished=True)``.
* **retract**: SGLang ``python/sglang/srt/managers/schedule_batch.py`` ``retract_decode`` and
  ``scheduler.py`` ``update_running_batch`` (sgl-project/sglang ``000eaffa``), constants in
  ``python/sglang/global_config.py``: ``init = 0.7`` (``SGLANG_INIT_NEW_TOKEN_RATIO``), ``min =
  init * 0.14`` (``SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR``), ``decay = (init - min) / 600`` per decode
  step that needed no retraction (``SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS``), ``retract_decode_steps
  = 20``. Victims: ``sort(key=(len(output_ids), -len(origin_input_ids)), reverse=True)`` then
  ``pop()``: fewest outputs first, among them the longest prompt; ``release_req`` frees the KV
  past the cached prefix (nothing new is inserted into the tree). After a retraction the ratio
  becomes ``min(1, (decoded + 20 * n) / sum(max_new_tokens))`` over the ``n`` requests left;
  when the server idles, ``self_check_during_idle`` sets it back to ``init``. The prefill side
  (``schedule_policy.py`` ``PrefillAdder``, ``00550cd1``) counts a running request as
  ``min(max_new - len(output_ids), CLIP_MAX_NEW_TOKENS=4096) * new_token_ratio`` and a newcomer
  as its uncached prompt plus ``min(max_new, 4096)``.
* **swap**: vLLM v0 ``vllm/core/scheduler.py`` (``0054e1fa``): ``PreemptionMode.SWAP`` copies a
  sequence's blocks to CPU memory and back when it resumes; the victim is ``running_queue.pop()``
  after an FCFS sort (``vllm/core/policy.py``: the latest arrival); swapped requests are resumed
  before any waiting one is prefilled (``if not self.swapped: ... _schedule_prefills``) and none
  is swapped in during a step that preempted. (v0 used it only for groups of several sequences;
  recomputation was its default "since it incurs lower overhead than swapping".) SGLang's host
  KV pools (``python/sglang/srt/mem_cache/memory_pool_host.py``) allocate pinned host memory.

kvlab's departures, each named where it happens: a victim may also be a prompt still being
computed in chunks (SGLang keeps its one chunked request outside the running batch); the swap
policy copies the victim's whole row (positions ``[0, cached_len)``), and on resume copies back
only what the prefix cache no longer holds; the ratio decays once per step that decodes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Sequence

from ..base.args import check_int, div_ceil
from ..base.errors import InvalidArgument

__all__ = ["RequestView", "Policy", "ReserveWhole", "RecomputeOnPreempt", "RetractDecode",
           "SwapToHost", "PolicyRun", "POLICIES", "CHAPTER_07", "make_policy", "victim_order",
           "next_token_ratio", "ResumePlan", "resume_plan", "stop_request", "restore_request"]


class RequestView(NamedTuple):
    """What a policy reads of one request (plain numbers: the simulator and the generator each
    build these from their own records)."""

    key: object          # the caller's handle for it (a rid, a Seq)
    prompt_len: int      # its prompt
    generated: int       # output tokens so far
    max_new: int         # the cap on its answer (max_new_tokens): all the scheduler knows of its end
    positions: int       # positions its row maps once the coming step is mapped (req.device_len)
    mapped_pages: int    # pages its row maps now
    admitted: int = 0    # admission order (a resume is a new admission)
    arrived: int = 0     # arrival order

    @property
    def max_positions(self) -> int:
        """Every position it may ever map: its prompt and answer, less the last token (whose K/V
        no step computes)."""
        return self.prompt_len + self.max_new - 1


# ==== the four policies: frozen settings; their per-run state lives in a PolicyRun ==========


@dataclass(frozen=True)
class Policy:
    """One answer to "memory ran out". Subclasses set the class attributes and the two rules."""

    name: ClassVar[str] = ""
    preempts: ClassVar[bool] = True            # may stop a running request
    on_preempt: ClassVar[str] = "release"      # "keep" (cache its pages), "release", "swap"
    requeue: ClassVar[str] = "front"           # where a victim waits: "front", "back", "swapped"
    admit_after_preempt: ClassVar[bool] = False  # may a waiting request be admitted in a step that preempted

    def promised_positions(self, view: RequestView, ratio: float | None, *, new: bool) -> int:
        """Positions admission must leave room for, for ``view`` (capped at its max_positions)."""
        raise NotImplementedError

    def victim_key(self, view: RequestView):
        """Sort key: the request with the *largest* key is stopped first."""
        raise NotImplementedError

    def start(self) -> "PolicyRun":
        return PolicyRun(self)


@dataclass(frozen=True)
class ReserveWhole(Policy):
    """Reserve every request's whole answer at admission (mini-sglang; kvlab's generator of
    chapter 10): no step can run short, and an answer that ends early leaves its tail unused."""

    name: ClassVar[str] = "reserve"
    preempts: ClassVar[bool] = False

    def promised_positions(self, view, ratio, *, new):
        return view.max_positions

    def victim_key(self, view):
        raise InvalidArgument("policy", "a policy that preempts", "reserve never needs a victim")


@dataclass(frozen=True)
class RecomputeOnPreempt(Policy):
    """Admit on the coming step alone; when a step does not fit, preempt the latest admitted
    request, which re-prefills later (vLLM v1). ``keep_computed``: its whole pages go to the
    prefix cache first (vLLM caches full blocks as they are computed), so the re-prefill is
    mostly a hit; ``admit_after_preempt``: admit waiting requests in a step that preempted
    (vLLM does not). Chapter 07's simulator is :data:`CHAPTER_07`."""

    keep_computed: bool = True
    admit_after_preempt: bool = False  # type: ignore[misc]  (a setting of this policy)
    name: ClassVar[str] = "recompute"
    requeue: ClassVar[str] = "front"

    def __post_init__(self):
        for field in ("keep_computed", "admit_after_preempt"):
            if not isinstance(getattr(self, field), bool):
                raise InvalidArgument(f"policy.{field}", "True or False", f"got {getattr(self, field)!r}")

    @property
    def on_preempt(self) -> str:  # type: ignore[override]
        return "keep" if self.keep_computed else "release"

    def promised_positions(self, view, ratio, *, new):
        return view.positions

    def victim_key(self, view):
        return view.admitted                     # self.running.pop(): the latest admitted


@dataclass(frozen=True)
class RetractDecode(Policy):
    """Reserve an *estimate* of each answer, ``new_token_ratio`` x what it may still generate;
    retract decode requests when a step does not fit (SGLang). The constants are SGLang's."""

    init_ratio: float = 0.7
    min_ratio_factor: float = 0.14
    decay_steps: float = 600.0
    retract_decode_steps: int = 20
    clip_max_new: int = 4096
    name: ClassVar[str] = "retract"
    requeue: ClassVar[str] = "back"

    def __post_init__(self):
        for field in ("init_ratio", "min_ratio_factor", "decay_steps"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise InvalidArgument(f"policy.{field}", "a finite number > 0", f"got {v!r}")
        if self.init_ratio > 1 or self.min_ratio_factor > 1:
            raise InvalidArgument("policy.init_ratio", "init_ratio and min_ratio_factor <= 1",
                                  f"got {self.init_ratio}, {self.min_ratio_factor}")
        check_int("policy.retract_decode_steps", self.retract_decode_steps, minimum=0)
        check_int("policy.clip_max_new", self.clip_max_new, minimum=1)

    @property
    def min_ratio(self) -> float:
        return min(self.init_ratio * self.min_ratio_factor, 1.0)

    @property
    def decay(self) -> float:
        return (self.init_ratio - self.min_ratio) / self.decay_steps

    def promised_positions(self, view, ratio, *, new):
        if new:  # a newcomer counts its whole (clipped) answer
            return view.prompt_len + min(view.max_new, self.clip_max_new) - 1
        rest = min(max(view.max_new - view.generated, 0), self.clip_max_new)
        return view.positions + math.ceil(rest * ratio)

    def victim_key(self, view):
        return (-view.generated, view.prompt_len)  # fewest outputs, then the longest prompt


@dataclass(frozen=True)
class SwapToHost(Policy):
    """Admit on the coming step alone; when a step does not fit, copy the latest arrival's KV
    to host memory and free its pages; copy it back (into new pages) before anyone new is
    admitted (vLLM v0's swap). ``host_pages``: the host pool, in pages (``None``: as many as
    the device has); a victim that does not fit there is preempted by recompute instead."""

    host_pages: int | None = None
    name: ClassVar[str] = "swap"
    on_preempt: ClassVar[str] = "swap"
    requeue: ClassVar[str] = "swapped"

    def __post_init__(self):
        if self.host_pages is not None:
            check_int("policy.host_pages", self.host_pages, minimum=0)

    def promised_positions(self, view, ratio, *, new):
        return view.positions

    def victim_key(self, view):
        return view.arrived                      # FCFS-sorted running_queue.pop(): the latest arrival


POLICIES: dict[str, Policy] = {p.name: p for p in (ReserveWhole(), RecomputeOnPreempt(),
                                                    RetractDecode(), SwapToHost())}

#: chapter 07's simulator: vLLM's victim and queue order, but the victim's pages are released
#: uncached and waiting requests may be admitted in the step that preempted
CHAPTER_07 = RecomputeOnPreempt(keep_computed=False, admit_after_preempt=True)


def make_policy(policy, argument: str = "policy") -> Policy:
    """A policy from its name (one of :data:`POLICIES`) or a :class:`Policy` itself."""
    if isinstance(policy, Policy) and type(policy) is not Policy:
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]
    raise InvalidArgument(argument, f"one of {sorted(POLICIES)} or a kvlab.serving.pressure.Policy",
                          f"got {policy!r}")


# ==== the rules as plain functions (the chapter's exercises re-derive these) ================


def victim_order(policy: Policy | str, views: Sequence[RequestView]) -> list:
    """The keys of ``views`` in the order ``policy`` stops them (first = first to go). Of two
    that tie, the later in ``views`` goes first: SGLang pops from the end of its sorted batch."""
    policy = make_policy(policy)
    ranked = sorted(range(len(views)), key=lambda i: (policy.victim_key(views[i]), i), reverse=True)
    return [views[i].key for i in ranked]


def next_token_ratio(policy: RetractDecode, ratio: float, *, retracted: bool,
                     remaining: Sequence[RequestView] = ()) -> float:
    """SGLang's ratio after one decode step: decayed towards the minimum when the step fit;
    after a retraction, ``min(1, (decoded + retract_decode_steps * n) / sum(max_new))`` over the
    ``n`` requests that still run (back to the initial ratio if none is left)."""
    if not retracted:
        return max(ratio - policy.decay, policy.min_ratio)
    total = sum(v.max_new for v in remaining)
    if total <= 0:
        return policy.init_ratio
    decoded = sum(v.generated for v in remaining)
    return min(1.0, (decoded + policy.retract_decode_steps * len(remaining)) / total)


class ResumePlan(NamedTuple):
    """What a stopped request needs when it comes back, by positions of its row."""

    saved: int                  # [0, saved): computed before it stopped
    hit: int                    # [0, hit): whole pages the prefix cache still holds
    copy: tuple[int, int]       # [start, end): copied back from host memory (swap only)
    compute: tuple[int, int]    # [start, end): computed by a prefill (the last position included)

    @property
    def recomputed(self) -> int:
        """Positions computed before that are computed again."""
        return max(0, min(self.compute[1], self.saved) - self.compute[0])


def resume_plan(how: str, *, saved: int, hit: int, input_len: int) -> ResumePlan:
    """Plan the comeback of a request that had ``saved`` positions computed, whose
    ``input_len``-token input (prompt and answer so far) now hits ``hit`` tokens in the cache.
    ``how="swap"`` copies ``[hit, saved)`` back and computes the rest; any other ``how`` computes
    ``[hit, input_len)``. Nothing the cache holds is copied or computed again."""
    if not 0 <= saved < input_len or not 0 <= hit < input_len:
        raise InvalidArgument("saved, hit", "0 <= saved, hit < input_len",
                              f"got saved={saved}, hit={hit}, input_len={input_len}")
    if how == "swap" and saved > hit:
        return ResumePlan(saved, hit, (hit, saved), (saved, input_len))
    return ResumePlan(saved, hit, (hit, hit), (hit, input_len))


# ==== one run's state: the ratio, and the page arithmetic every caller shares ===============


@dataclass
class PolicyRun:
    """A policy during one run (a simulation, one ``generate`` call): its ratio (retract only)."""

    policy: Policy
    ratio: float | None = None

    def __post_init__(self):
        if isinstance(self.policy, RetractDecode) and self.ratio is None:
            self.ratio = self.policy.init_ratio

    @property
    def name(self) -> str:
        return self.policy.name

    def promised_pages(self, view: RequestView, page_size: int, *, new: bool = False) -> int:
        """Pages beyond those mapped now that admission must leave free for ``view``."""
        want = min(view.max_positions, self.policy.promised_positions(view, self.ratio, new=new))
        return max(0, div_ceil(max(want, view.positions), page_size) - view.mapped_pages)

    def unused_pages(self, view: RequestView, page_size: int) -> int:
        """Pages promised to ``view`` that its row will not map even after the coming step
        (the hatched "promised" pages of the chapter's pictures)."""
        step = max(0, div_ceil(view.positions, page_size) - view.mapped_pages)
        return self.promised_pages(view, page_size) - step

    def victim(self, views: Sequence[RequestView]) -> RequestView:
        """The request to stop first (largest key; the later of equal keys, as :func:`victim_order`)."""
        if not views:
            raise InvalidArgument("views", "at least one request to choose from", "got none")
        best = max(range(len(views)), key=lambda i: (self.policy.victim_key(views[i]), i))
        return views[best]

    def after_decode(self, *, retracted: bool, remaining: Sequence[RequestView]) -> None:
        """A step with decoding requests ran: move the ratio (retract only)."""
        if isinstance(self.policy, RetractDecode):
            self.ratio = next_token_ratio(self.policy, self.ratio, retracted=retracted,
                                          remaining=remaining)

    def on_idle(self) -> None:
        """Nothing ran: SGLang's ``self_check_during_idle`` resets the ratio."""
        if isinstance(self.policy, RetractDecode):
            self.ratio = self.policy.init_ratio



# ==== stopping a request and bringing it back, in the cache manager's words =================


def stop_request(manager, req, *, keep: bool) -> int:
    """Give a running request's pages back; return the positions it had computed.

    ``keep=True``: its whole computed pages go to the prefix cache first (``cache_req(...,
    finished=True)``: vLLM's preempted blocks stay findable); ``keep=False``: ``release_req``
    (SGLang's ``release_req`` of a retraction: nothing new is inserted). Either way its locks go
    and its row is cleared, all or nothing."""
    saved = req.cached_len
    if keep:
        manager.cache_req(req, finished=True)
    else:
        manager.release_req(req)
    return saved


def restore_request(manager, req, saved: int, copy_back=None) -> int:
    """Admit ``req`` (a new ``Req`` of the stopped request's input, on a free row) and, if it
    had ``saved`` positions computed beyond what the prefix cache still holds, map pages for
    them and mark them computed; ``copy_back(start, end, slots)`` fills those slots first (the
    swap policy's host copy). Returns how many positions came back. All or nothing: on any
    failure the admission is undone and the error propagates."""
    manager.admit(req)                         # match + lock the hit + map it into the row
    hit = req.cached_len
    if saved <= hit:
        return 0
    try:
        req.device_len = saved
        manager.allocate_paged([req])          # pages [div_ceil(hit, P), div_ceil(saved, P))
        if copy_back is not None:
            copy_back(hit, saved, manager.page_table[req.table_idx, hit:saved])
        req.complete_one()                     # cached_len = saved; the next step computes from there
    except BaseException:
        manager.release_req(req)               # frees what allocate_paged mapped, unlocks the hit
        raise
    return saved - hit
