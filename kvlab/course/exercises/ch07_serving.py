"""Chapter 07's exercise: ``kvlab.check.decode_step(fn)``.

The learner writes one decode step of the serving loop::

    fn(manager, reqs, next_tokens, done) -> None

For running requests ``reqs`` (each has ``cached_len == device_len - 1``: its last token's KV
is what this step computes), ``fn`` must map a new page for every request that crosses a
page boundary (one ``manager.allocate_paged(reqs)``), then for each request record the token
the step produced (``req.append_token``) and advance it (``req.complete_one``), and hand the
requests marked ``done`` back with ``manager.cache_req(req, finished=True)``.

The checker builds the same scenario twice (prefill through the real CacheManager, then a
few reference decode steps), runs the reference (the manager's own ``decode_step`` and
``complete_step``) on one copy and ``fn`` on the other, and
compares the page table, the free list, every request's lengths and tokens, the whole prefix
cache (nodes, locks, LRU stamps and the clock: a stray match or insert shows), and finally runs
``check_integrity()`` on the learner's manager. ``next_tokens`` and ``done`` are read-only. The
calls the learner makes are logged, so a step in the wrong order, or a handle the learner
unlocked before ``cache_req``, is named with the request.
"""
from __future__ import annotations

import random

import torch

from ..checking.core import Case, CheckFailed, call_learner, exercise, run_cases
from ..checking.inputs import tree_difference, tree_state


def decode_step_solution(manager, reqs, next_tokens, done):
    """One decode step: pages first, then advance every request, then finish the done ones."""
    manager.allocate_paged(reqs)          # a new page where cached_len sits on a page boundary
    for req, token in zip(reqs, next_tokens):
        req.append_token(token)           # the token this step produced
        req.complete_one()                # cached_len = device_len; device_len += 1
    for req, finished in zip(reqs, done):
        if finished:
            manager.cache_req(req, finished=True)


def _scenario(P: int, prompt_lens: list[int], warmup: int, seed: int, num_pages: int | None):
    """A manager with running requests, each prefilled and ``warmup`` decode steps in, built
    with the manager's own serving words (``prefill`` / ``decode_step`` / ``complete_step``).
    The requests' rows are shuffled, so request ``i`` is not row ``i`` by accident."""
    from ...manager.cache_manager import CacheManager, Req
    from ...alloc.paging import div_ceil, new_page_table

    rng = random.Random(seed)
    longest = max(prompt_lens) + warmup + 2
    pages = num_pages or sum(div_ceil(n + warmup + 2, P) for n in prompt_lens) + 2
    table = new_page_table(len(prompt_lens), longest, P, device="cpu")
    manager = CacheManager(pages, P, table, page_table_writer="host")
    shared = [rng.randrange(50) for _ in range(min(prompt_lens))]
    rows = random.Random(seed + 1).sample(range(len(prompt_lens)), len(prompt_lens))  # not 0, 1, ...
    reqs = []
    for i, n in enumerate(prompt_lens):
        ids = shared[: n // 2] + [rng.randrange(50) for _ in range(n - n // 2)]
        reqs.append(Req(ids, table_idx=rows[i]))
    batch = manager.prefill(reqs)
    manager.complete_step(batch, [rng.randrange(50) for _ in reqs])  # caches each prompt too
    for _ in range(warmup):
        batch = manager.decode_step(reqs)
        manager.complete_step(batch, [rng.randrange(50) for _ in reqs])
    tokens = [rng.randrange(50) for _ in reqs]
    return manager, reqs, tokens


def reference_step(manager, reqs, next_tokens, done) -> None:
    """The step the learner writes, in the manager's own words: what the checker expects."""
    manager.complete_step(manager.decode_step(reqs), list(next_tokens), list(done))


def _cases(seed: int, n_random: int) -> list[Case]:
    def case(name, P, lens, warmup, done, kind="edge", seed=0, num_pages=None):
        return Case(name, dict(P=P, lens=lens, warmup=warmup, done=done, seed=seed,
                               num_pages=num_pages), kind)

    cases = [
        case("one request, mid-page: no new page", 4, [6], 0, [False]),
        case("one request on a page boundary: one new page", 4, [8], 0, [False]),
        case("page_size 1: every step maps a page", 1, [3, 5], 1, [False, False]),
        case("one of two requests finishes", 4, [7, 9], 1, [True, False]),
        case("every request finishes", 2, [4, 5, 6], 2, [True, True, True]),
        case("three requests, one crossing a boundary", 4, [5, 8, 10], 0, [False, True, False]),
        case("tight memory: exactly the pages this step needs are free", 4, [8, 4], 0,
             [False, False], num_pages=5),
        case("page_size 64: one request crosses into a new page, one finishes", 64, [64, 70], 0,
             [False, True]),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        P = rng.choice([1, 2, 4, 16, 64])
        n = rng.randint(1, 4)
        lens = [rng.randint(1, 3 * P + 2) for _ in range(n)]
        cases.append(case(f"random {i + 1} (page_size {P}, {n} requests)", P, lens, rng.randint(0, 3),
                          [rng.random() < 0.4 for _ in range(n)], "random", rng.randrange(1000)))
    return cases


def _first_diff(a: torch.Tensor, b: torch.Tensor):
    bad = (a != b).nonzero()
    return tuple(int(x) for x in bad[0]) if bad.numel() else None


ORDER = ("the order of a decode step: 1. pages: manager.allocate_paged(reqs), once for the batch; "
         "2. advance: for each request req.append_token(token), then req.complete_one(); "
         "3. finish: manager.cache_req(req, finished=True) for each done request, after its "
         "complete_one")
_HAND_BACK = ("cache_req", "release_req", "abort")
_UNLOCK = ("unlock", "lock_handle(unlock=True)")


def record_calls(manager, reqs) -> list[tuple[str, int | None]]:
    """Log ``(method, request index)`` of every call the learner makes on ``manager``, its prefix
    cache's ``lock_handle(..., unlock=True)`` and ``reqs`` (not the calls those make inside)."""
    log: list[tuple[str, int | None]] = []
    index = {id(r): i for i, r in enumerate(reqs)}
    depth = [0]

    def owner_of(handle, owner):
        if id(owner) in index:
            return index[id(owner)]
        return next((i for i, r in enumerate(reqs) if r.cache_handle is handle), None)

    def wrap(obj, name, who, shown=None):
        original = getattr(obj, name, None)
        if original is None:
            return

        def logged(*args, **kwargs):
            if depth[0] == 0 and (label := shown(args, kwargs) if shown else name):
                log.append((label, who(args, kwargs)))
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(obj, name, logged)

    wrap(manager, "allocate_paged", lambda a, k: None)
    for name in _HAND_BACK:
        wrap(manager, name, lambda a, k: index.get(id(a[0] if a else k.get("req"))))
    wrap(manager, "unlock", lambda a, k: owner_of(a[0] if a else k.get("handle"),
                                                  a[1] if len(a) > 1 else k.get("owner")))
    wrap(manager.prefix_cache, "lock_handle",
         lambda a, k: owner_of(a[0] if a else k.get("handle"), k.get("owner")),
         lambda a, k: _UNLOCK[1] if (a[1] if len(a) > 1 else k.get("unlock")) else None)
    for i, req in enumerate(reqs):
        for name in ("append_token", "complete_one"):
            wrap(req, name, lambda a, k, i=i: i)
    return log


def order_problem(log: list[tuple[str, int | None]], done: list[bool]) -> str | None:
    """The first call that breaks the order of a decode step, named by request and step."""
    calls = "; ".join(f"{k + 1}. {name}" + (f" (request {i})" if i is not None else "")
                      for k, (name, i) in enumerate(log[:16])) + ("; ..." if len(log) > 16 else "")
    yours = f"\n  your calls: {calls or '(none)'}\n  {ORDER}"
    pages = [k for k, (name, _) in enumerate(log) if name == "allocate_paged"]
    advance = [(k, name, i) for k, (name, i) in enumerate(log) if name in ("append_token",
                                                                            "complete_one")]
    if not pages:
        return "step 1 (pages): manager.allocate_paged(reqs) was never called" + yours
    if len(pages) > 1:
        return f"step 1 (pages): manager.allocate_paged was called {len(pages)} times" + yours
    unlocks = [(k, name, i) for k, (name, i) in enumerate(log) if name in _UNLOCK]
    if unlocks:
        k, name, i = unlocks[0]
        later = [m for m, (n, j) in enumerate(log) if n == "cache_req" and j == i and m > k]
        then = (f", and then cache_req (call {later[0] + 1}) found the handle no longer locked "
                "by the request" if later else "")
        return (f"request {i}: your code unlocked its cache_handle itself ({name}, call "
                f"{k + 1}){then}. cache_req unlocks the request's old handle itself, after "
                "inserting its tokens, and a running request must keep its lock: leave the "
                "unlocking to cache_req" + yours)
    if advance and advance[0][0] < pages[0]:
        k, name, i = advance[0]
        return (f"request {i}, step 2 (advance): {name} (call {k + 1}) came before "
                f"manager.allocate_paged(reqs) (call {pages[0] + 1}), which decides from the "
                "lengths before the step" + yours)
    for i, finished in enumerate(done):
        mine = [(k, name) for k, (name, j) in enumerate(log) if j == i]
        completes = [k for k, name in mine if name == "complete_one"]
        back = [(k, name) for k, name in mine if name in _HAND_BACK]
        for k, name in back:
            if name != "cache_req":
                return (f"request {i}, step 3 (finish): {name} (call {k + 1}) instead of "
                        "manager.cache_req(req, finished=True): release_req aborts a request, "
                        "freeing its pages without caching them; a request that is done hands "
                        "its tokens to the prefix cache with cache_req" + yours)
            if not finished:
                return (f"request {i}, step 3 (finish): cache_req (call {k + 1}) for a request "
                        "that is not done: it keeps decoding" + yours)
            if not completes or k < completes[0]:
                return (f"request {i}, step 3 (finish): cache_req (call {k + 1}) came before "
                        "its complete_one" + (f" (call {completes[0] + 1})" if completes else "")
                        + ": the step's last token would not be cached" + yours)
        if finished and not back:
            return (f"request {i}, step 3 (finish): it is done but was never handed back with "
                    "manager.cache_req(req, finished=True)" + yours)
    return None


@exercise(
    "decode_step",
    chapter="07",
    hints=[
        "Three things, in this order: pages, then tokens, then finishing. Pages come first "
        "because allocate_paged decides from cached_len and device_len *before* the step.",
        "manager.allocate_paged(reqs) maps pages [div_ceil(cached_len, P), div_ceil(device_len, P)) "
        "of every request in one call: a new page only for a request whose cached_len is a "
        "multiple of P.",
        "Then per request: req.append_token(token) and req.complete_one() (cached_len = device_len; "
        "device_len += 1). Finally manager.cache_req(req, finished=True) for the done ones - "
        "after complete_one, so their last computed token is cached too.",
    ],
    solution=decode_step_solution,
)
def decode_step(fn, *, seed: int = 0, n_random: int = 6) -> int:
    """Check ``fn(manager, reqs, next_tokens, done)`` (one decode step of the serving loop)."""

    def run_one(case: Case) -> None:
        a = case.args
        args = (a["P"], a["lens"], a["warmup"], a["seed"], a["num_pages"])
        ref_m, ref_reqs, tokens = _scenario(*args)
        got_m, got_reqs, _ = _scenario(*args)
        reference_step(ref_m, ref_reqs, tokens, a["done"])
        log = record_calls(got_m, got_reqs)
        try:
            call_learner(fn, got_m, got_reqs, list(tokens), list(a["done"]), read_only=(2, 3))
        except Exception as e:  # noqa: BLE001 - a call in the wrong order may raise: say which
            problem = None if isinstance(e, NotImplementedError) else order_problem(log, a["done"])
            if problem is None:
                raise
            raise CheckFailed(f"[{case.name}] {problem}\n  and so your code raised "
                              f"{type(e).__name__}: {e}", case=case.name) from e
        where = f"  page_size {a['P']}, prompt lengths {a['lens']}, done {a['done']}"
        try:
            _compare(case, ref_m, ref_reqs, got_m, got_reqs, where, tokens)
        except CheckFailed as err:
            problem = order_problem(log, list(a["done"]))
            if problem is None:
                raise
            raise CheckFailed(f"[{case.name}] {problem}\n  and so: {err.message[len(case.name) + 3:]}",
                              case=case.name, label=problem.split(":")[0]) from None

    def _compare(case, ref_m, ref_reqs, got_m, got_reqs, where, tokens) -> None:
        for i, (r, g) in enumerate(zip(ref_reqs, got_reqs)):
            for attr in ("cached_len", "device_len"):
                if getattr(r, attr) != getattr(g, attr):
                    raise CheckFailed(
                        f"[{case.name}] request {i}: {attr} should be {getattr(r, attr)}, got "
                        f"{getattr(g, attr)} (did you call req.complete_one() once per request?)\n{where}",
                        case=case.name, expected=getattr(r, attr), got=getattr(g, attr),
                        label=f"request {i}")
            if r.input_ids != g.input_ids:
                mine = [j for j, t in enumerate(tokens) if len(g.input_ids) == len(r.input_ids)
                        and g.input_ids[-1] == t != r.input_ids[-1]]
                why = (f"request {i} got next_tokens[{mine[0]}]; its token is next_tokens[{i}]: "
                       "reqs and next_tokens go together, in order (a request's row, table_idx, "
                       "is not its index)" if mine else "append the step's token once")
                raise CheckFailed(f"[{case.name}] request {i}: input_ids should end "
                                  f"{r.input_ids[-3:]}, got {g.input_ids[-3:]} ({why})\n{where}",
                                  case=case.name, label=f"request {i}")
            if r.finished != g.finished:
                raise CheckFailed(f"[{case.name}] request {i}: finished should be {r.finished} "
                                  f"(cache_req(req, finished=True) only for done requests)\n{where}",
                                  case=case.name, label=f"request {i}")
        diff = _first_diff(ref_m.page_table, got_m.page_table)
        if diff is not None:
            row, col = diff
            raise CheckFailed(
                f"[{case.name}] page_table[{row}, {col}] should be {int(ref_m.page_table[row, col])}, "
                f"got {int(got_m.page_table[row, col])} (one allocate_paged(reqs) before advancing "
                f"the requests maps exactly the pages this step writes)\n{where}",
                case=case.name, label=f"row {row}")
        if ref_m.free_slots.tolist() != got_m.free_slots.tolist():
            raise CheckFailed(
                f"[{case.name}] free list should be {ref_m.free_slots.tolist()}, got "
                f"{got_m.free_slots.tolist()}\n{where}", case=case.name, label="free list")
        row = lambda who: getattr(who, "table_idx", who)  # noqa: E731 - a lock's owner, by its row
        why = tree_difference(tree_state(ref_m.prefix_cache, row), tree_state(got_m.prefix_cache, row),
                              old="should be", new="is")
        if why:
            raise CheckFailed(f"[{case.name}] the prefix cache is not as the step leaves it: {why}\n"
                              "  (a decode step matches nothing and inserts only through "
                              f"cache_req)\n{where}", case=case.name, label="prefix cache")
        try:
            got_m.check_integrity()
        except AssertionError as e:
            raise CheckFailed(f"[{case.name}] the manager's integrity check fails: {e}\n{where}",
                              case=case.name) from None

    return run_cases("decode_step", _cases(seed, n_random), run_one)
