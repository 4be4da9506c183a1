"""Chapter 13's second exercise: ``kvlab.check.load_back_plan(fn)``.

``fn(path, free_slots, page_size) -> (device_pages, copies, slots)``: the load-back of a match
along ``path`` (the matched nodes, root first, :class:`kvlab.prefix.tier_plans.TierNode`; those
on the device first, then nodes whose pages are in host memory only). Each host page of the
host-only nodes is copied into a device page taken from the **front** of ``free_slots``, the
cache manager's free list, which holds the *first slot* of each free page (``page *
page_size``). ``device_pages``: the pages taken, in order; ``copies``: ``(host page, device
page)`` per page, in position order; ``slots``: the request's row for the loaded positions (every
slot of those device pages, in order). ``path`` and ``free_slots`` are read-only.

Free lists are shuffled and never start at page 0, page numbers of the two tiers overlap, and
every page that is not free belongs to somebody the checker can name (a node, a running row),
so a page taken from the wrong place is told as whose it is. Expected answers come from
:mod:`kvlab.course.reference.hierarchy_ref`.
"""
from __future__ import annotations

import random

from ...prefix.tier_plans import TierNode
from ..checking.answers import expect_ints, expect_parts
from ..checking.core import Case, CheckFailed, call_learner, exercise, run_cases
from ..reference.hierarchy_ref import load_back_plan_ref


def load_back_plan_solution(path, free_slots, page_size):
    """(device_pages, copies, slots) of a load-back along path."""
    host_pages = []
    for node in path:
        if node.device_pages:            # on the device already: a hit as it is
            continue
        if not node.host_pages:
            break
        host_pages.extend(node.host_pages)
    taken = [slot // page_size for slot in free_slots[:len(host_pages)]]   # page starts -> page ids
    copies = list(zip(host_pages, taken))
    slots = [page * page_size + i for page in taken for i in range(page_size)]
    return taken, copies, slots


POOL = 48   # device pages in every scene


def _scene(rng: random.Random, P: int, device_nodes: int, host_nodes: int, pages_per_node=(1, 3),
           num_pages: int = POOL):
    """A path (device nodes, then host-only ones), the free list, and who holds every other page."""
    pool = rng.sample(range(1, num_pages), num_pages - 1)          # page 0 held by a row, never free first
    owners, path, parent = {0: "running row 2"}, [], None
    for uid in range(device_nodes + host_nodes):
        n = rng.randint(*pages_per_node)
        on_device = uid < device_nodes
        dev = tuple(pool.pop() for _ in range(n)) if on_device else ()
        for p in dev:
            owners[p] = f"node {uid + 10} (on the path)"
        host = tuple(rng.sample(range(60), n)) if (not on_device or rng.random() < 0.5) else ()
        path.append(TierNode(uid + 10, parent, n, dev, host, 1 if on_device else 0, rng.randrange(20)))
        parent = uid + 10
    for p in [pool.pop() for _ in range(rng.randint(2, 6))]:
        owners[p] = rng.choice(["node 3 (another prefix)", "running row 1", "node 7 (another prefix)"])
    free_slots = [p * P for p in pool]
    return path, free_slots, owners


def _cases(seed: int, n_random: int) -> list[Case]:
    rng = random.Random(seed)

    def case(name, P, dev, host, kind="edge", pages=(1, 3), slot_lands_on_owner=False):
        while True:
            path, free, owners = _scene(rng, P, dev, host, pages)
            loads = sum(len(n.host_pages) for n in path if not n.device_pages)
            if not slot_lands_on_owner or (loads and free[0] in owners):
                return Case(name, dict(path=path, free=free, P=P, owners=owners), kind)

    cases = [case("pages of 2: a free slot is not a free page", 2, 1, 2, slot_lands_on_owner=True),
             case("one host-only node after one on the device", 4, 1, 1),
             case("everything on the device: nothing to load", 4, 2, 0),
             case("nothing on the device: the whole match comes back", 4, 0, 2),
             case("page_size 1", 1, 1, 2),
             case("page_size 16, three host-only nodes", 16, 1, 3),
             case("nodes on the device that also have host copies", 2, 3, 1)]
    for i in range(n_random):
        P = rng.choice([1, 2, 4, 8, 16])
        cases.append(case(f"random {i + 1} (page_size {P})", P, rng.randint(0, 3), rng.randint(0, 3), "random"))
    return cases


@exercise(
    "load_back_plan",
    chapter="13",
    hints=[
        "Walk the path: skip the nodes with device_pages (they are hits already); every page of the "
        "host-only nodes after them is loaded, in order: host_pages of each node, node after node.",
        "free_slots holds the first SLOT of each free page (page * page_size), not the page: take the "
        "first len(host pages) of them and divide by page_size. A slot number used as a page is some "
        "other page -- one that may belong to a node or a running request.",
        "copies pairs the i-th host page with the i-th page taken; slots lists page * page_size + j "
        "for j in range(page_size), page by page.",
    ],
    solution=load_back_plan_solution,
    order=2,
)
def load_back_plan(fn, *, seed: int = 0, n_random: int = 10) -> int:
    """Check ``fn(path, free_slots, page_size) -> (device_pages, copies, slots)``."""

    def run_one(case: Case) -> None:
        a = case.args
        P, path, free, owners = a["P"], a["path"], a["free"], a["owners"]
        want = load_back_plan_ref(path, free, P)
        got = call_learner(fn, list(path), list(free), P, read_only=(0, 1))
        pages, copies, slots = expect_parts(case.name, got, ("device_pages", "copies", "slots"))
        pages = expect_ints(case.name, "device_pages", pages, (list, tuple))
        slots = expect_ints(case.name, "slots", slots, (list, tuple), "one device slot per loaded position")
        try:
            copies = [(int(h), int(d)) for h, d in copies]
        except (TypeError, ValueError):
            raise CheckFailed(f"[{case.name}] copies: (host page, device page) pairs; got {copies!r}"[:300],
                              case=case.name) from None
        where = (f"\n  page_size {P}; path: " + ", ".join(
            f"node {n.uid} ({'device ' + str(list(n.device_pages)) if n.device_pages else 'host ' + str(list(n.host_pages))})"
            for n in path) + f"; free_slots {free[:8]}{' ...' if len(free) > 8 else ''}")
        free_pages = {s // P for s in free}
        for p in pages:
            if p not in free_pages:
                hint = (f" ({p} is a slot: the page starting there is {p // P})"
                        if P > 1 and p % P == 0 and p // P in free_pages else "")
                what = (f"device page {p} does not exist (the pool has {POOL} pages)" if not 0 <= p < POOL else
                        f"device page {p} is not free: it holds {owners[p]}'s K/V -- a load-back into pages "
                        "still owned by someone else")
                raise CheckFailed(f"[{case.name}] {what}{hint}{where}", case=case.name, label="device pages")
        if len(pages) != len(want.device_pages):
            n_host = len(want.device_pages)
            on_device = [n for n in path if n.device_pages]
            extra = ""
            if on_device and len(pages) > n_host:
                extra = " -- the nodes on the device are hits already: loading them again copies what is there"
            elif on_device and len(pages) < n_host:
                extra = (f" -- the nodes on the device are hits already: skip them (node {on_device[0].uid} "
                         "has no host copy, but that ends nothing), then load every host-only node after them")
            raise CheckFailed(f"[{case.name}] {n_host} page(s) to load (every host page of the host-only nodes), "
                              f"got {len(pages)}{extra}{where}", case=case.name, label="device pages")
        if tuple(pages) != want.device_pages:
            raise CheckFailed(f"[{case.name}] the pages come from the front of the free list, in order: "
                              f"{list(want.device_pages)}, got {list(pages)}{where}", case=case.name,
                              expected=list(want.device_pages), got=list(pages), label="device pages")
        if tuple(copies) != want.copies:
            k = next((i for i, (w, g) in enumerate(zip(want.copies, copies)) if w != g), len(copies))
            raise CheckFailed(f"[{case.name}] copy {k}: expected (host page, device page) {want.copies[k] if k < len(want.copies) else None}, "
                              f"got {copies[k] if k < len(copies) else None} (the i-th host page of the path goes "
                              f"to the i-th page taken){where}", case=case.name, label=f"copy {k}")
        if tuple(slots) != want.slots:
            k = next((i for i, (w, g) in enumerate(zip(want.slots, slots)) if w != g), min(len(slots), len(want.slots)))
            raise CheckFailed(f"[{case.name}] slots: position {k} of the load should be slot "
                              f"{want.slots[k] if k < len(want.slots) else '(none)'}, got "
                              f"{slots[k] if k < len(slots) else '(none)'} ({len(want.slots)} slots: page * "
                              f"{P} + j for each page taken){where}", case=case.name, label="slots")

    return run_cases("load_back_plan", _cases(seed, n_random), run_one)
