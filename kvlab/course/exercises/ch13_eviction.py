"""Chapter 13's first exercise: ``kvlab.check.write_back_eviction(fn)``.

``fn(nodes, need_pages, host_free, policy) -> (victims, spills)``: an eviction that frees at
least ``need_pages`` device pages from a tiered tree (``nodes``: a list of
:class:`kvlab.prefix.tier_plans.TierNode`, read-only). ``victims``: ``(uid, action)`` pairs in
eviction order -- nodes on the device, unlocked, none of whose children is still on the device,
least recently used ``(last_access, uid)`` first, until enough pages are freed; ``"drop"`` for a
clean one (it has host pages: the device copy goes, the host copy stays), ``"copy"`` for a dirty
one under ``"write_back"`` while host memory has room, else ``"forget"``. ``spills``: host-only
leaves (not pinned by a load-back in flight), least recently used first, whose host pages make
room for the copies beyond ``host_free``; the copies take the room in eviction order.

The trees are built so that no right answer is right by accident: nodes listed out of order,
last accesses that disagree with the uids, locked paths, pinned leaves, clean and dirty nodes on
both sides of every choice. Expected answers come from :mod:`kvlab.course.reference.hierarchy_ref`.
"""
from __future__ import annotations

import random

from ...prefix.tier_plans import TierNode
from ..checking.answers import expect_parts
from ..checking.core import Case, CheckFailed, call_learner, exercise, run_cases
from ..reference.hierarchy_ref import eviction_plan_ref


def write_back_eviction_solution(nodes, need_pages, host_free, policy):
    """(victims, spills) of an eviction that frees need_pages device pages."""
    children = {}
    for n in nodes:
        children.setdefault(n.parent, []).append(n)
    on_device = {n.uid for n in nodes if n.device_pages}
    victims, chosen, freed = [], set(), 0
    while freed < need_pages:            # LRU device leaves: unlocked, no child still on the device
        candidates = [n for n in nodes if n.uid in on_device and n.uid not in chosen and n.ref_count == 0
                      and all(c.uid not in on_device or c.uid in chosen for c in children.get(n.uid, []))]
        if not candidates:
            break
        victim = min(candidates, key=lambda n: (n.last_access, n.uid))
        victims.append(victim)
        chosen.add(victim.uid)
        freed += victim.num_pages
    want = sum(v.num_pages for v in victims if not v.host_pages) if policy == "write_back" else 0
    spills, gone, room = [], set(), host_free
    while room < want:                   # host room: the oldest host-only leaves no load-back reads
        leaves = [n for n in nodes if n.uid not in on_device and n.host_pages and not n.pinned
                  and n.uid not in gone and all(c.uid in gone for c in children.get(n.uid, []))]
        if not leaves:
            break
        leaf = min(leaves, key=lambda n: (n.last_access, n.uid))
        gone.add(leaf.uid)
        spills.append(leaf.uid)
        room += leaf.num_pages
    actions = []
    for v in victims:
        if v.host_pages:                 # clean: its host copy stays, the device copy goes
            actions.append((v.uid, "drop"))
        elif policy == "write_back" and v.num_pages <= room:
            room -= v.num_pages          # dirty: copied to host memory before its pages go
            actions.append((v.uid, "copy"))
        else:
            actions.append((v.uid, "forget"))
    return actions, spills


def _tree(rng: random.Random, n: int, *, host_share=0.5, pinned=0.2, locked=0.15) -> list[TierNode]:
    """A random tiered tree: the device part closed under parents, every node somewhere."""
    nodes: list[TierNode] = []
    for uid in range(n):
        parent = rng.choice([None] + [x.uid for x in nodes])
        dev_ok = parent is None or bool(nodes[parent].device_pages)
        dev = dev_ok and rng.random() < 0.65
        host = not dev or rng.random() < host_share
        pages = rng.randint(1, 3)
        dp = tuple(rng.sample(range(40), pages)) if dev else ()
        hp = tuple(rng.sample(range(40), pages)) if host else ()
        nodes.append(TierNode(uid, parent, pages, dp, hp, 0, rng.randrange(30), (not dev) and rng.random() < pinned))
    locks = [x.uid for x in nodes if x.device_pages and rng.random() < locked]
    count = {x.uid: 0 for x in nodes}
    for uid in locks:
        at = uid
        while at is not None:
            count[at] += 1
            at = nodes[at].parent
    nodes = [x._replace(ref_count=count[x.uid]) for x in nodes]
    rng.shuffle(nodes)
    return nodes


def _node(uid, parent, pages, dev, host, *, ref=0, t=0, pinned=False) -> TierNode:
    return TierNode(uid, parent, pages, tuple(range(100 + uid * 4, 100 + uid * 4 + pages)) if dev else (),
                    tuple(range(uid * 4, uid * 4 + pages)) if host else (), ref, t, pinned)


def _cases(seed: int, n_random: int) -> list[Case]:
    def case(name, nodes, need, free, policy="write_back", kind="edge"):
        return Case(name, dict(nodes=nodes, need=need, free=free, policy=policy), kind)

    chain = [_node(3, None, 2, True, True, t=5), _node(1, 3, 1, True, False, t=2), _node(4, 1, 1, False, True, t=1)]
    cases = [
        case("a clean leaf: drop it, its host copy stays", [_node(2, None, 2, True, True, t=3)], 1, 0),
        case("a dirty leaf under write_back: copy it first", [_node(5, None, 2, True, False, t=3)], 1, 4),
        case("a dirty leaf under write_through: forget it", [_node(5, None, 2, True, False, t=3)], 1, 4,
             "write_through"),
        case("a child on the device goes before its parent", chain, 3, 4),
        case("least recently used first (not the smallest uid)",
             [_node(1, None, 1, True, False, t=9), _node(7, None, 1, True, True, t=2),
              _node(4, None, 1, True, False, t=5)], 2, 3),
        case("a locked path is never evicted",
             [_node(2, None, 1, True, False, ref=1, t=0), _node(6, 2, 1, True, True, ref=1, t=1),
              _node(9, None, 2, True, False, t=8)], 1, 2),
        case("whole nodes: one of three pages frees three", [_node(8, None, 3, True, False, t=1),
                                                            _node(2, None, 1, True, False, t=4)], 1, 9),
        case("host full: spill the oldest host-only leaf -- never one a load-back reads",
             [_node(1, None, 2, True, False, t=6), _node(5, None, 1, False, True, t=0, pinned=True),
              _node(3, None, 2, False, True, t=2), _node(6, None, 1, False, True, t=4)], 2, 0),
        case("not enough room even after spilling: the first copies take it",
             [_node(4, None, 2, True, False, t=1), _node(2, None, 2, True, False, t=3),
              _node(7, None, 1, False, True, t=0)], 4, 1),
        case("a parent is spilled only after its children",
             [_node(1, None, 1, False, True, t=0), _node(2, 1, 1, False, True, t=3), _node(4, None, 1, True, False, t=5)],
             1, 0),
        case("nothing evictable: evict what can be", [_node(3, None, 2, True, False, ref=1)], 2, 0),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        nodes = _tree(rng, rng.randint(3, 10))
        policy = ("write_back", "write_back", "write_through", "write_through_selective")[i % 4]
        cases.append(case(f"random {i + 1} ({policy}, {len(nodes)} nodes)", nodes, rng.randint(1, 8),
                          rng.randint(0, 4), policy, "random"))
    return cases


def _why(nodes, a, got, want) -> str:
    """What the first wrong victim or spill breaks, in the exercise's words."""
    by = {n.uid: n for n in nodes}
    kids = {}
    for n in nodes:
        kids.setdefault(n.parent, []).append(n.uid)
    for k, ((uid, act), w) in enumerate(zip(got[0], want[0] + ((None, None),) * len(got[0]))):
        if (uid, act) == w:
            continue
        n = by.get(uid)
        if n is None:
            return f"victim {k}: there is no node {uid!r}"
        if not n.device_pages:
            return f"victim {k}: node {uid} is not on the device (it frees no device page)"
        if n.ref_count:
            return f"victim {k}: node {uid} is locked (ref_count {n.ref_count}): a running request reads it"
        earlier = {u for u, _ in got[0][:k]}
        below = [c for c in kids.get(uid, []) if by[c].device_pages and c not in earlier]
        if below:
            return f"victim {k}: node {uid} still has child {below[0]} on the device: children go first"
        if act == "drop" and not n.host_pages:
            return (f"victim {k}: node {uid} is dirty (no host copy) and you drop it: its K/V is lost -- "
                    f"{'a write-back eviction must copy it first' if a['policy'] == 'write_back' else 'say forget'}")
        if act == "copy" and n.host_pages:
            return f"victim {k}: node {uid} is clean (it has its host copy): drop it, copying it again wastes the link"
        if act == "copy" and a["policy"] != "write_back":
            return f"victim {k}: node {uid} is dirty, but under {a['policy']!r} nothing is copied at eviction: forget it"
        if w[0] is not None and w[0] != uid:
            return (f"victim {k}: node {w[0]} goes first (last_access {by[w[0]].last_access}, uid {w[0]}), "
                    f"not node {uid} (last_access {n.last_access})")
        return f"victim {k}: node {uid} should be {w[1]!r}, got {act!r}"
    if len(got[0]) < len(want[0]):
        return f"{len(got[0])} victim(s) free too few pages: {a['need']} are needed and more can be evicted"
    for k, uid in enumerate(got[1]):
        n = by.get(uid)
        if n is not None and n.pinned:
            return (f"spill {k}: node {uid}'s host pages are read by a load-back in flight (pinned): freeing them "
                    "now lets the next copy overwrite what it reads")
        if n is None or n.device_pages or not n.host_pages:
            return f"spill {k}: node {uid} is not a host-only node (only those are spilled)"
        if k >= len(want[1]):
            return f"spill {k}: node {uid} is not needed: the copies fit already (spill only what they need)"
        if uid != want[1][k]:
            return f"spill {k}: node {want[1][k]} goes first (the oldest host-only leaf), not node {uid}"
    return f"{len(got[1])} spill(s), {len(want[1])} expected"


@exercise(
    "write_back_eviction",
    chapter="13",
    hints=[
        "Victims first, as chapter 05's eviction: among the nodes with device_pages, ref_count == 0 and no "
        "child still on the device (children chosen before count as gone), take the smallest "
        "(last_access, uid), again and again, until the pages freed reach need_pages.",
        "Then the host room: the dirty victims (no host_pages) need their pages under write_back. Count "
        "host_free, and while it is short spill host-only leaves (no device_pages, no child left, not "
        "pinned), oldest first.",
        "Last, each victim's action in eviction order: host_pages -> 'drop'; dirty and write_back with room "
        "left -> 'copy' (it takes the room); otherwise 'forget'.",
    ],
    solution=write_back_eviction_solution,
    order=1,
)
def write_back_eviction(fn, *, seed: int = 0, n_random: int = 16) -> int:
    """Check ``fn(nodes, need_pages, host_free, policy) -> (victims, spills)``."""

    def run_one(case: Case) -> None:
        a = case.args
        want = eviction_plan_ref(a["nodes"], a["need"], a["free"], a["policy"])
        want = (tuple(want.victims), tuple(want.spills))
        got = call_learner(fn, list(a["nodes"]), a["need"], a["free"], a["policy"], read_only=(0,))
        victims, spills = expect_parts(case.name, got, ("victims", "spills"))
        try:
            got = (tuple((int(u), str(x)) for u, x in victims), tuple(int(u) for u in spills))
        except (TypeError, ValueError):
            raise CheckFailed(f"[{case.name}] victims: (uid, action) pairs; spills: uids; got {victims!r}, "
                              f"{spills!r}"[:300], case=case.name) from None
        if got != want:
            where = (f"\n  need_pages={a['need']}, host_free={a['free']}, policy={a['policy']!r}; nodes: "
                     + ", ".join(f"{n.uid}({'dev' if n.device_pages else ''}{'+' if n.device_pages and n.host_pages else ''}"
                                 f"{'host' if n.host_pages else ''}{', locked' if n.ref_count else ''}"
                                 f"{', pinned' if n.pinned else ''}, t={n.last_access}, parent {n.parent})"
                                 for n in sorted(a["nodes"], key=lambda n: n.uid)))
            raise CheckFailed(f"[{case.name}] {_why(a['nodes'], a, got, want)}{where}"[:1500], case=case.name,
                              expected=want, got=got, label="eviction")

    return run_cases("write_back_eviction", _cases(seed, n_random), run_one)
