"""Chapter 12's swap exercises: ``kvlab.check.resume_plan(fn)`` and ``kvlab.check.swap_out(fn)``.

``resume_plan``: ``fn(how, saved, hit, input_len, host_pages, row, page_size) -> (copies, compute)``
for a request coming back after a stop: it had positions ``[0, saved)`` computed; its input is
``input_len`` tokens; the prefix cache now holds its first ``hit`` (whole pages, already in
``row``, the new page-table row: one device slot per position); ``host_pages[i]`` holds its
positions ``[i*P, (i+1)*P)`` (swap only), and host page ``h`` is host slots ``[h*P, (h+1)*P)``, as a
device page is device slots. ``copies``: ``(host slot, device slot)`` per position copied back,
in position order (``how="swap"``: ``[hit, saved)``; otherwise none); ``compute``:
``(start, end)``, the positions a prefill computes (swap: from ``max(saved, hit)``; otherwise
from ``hit``; always to ``input_len``). Nothing the cache holds is copied or computed again.
Every argument is read-only. Each case is called twice: the second time with the same numbers
and other pages (another request coming back), so an answer kept from call to call shows.

``swap_out``: ``fn(manager, req, pool, host) -> pages``: copy the K/V of ``req``'s row, positions
``[0, req.cached_len)`` of every layer, into host pages from ``host.take(n)`` (page ``i`` holds
positions ``[i*P, (i+1)*P)``: ``host.k[page, :, i]`` is ``pool.k[:, slot]``, likewise ``v``), then
give its device pages back with ``manager.release_req(req)``, once; return the pages. The
checker hands the freed pages to someone else at once (their K/V is overwritten); its host pages
hold what an earlier swap-out left there (host pages are reused uncleared); it compares the host
copies position by position, the host pages taken, the device pool (a swap-out only reads it:
the cached prefix is shared with another running request), the free list (a page in it twice
was freed twice), the row, the prefix cache, and runs ``check_integrity()``.

Page sizes run from 1 to 16; device and host pages are shuffled, so no slot is its position and
no host page its page number by accident. Expected answers come from :mod:`kvlab.serving.pressure`.
"""
from __future__ import annotations

import random

import torch

from ...serving.pressure import resume_plan as pressure_plan
from ..checking.core import Case, CheckFailed, call_learner, exercise, run_cases
from ..checking.inputs import tree_difference, tree_state


def resume_plan_solution(how, saved, hit, input_len, host_pages, row, page_size):
    """(copies, compute) for a request coming back: what is copied, what is computed."""
    P = page_size
    copies = []
    if how == "swap":
        for pos in range(hit, saved):            # what it had computed and the cache lost
            host_slot = host_pages[pos // P] * P + pos % P
            copies.append((host_slot, row[pos]))
        start = max(saved, hit)                  # the rest is computed: its last token at least
    else:
        start = hit                              # recompute everything the cache does not hold
    return copies, (start, input_len)


def _pages(rng: random.Random, input_len: int, saved: int, P: int) -> tuple[list[int], list[int]]:
    """``(row, host_pages)``: a row on shuffled device pages (never page 0 first), shuffled host pages."""
    device = rng.sample(range(3, 60), -(-input_len // P))
    return [device[p // P] * P + p % P for p in range(input_len)], rng.sample(range(1, 40), -(-saved // P))


def _plan_cases(seed: int, n_random: int) -> list[Case]:
    rng = random.Random(seed)

    def case(name, how, saved, hit, input_len, P, kind="edge"):
        row, host = _pages(rng, input_len, saved, P)
        again = _pages(rng, input_len, saved, P)       # the second call's: the same numbers, other pages
        return Case(name, dict(how=how, saved=saved, hit=hit, input_len=input_len, host_pages=host,
                               row=row, P=P, again=again), kind)

    cases = [
        case("swap: copy back what the cache lost", "swap", 15, 8, 16, 4),
        case("swap: nothing cached any more", "swap", 15, 0, 16, 4),
        case("swap: the cache holds everything it had", "swap", 12, 12, 13, 4),
        case("swap: a prompt stopped between chunks (it had computed 6 of 21)", "swap", 6, 4, 21, 2),
        case("swap: the cache holds more than it had computed", "swap", 5, 8, 20, 4),
        case("recompute: from the cache hit to the end", "recompute", 15, 8, 16, 4),
        case("retract: nothing cached", "retract", 9, 0, 10, 1),
        case("page_size 1", "swap", 9, 3, 10, 1),
        case("page_size 16, two pages cached", "swap", 40, 32, 41, 16),
    ]
    for i in range(n_random):
        P = rng.choice([1, 2, 4, 8, 16])
        input_len = rng.randint(2, 60)
        saved = rng.randint(1, input_len - 1)
        hit = rng.randint(0, (input_len - 1) // P) * P
        how = rng.choice(["swap", "swap", "recompute", "retract"])
        cases.append(case(f"random {i + 1} ({how}, page_size {P})", how, saved, hit, input_len, P, "random"))
    return cases


@exercise(
    "resume_plan",
    chapter="12",
    hints=[
        "Positions [0, hit) are in the prefix cache and already in the new row: never copy or compute "
        "them. A swapped request copies [hit, saved) back and computes the rest; any other one "
        "computes everything from hit.",
        "Host slot of position p: host_pages[p // P] * P + p % P (host page i holds positions "
        "[i*P, (i+1)*P)). Device slot of position p: row[p]. Pair them for p in range(hit, saved).",
        "compute = (max(saved, hit), input_len) for a swap, (hit, input_len) otherwise: the last "
        "position was never computed, so something is always computed.",
    ],
    solution=resume_plan_solution,
)
def resume_plan(fn, *, seed: int = 0, n_random: int = 10) -> int:
    """Check ``fn(how, saved, hit, input_len, host_pages, row, page_size) -> (copies, compute)``."""

    def run_one(case: Case) -> None:
        first = _one_plan(fn, case, case.args["row"], case.args["host_pages"])
        _one_plan(fn, case, *case.args["again"], first=first)

    return run_cases("resume_plan", _plan_cases(seed, n_random), run_one)


def _one_plan(fn, case: Case, row: list[int], host: list[int], first: list | None = None) -> list:
    """One call with ``row`` and ``host`` (pages), checked; returns its copies. ``first``: the
    copies of the case's first call, when this is the second (the same numbers, other pages)."""
    a = case.args
    P, hit, saved = a["P"], a["hit"], a["saved"]
    plan = pressure_plan(a["how"], saved=saved, hit=hit, input_len=a["input_len"])
    want_copies = [(host[p // P] * P + p % P, row[p]) for p in range(*plan.copy)]
    got = call_learner(fn, a["how"], saved, hit, a["input_len"], list(host), list(row), P, read_only=(4, 5))
    where = (f"\n  how={a['how']!r}, saved={saved}, hit={hit}, input_len={a['input_len']}, page_size {P}, "
             f"host_pages={host}")
    if first is not None:
        where = ("\n  (called a second time with the same numbers and other pages: another request coming "
                 "back)" + where)
    try:
        copies, compute = got
        copies, compute = [tuple(c) for c in copies], tuple(compute)
    except (TypeError, ValueError):
        raise CheckFailed(f"[{case.name}] return (copies, compute): a list of (host slot, device slot) "
                          f"pairs and a (start, end) pair; got {got!r}"[:300] + where, case=case.name) from None
    if compute != plan.compute:
        why = ""
        if compute[0] < hit:
            why = (f" -- it computes positions [{compute[0]}, {hit}) again, which the prefix cache still "
                   "holds (they are already in the row)")
        elif a["how"] == "swap" and compute[0] == hit < saved:
            why = f" -- positions [{hit}, {saved}) come back from host memory: computing them is the recompute the swap avoids"
        raise CheckFailed(f"[{case.name}] compute should be {plan.compute}, got {compute}{why}{where}",
                          case=case.name, label="compute")
    if copies == want_copies:
        return copies
    if first is not None and copies == first:
        raise CheckFailed(f"[{case.name}] the second call returned the first call's copies {copies[:4]}...: an "
                          "answer kept from call to call (a cache keyed on the numbers, a global) restores "
                          "into another request's slots. The slots come from this call's host_pages and row: "
                          f"host page h is host slots [h*P, (h+1)*P){where}", case=case.name,
                          expected=want_copies, got=copies, label="second call")
    if len(copies) != len(want_copies):
        why = ""
        if a["how"] != "swap":
            why = " -- only a swapped request has anything in host memory"
        elif len(copies) > len(want_copies) and hit > 0:
            why = (f" -- positions [0, {hit}) are in the prefix cache: copying them back is work thrown "
                   "away (and the row already points at the cached pages)")
        raise CheckFailed(f"[{case.name}] {len(want_copies)} position(s) to copy back ([{plan.copy[0]}, "
                          f"{plan.copy[1]})), got {len(copies)}{why}{where}", case=case.name, label="copies")
    k = next(i for i, (w, g) in enumerate(zip(want_copies, copies)) if w != g)
    pos = plan.copy[0] + k
    (h, d), (gh, gd) = want_copies[k], copies[k]
    part = "host slot" if h != gh else "device slot"
    rule = (f"host_pages[{pos} // {P}] * {P} + {pos} % {P} = {h} (host page {host[pos // P]} is host slots "
            f"[{host[pos // P] * P}, {host[pos // P] * P + P}))" if part == "host slot" else f"row[{pos}] = {d}")
    raise CheckFailed(f"[{case.name}] position {pos} is restored to the wrong slot: its {part} should be "
                      f"{rule}, got {gh if part == 'host slot' else gd}{where}", case=case.name,
                      expected=want_copies, got=copies, label=f"position {pos}")


# --- swap_out -------------------------------------------------------------------------------


def swap_out_solution(manager, req, pool, host):
    """Copy the request's row (positions [0, cached_len)) to host pages, then release it."""
    P = host.page_size
    n = req.cached_len
    slots = manager.page_table[req.table_idx, :n].long()
    pages = host.take(-(-n // P))                        # one host page per P positions
    for i, page in enumerate(pages):
        part = slots[i * P:(i + 1) * P]
        host.k[page, :, : len(part)] = pool.k[:, part]   # every layer of those positions
        host.v[page, :, : len(part)] = pool.v[:, part]
    manager.release_req(req)                             # its pages back, its lock off: once
    return pages


def _swap_scene(P: int, prompt: int, decoded: int, seed: int):
    """A manager with two running requests sharing a prompt prefix; request 1 is swapped out."""
    from ...manager.cache_manager import CacheManager, Req
    from ...serving.hf.swap import HostKV
    from ...attention.kv_pool import KVPool
    from ...alloc.paging import new_page_table

    rng = random.Random(seed)
    pages = 2 * (-(-(prompt + decoded + 2) // P)) + 4
    cm = CacheManager(pages, P, new_page_table(3, pages * P, P), page_table_writer="host")
    cm.free_slots = cm.free_slots[torch.randperm(pages, generator=torch.Generator().manual_seed(seed))]
    shared = [rng.randrange(50) for _ in range(prompt // 2)]
    reqs = [Req(shared + [rng.randrange(50) for _ in range(prompt - len(shared))], table_idx=row)
            for row in (2, 0)]
    cm.complete_step(cm.prefill(reqs), [1, 2])
    for t in range(decoded):
        cm.complete_step(cm.decode_step(reqs), [3 + t, 4 + t])
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(pages * P, 2, 2, 3, device=cm.page_table.device)   # the host pool: CPU (pinned on a GPU)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    host = HostKV(pool, P, -(-(prompt + decoded) // P) + 3)
    host.free_pages = random.Random(seed + 1).sample(host.free_pages, len(host.free_pages))
    for t in (host.k, host.v):         # host pages are reused uncleared: an earlier swap's K/V
        t.copy_(torch.randn(t.shape, generator=gen) + 5.0)
    return cm, reqs[1], pool, host


def _swap_cases(seed: int, n_random: int) -> list[Case]:
    def case(name, P, prompt, decoded, s=0, kind="edge"):
        return Case(name, dict(P=P, prompt=prompt, decoded=decoded, seed=s), kind)

    cases = [case("a decoding request, pages of 4", 4, 9, 5), case("page_size 1", 1, 6, 3),
             case("its row ends on a page boundary", 4, 10, 2), case("page_size 16, one cached page", 16, 20, 6),
             case("a short request: one page", 4, 3, 1)]
    rng = random.Random(seed)
    for i in range(n_random):
        P = rng.choice([1, 2, 4, 8])
        cases.append(case(f"random {i + 1} (page_size {P})", P, rng.randint(2, 30), rng.randint(0, 9),
                          rng.randrange(1000), "random"))
    return cases


def _device_unchanged(case: Case, manager, req, pool, device: dict, row: list[int], where: str) -> None:
    """The device pool as the call found it (the freed pages as their new owner wrote them).
    ``row``: the request's slots before the call."""
    others = {int(x) for r in range(manager.page_table.shape[0]) if r != req.table_idx
              for x in manager.page_table[r].tolist() if x >= 0}
    for name in ("k", "v"):
        now, want = getattr(pool, name), device[name]
        changed = (now != want).any(-1).any(-1).any(0).nonzero().flatten().tolist()   # slots
        if not changed:
            continue
        slot = min(changed, key=lambda x: (x not in others, x))      # a shared slot first
        if slot in others:
            whose = "another running request's row maps it: they share the cached prefix, and it still reads it"
        elif bool((want[:, slot] == -99.0).all()):
            whose = "release_req had already handed its page to someone else"
        elif slot in row:
            whose = ("it is in the prefix cache, which keeps the request's whole prompt pages after "
                     "release_req: the next request that starts the same way reads them")
        else:
            whose = "it is not even in the request's row"
        raise CheckFailed(f"[{case.name}] pool.{name}[:, {slot}] changed during your swap-out ({len(changed)} "
                          f"slot(s) changed; {whose}): a swap-out only reads the device pool. Copy the "
                          f"K/V out and leave it: release_req gives the pages back{where}", case=case.name,
                          label="device pool")


@exercise(
    "swap_out",
    chapter="12",
    hints=[
        "Two things, in this order: copy, then give back. Once manager.release_req(req) returns, its "
        "pages may be handed to another request at once and overwritten.",
        "n = req.cached_len positions; slots = manager.page_table[req.table_idx, :n]; pages = "
        "host.take(ceil(n / P)). Host page i takes positions [i*P, (i+1)*P): "
        "host.k[page, :, :m] = pool.k[:, slots[i*P:(i+1)*P]] (all layers at once), and the same for v.",
        "release_req frees the request's own pages and unlocks its cached prefix, once: do not free any "
        "page by hand as well (a page in the free list twice would be handed to two requests).",
    ],
    solution=swap_out_solution,
)
def swap_out(fn, *, seed: int = 0, n_random: int = 5) -> int:
    """Check ``fn(manager, req, pool, host) -> host pages`` (a swap-out)."""

    def run_one(case: Case) -> None:
        a = case.args
        P = a["P"]
        ref_m, ref_req, ref_pool, ref_host = _swap_scene(P, a["prompt"], a["decoded"], a["seed"])
        got_m, got_req, pool, host = _swap_scene(P, a["prompt"], a["decoded"], a["seed"])
        n, row = got_req.cached_len, got_m.page_table[got_req.table_idx, : got_req.cached_len].long()
        want_k, want_v = pool.k[:, row].cpu(), pool.v[:, row].cpu()   # host pages live on the CPU
        before_free = set(host.free_pages)
        dirty_k, dirty_v = host.k.clone(), host.v.clone()
        swap_out_solution(ref_m, ref_req, ref_pool, ref_host)
        release, calls = got_m.release_req, []
        device = {"k": pool.k.clone(), "v": pool.v.clone()}   # what the pool must hold after the call

        def release_and_reuse(req):               # the freed pages go to someone else at once
            freed = release(req)
            calls.append(1)
            slots = (freed.long()[:, None] + torch.arange(P, device=freed.device)).flatten()
            pool.k[:, slots], pool.v[:, slots] = -99.0, -99.0
            device["k"][:, slots], device["v"][:, slots] = -99.0, -99.0
            return freed

        got_m.release_req = release_and_reuse
        where = f"\n  page_size {P}, request of {n} computed positions (row {got_req.table_idx})"
        pages = call_learner(fn, got_m, got_req, pool, host)
        del got_m.release_req
        taken = sorted(before_free - set(host.free_pages))
        need = -(-n // P)
        if len(taken) != need:
            why = (f" (n // P = {n // P} leaves out the last, partly filled page)" if len(taken) == n // P
                   else "")
            raise CheckFailed(f"[{case.name}] {len(taken)} host page(s) taken for {n} positions: host page i holds "
                              f"positions [i*P, (i+1)*P), so {n} positions need ceil({n} / {P}) = {need} "
                              f"page(s){why}{where}", case=case.name, label="host pages")
        if not isinstance(pages, (list, tuple)) or sorted(pages) != taken:
            raise CheckFailed(f"[{case.name}] return the {need} host page(s) host.take gave you (in position "
                              f"order); host pages taken: {taken}, returned {pages!r}{where}", case=case.name)
        free = got_m.free_slots.tolist()
        strange = [s for s in free if s < 0 or s % P or s // P >= got_m.num_pages]
        if strange:
            raise CheckFailed(f"[{case.name}] the free list holds {strange[:4]}, which are not page starts "
                              f"(page * {P}, for pages below {got_m.num_pages}){where}", case=case.name,
                              label="free list")
        dupes = sorted({s // P for s in free if free.count(s) > 1})
        if dupes or len(calls) > 1:
            raise CheckFailed(f"[{case.name}] page(s) {dupes or '(the same pages)'} freed twice: release_req "
                              "already gives the request's pages back (a page in the free list twice would be "
                              f"handed to two requests){where}", case=case.name, label="free list")
        if got_req in got_m.running:
            raise CheckFailed(f"[{case.name}] the request still holds its device pages: give them back with "
                              f"manager.release_req(req){where}", case=case.name, label="release")
        for pos in range(n):
            page, off = pages[pos // P], pos % P
            for name, host_t, want in (("k", host.k, want_k), ("v", host.v, want_v)):
                got = host_t[page, :, off]
                if not torch.equal(got, want[:, pos]):
                    dirty = (dirty_k if name == "k" else dirty_v)[page, :, off]
                    why = (" -- you copied after release_req: those pages were already someone else's"
                           if bool((got == -99.0).all()) else
                           " -- it holds what the host page held before plus the copy: host pages are reused "
                           "without being cleared (an earlier swap-out's K/V is still in them), so add nothing "
                           f"to them: assign, host.{name}[page, :, :m] = pool.{name}[:, ...]"
                           if torch.allclose(got, dirty + want[:, pos]) else "")
                    raise CheckFailed(f"[{case.name}] position {pos}: host.{name}[{page}, :, {off}] should hold "
                                      f"pool.{name}[:, {int(row[pos])}] (its slot in the row){why}{where}",
                                      case=case.name, label=f"position {pos}")
        _device_unchanged(case, got_m, got_req, pool, device, row.tolist(), where)
        owner = lambda who: getattr(who, "table_idx", who)  # noqa: E731 - a lock's owner, by its row
        why = tree_difference(tree_state(ref_m.prefix_cache, owner), tree_state(got_m.prefix_cache, owner),
                              old="should be", new="is")
        if why or not torch.equal(ref_m.page_table, got_m.page_table):
            raise CheckFailed(f"[{case.name}] the manager is not as release_req leaves it: "
                              f"{why or 'the page table differs'} (a swap-out caches nothing: release_req, "
                              f"not cache_req){where}", case=case.name, label="manager")
        if sorted(got_m.free_slots.tolist()) != sorted(ref_m.free_slots.tolist()):
            raise CheckFailed(f"[{case.name}] the free list should be {sorted(ref_m.free_slots.tolist())}, got "
                              f"{sorted(got_m.free_slots.tolist())}{where}", case=case.name, label="free list")
        got_m.check_integrity()

    return run_cases("swap_out", _swap_cases(seed, n_random), run_one)
