"""Every rule a simulator run must satisfy, checked before its first step (chapters 07, 12).

A bad configuration or a workload that could never finish is refused up front with
:class:`~kvlab.base.errors.InvalidArgument` naming the field and the rule, instead of failing deep
inside a step or idling until ``max_steps``:

* every :class:`~kvlab.serving.sim.SimConfig` field has its type (an int is not a bool or a float,
  ``prefill_budget=nan`` is not "no budget") and its range;
* a workload has at least one request, rids ``0..n-1``; each request arrives at a finite
  step before ``max_steps`` (or that many steps after the request it follows, which must be
  another request of the workload, with no cycle of them waiting for each other);
* each request fits memory and a page-table row alone, its whole answer included
  (``max_new_tokens``, which a reservation must be able to hold).
"""
from __future__ import annotations

from ...base.args import check_int, check_page_size, check_real, div_ceil, is_int
from ...base.errors import InvalidArgument
from ..pressure import Policy, make_policy
from .caches import PREFIX_CACHES
from .config import SimConfig
from .workloads import RequestSpec, Workload

__all__ = ["check_config", "check_workload"]

_INTS = {"page_size": 1, "num_pages": 1, "max_running": 1, "prefill_budget": 1, "max_steps": 1}
_BOOLS = ("cache_after_prefill", "chunked_prefill", "remap_duplicates")


def check_config(config) -> Policy:
    """Every field of a ``SimConfig``; returns its policy (a :class:`kvlab.serving.pressure.Policy`)."""
    if not isinstance(config, SimConfig):
        raise InvalidArgument("config", "a kvlab.serving.sim.SimConfig", f"got {type(config).__name__}")
    for name, minimum in _INTS.items():
        if name == "page_size":
            check_page_size(config.page_size, "config.page_size")
        else:
            check_int(f"config.{name}", getattr(config, name), minimum=minimum)
    if config.max_seq_len is not None:
        check_int("config.max_seq_len", config.max_seq_len, minimum=1)
    for name in _BOOLS:
        if not isinstance(getattr(config, name), bool):
            raise InvalidArgument(f"config.{name}", "True or False", f"got {getattr(config, name)!r}")
    if config.page_table_writer not in ("host", "triton"):
        raise InvalidArgument("config.page_table_writer", 'one of "host", "triton"',
                              f"got {config.page_table_writer!r}")
    if config.prefix_cache not in PREFIX_CACHES:
        raise InvalidArgument("config.prefix_cache", f"one of {PREFIX_CACHES}", f"got {config.prefix_cache!r}")
    return make_policy(config.policy, "config.policy")


def _max_new(spec) -> int:
    return len(spec.output) if spec.max_new_tokens is None else spec.max_new_tokens


def check_workload(workload, config) -> int:
    """Every request of ``workload`` against ``config``; returns the row length to use."""
    if not isinstance(workload, Workload):
        raise InvalidArgument("workload", "a kvlab.serving.sim.Workload", f"got {type(workload).__name__}")
    reqs = workload.requests
    if not isinstance(reqs, tuple) or not reqs:
        raise InvalidArgument("workload.requests", "a tuple of at least one RequestSpec",
                              f"got {reqs!r}" if not reqs else f"got {type(reqs).__name__}")
    for i, r in enumerate(reqs):
        if not isinstance(r, RequestSpec):
            raise InvalidArgument(f"workload.requests[{i}]", "a kvlab.serving.sim.RequestSpec",
                                  f"got {type(r).__name__}")
    rids = [r.rid for r in reqs]
    if any(not is_int(x) for x in rids) or sorted(rids) != list(range(len(rids))):
        raise InvalidArgument("workload.requests", "rids 0..n-1, each once", f"got {rids}")
    P, steps = config.page_size, config.max_steps
    for r in reqs:
        name = f"workload request {r.rid}"
        for part in ("prompt", "output"):
            ids = getattr(r, part)
            if not isinstance(ids, tuple) or not ids or not all(is_int(t) and t >= 0 for t in ids):
                raise InvalidArgument(f"{name}.{part}", "a tuple of >= 1 token ids (ints >= 0)",
                                      f"got {ids!r}"[:120])
        check_real(f"{name}.arrival", r.arrival, below=steps)
        if r.after is not None and (not is_int(r.after) or r.after == r.rid or not 0 <= r.after < len(reqs)):
            raise InvalidArgument(f"{name}.after", "None or the rid of another request of the workload",
                                  f"got {r.after!r}")
        if r.abort_after is not None:
            check_int(f"{name}.abort_after", r.abort_after, minimum=1)
        if r.max_new_tokens is not None:
            check_int(f"{name}.max_new_tokens", r.max_new_tokens, minimum=len(r.output))
    _check_no_cycle(reqs)
    max_seq_len = config.max_seq_len or max(len(r.prompt) + _max_new(r) for r in reqs)
    for r in reqs:
        total = len(r.prompt) + _max_new(r)
        if total > max_seq_len:
            raise InvalidArgument(f"workload request {r.rid}",
                                  f"prompt + max_new_tokens <= max_seq_len={max_seq_len}", f"got {total}")
        if div_ceil(total, P) > config.num_pages:
            raise InvalidArgument(
                f"workload request {r.rid}",
                f"must fit in memory alone: div_ceil(len, P) <= num_pages={config.num_pages}",
                f"needs {div_ceil(total, P)} pages")
    return max_seq_len


def _check_no_cycle(reqs) -> None:
    """A request that follows (``after``) a request that follows it back never arrives."""
    after = {r.rid: r.after for r in reqs}
    for r in reqs:
        seen, rid = {r.rid}, after[r.rid]
        while rid is not None:
            if rid in seen:
                raise InvalidArgument(f"workload request {r.rid}.after",
                                      "no cycle of requests waiting for each other",
                                      f"request {rid} waits, through its chain, for itself")
            seen.add(rid)
            rid = after[rid]
