"""Chapter 10's exercise: ``kvlab.check.paged_attention_step(fn)``.

The learner writes what every layer of a real model runs for the decoding requests of a
step::

    fn(q, k, v, k_pool, v_pool, page_table, rows, positions, scale) -> out

Request ``b`` owns page-table row ``rows[b]``; its new token sits at position
``positions[b]``. ``q`` is ``[batch, heads, head_dim]``, ``k``/``v`` are
``[batch, kv_heads, head_dim]`` (grouped-query attention: ``heads`` is a multiple of
``kv_heads``), the pools ``[num_slots, kv_heads, head_dim]``. ``fn`` writes ``k[b]``, ``v[b]``
at slot ``page_table[rows[b], positions[b]]`` of the pools, then returns paged attention of
``q[b]`` over positions ``[0, positions[b]]``: a floating-point tensor ``[batch, heads,
head_dim]`` on ``q``'s device (the model casts it to its own dtype).

Checked against :func:`kvlab.serving.hf.attention_steps.paged_attention_reference`: first the pools
(exactly the new tokens' slots changed, holding exactly their K/V), then the output's type and
values (``atol=1e-4``), with the default ``scale`` and others (a model passes its own). ``q``,
``k``, ``v``, ``page_table``, ``rows`` and ``positions`` are read-only, and ``q``, ``k`` and ``v``
come as the model hands them over: views whose memory is not in row order (a ``.view`` that
needs it fails here as it would in ``PagedGenerator``). A failure names the request, the slot or
head, and the mistake when it alone gives the answer (:mod:`kvlab.course.checking.slips`).
"""
from __future__ import annotations

import math
import random

import torch

from ...base import runtime
from ...attention.kv_pool import random_paged_layout
from ..checking.answers import expect_tensor
from ..checking.core import Case, CheckFailed, call_learner, exercise, looks_like, run_cases
from ..checking.slips import recognised

ATOL = 1e-4


def paged_attention_step_solution(q, k, v, k_pool, v_pool, page_table, rows, positions, scale):
    """Find each new token's slot through its row, store its K and V there, then attend."""
    from ...serving.hf.attention_steps import paged_decode_attention

    slots = page_table[rows, positions].long()        # request b's new token -> its slot
    k_pool[slots] = k                                 # all of its K/V heads at once
    v_pool[slots] = v
    # the new token attends to itself too: positions 0..positions[b], seq_len positions[b] + 1
    return paged_decode_attention(q, k_pool, v_pool, page_table, rows, positions + 1, scale)


def step_layout(P: int, lens: list[int], seed: int, heads: int = 4, kv_heads: int = 2,
                head_dim: int = 16, scale: float | None = None):
    """One decode step: request ``b`` has ``lens[b]`` tokens mapped in a shuffled row on
    shuffled pages; its last one (position ``lens[b] - 1``) is the new token, whose slot
    holds stale values until the step writes it. Returns the step's arguments (a dict);
    ``scale`` defaults to ``1/sqrt(head_dim)``."""
    layout = random_paged_layout(seed, P, lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    g = torch.Generator().manual_seed(seed + 1)  # the new tokens' K/V
    return dict(
        q=layout.q,
        k=torch.randn(len(lens), kv_heads, head_dim, generator=g),
        v=torch.randn(len(lens), kv_heads, head_dim, generator=g),
        k_pool=layout.k_pool, v_pool=layout.v_pool, page_table=layout.page_table,
        rows=layout.table_idx, positions=layout.seq_lens - 1,
        scale=1.0 / math.sqrt(head_dim) if scale is None else scale)


def expected_step(a: dict):
    """The pools after the step and its output, by the reference."""
    from ...serving.hf.attention_steps import paged_attention_reference

    k_pool, v_pool = a["k_pool"].clone(), a["v_pool"].clone()
    slots = a["page_table"][a["rows"], a["positions"]].long()
    k_pool[slots], v_pool[slots] = a["k"], a["v"]
    out = paged_attention_reference(a["q"], k_pool, v_pool, a["page_table"], a["rows"],
                                    a["positions"] + 1, a["scale"])
    return k_pool, v_pool, out


def _cases(seed: int, n_random: int) -> list[Case]:
    def case(name, P, lens, heads=4, kv_heads=2, head_dim=16, kind="edge", seed=0, scale=None):
        return Case(name, dict(P=P, lens=lens, heads=heads, kv_heads=kv_heads,
                               head_dim=head_dim, seed=seed, scale=scale), kind)

    cases = [
        case("one request, its first token", 4, [1]),
        case("page_size 1", 1, [5, 3]),
        case("the new tokens open new pages", 4, [9, 5]),
        case("unaligned lengths", 4, [7, 2, 14]),
        case("multi-head attention (one K/V head per query head)", 4, [6, 3], heads=2, kv_heads=2),
        case("four query heads share each K/V head", 2, [5, 8], heads=8, kv_heads=2),
        case("many requests, rows out of order", 2, [3, 9, 1, 6, 4, 11]),
        case("head_dim 12", 4, [6, 10], head_dim=12),
        case("scale 0.2 (a model's own, not 1/sqrt(head_dim))", 4, [7, 3], scale=0.2),
        case("page_size 64: the new token opens a page, and one in the middle of one", 64,
             [65, 30]),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        P = rng.choice([1, 2, 4, 16])
        kv_heads = rng.choice([1, 2])
        cases.append(case(f"random {i + 1} (page_size {P})", P,
                          [rng.randint(1, 3 * P + 3) for _ in range(rng.randint(1, 4))],
                          heads=kv_heads * rng.choice([1, 2, 3]), kv_heads=kv_heads,
                          kind="random", seed=rng.randrange(1000),
                          scale=rng.choice([None, 0.1, 0.5])))
    return cases


def _where(a: dict) -> str:
    return (f"  page_size {a['P']}, rows {a['args']['rows'].tolist()}, positions "
            f"{a['args']['positions'].tolist()}, heads {a['heads']} on {a['kv_heads']} K/V heads, "
            f"scale {a['args']['scale']:.4g}")


def _check_pools(case: str, a: dict, want_k, want_v, got_k, got_v) -> None:
    """Exactly the new tokens' slots changed, and they hold exactly the new K/V."""
    args = a["args"]
    new_slots = args["page_table"][args["rows"], args["positions"]].long().tolist()
    owner = {s: b for b, s in enumerate(new_slots)}
    for name, want, got in (("k_pool", want_k, got_k), ("v_pool", want_v, got_v)):
        wrong = (got != want).flatten(1).any(1).nonzero().flatten().tolist()
        if not wrong:
            continue
        s = wrong[0]
        if s in owner:
            b = owner[s]
            msg = (f"[{case}] request {b}'s new {name[0].upper()} should be in slot {s} "
                   f"(= page_table[rows[{b}], positions[{b}]] = page_table[{int(args['rows'][b])}, "
                   f"{int(args['positions'][b])}]), but {name}[{s}] does not hold {name[0]}[{b}]")
        else:
            msg = (f"[{case}] {name}[{s}] changed, but no new token belongs there: the new tokens' "
                   f"slots are {new_slots} (page_table[rows, positions])")
        why = recognised((got_k, got_v), _pool_slips(args), lambda x, y: all(map(torch.equal, x, y)))
        msg += f"\n  {len(wrong)} slot(s) of {name} differ: {wrong[:8]}" + why
        raise CheckFailed(msg + "\n" + _where(a), case=case, label=f"{name} slot {s}")


def _stored(args: dict, k_slots=None, v_slots=None, k_new=None, v_new=None):
    """The pools after a step that stores ``k_new`` at ``k_slots`` and ``v_new`` at ``v_slots``
    (default: the new K/V at their slots; ``()`` stores nothing)."""
    right = args["page_table"][args["rows"], args["positions"]].long()
    out = []
    for pool, slots, new in ((args["k_pool"], k_slots, k_new), (args["v_pool"], v_slots, v_new)):
        pool = pool.clone()
        slots = right if slots is None else slots
        if len(slots):
            if bool((slots >= pool.shape[0]).any()) or bool((slots < -pool.shape[0]).any()):
                raise IndexError("a slip's slot outside the pool")
            pool[slots] = new
        out.append(pool)
    return tuple(out)


def _pool_slips(args: dict) -> dict:
    """The pools that known slips leave (:func:`kvlab.course.checking.slips.recognised`)."""
    positions, rows, table, k, v = (args[n] for n in ("positions", "rows", "page_table", "k", "v"))
    by_position = positions.long()
    by_b = table[torch.arange(len(rows)), positions].long()
    one_on = table[rows, (positions + 1).clamp(max=table.shape[1] - 1)].long()
    unmapped = " (that row maps nothing there: -1, and k_pool[-1] is the last slot)"
    return {
        "it writes at slot positions[b], not at the slot its page-table row names":
            lambda: _stored(args, by_position, by_position, k, v),
        "it uses row b instead of row rows[b]" + (unmapped if bool((by_b < 0).any()) else ""):
            lambda: _stored(args, by_b, by_b, k, v),
        "it writes one position too far (positions[b] + 1)" + (unmapped if bool((one_on < 0).any()) else ""):
            lambda: _stored(args, one_on, one_on, k, v),
        "it never stores V: v_pool[slots] = v is missing": lambda: _stored(args, None, (), k, v),
        "it never stores K: k_pool[slots] = k is missing": lambda: _stored(args, (), None, k, v),
        "it stores k in both pools (v_pool[slots] = k)": lambda: _stored(args, None, None, k, k),
        "it swaps K and V (k_pool gets v, v_pool gets k)": lambda: _stored(args, None, None, v, k),
    }


def _diagnose_output(a: dict, want_k, want_v, got) -> str:
    from ...serving.hf.attention_steps import paged_attention_reference

    args = a["args"]
    q, table, rows, positions = args["q"], args["page_table"], args["rows"], args["positions"]
    tries = {
        "it attends to positions [0, positions[b]) only: the new token must see itself "
        "(seq_len = positions[b] + 1)":
            lambda: paged_attention_reference(q, want_k, want_v, table, rows, positions, args["scale"]),
        "it attends before writing the new K/V (the new token's slot still held stale values)":
            lambda: paged_attention_reference(q, args["k_pool"], args["v_pool"], table, rows,
                                              positions + 1, args["scale"]),
        "it uses 1/sqrt(head_dim) instead of the scale it is given (a model passes its own)":
            lambda: paged_attention_reference(q, want_k, want_v, table, rows, positions + 1,
                                              1.0 / math.sqrt(q.shape[-1])),
        "query head h reads K/V head h % kv_heads; with grouped-query attention it is "
        "h // (heads // kv_heads)":
            lambda: paged_attention_reference(
                q, want_k.repeat(1, q.shape[1] // want_k.shape[1], 1),
                want_v.repeat(1, q.shape[1] // want_v.shape[1], 1), table, rows, positions + 1,
                args["scale"]),
    }
    return looks_like(got, tries, ATOL)


@exercise(
    "paged_attention_step",
    chapter="10",
    order=1,
    hints=[
        "Request b's new token sits at position positions[b] of page-table row rows[b], so its "
        "slot is page_table[rows[b], positions[b]]; for the whole batch at once: "
        "slots = page_table[rows, positions].long().",
        "Store first: k_pool[slots] = k puts k[b] (all its K/V heads) in row slots[b] of the pool; "
        "the same for v. The new token attends to itself, so its K/V must be in the pool before "
        "attention runs.",
        "Then kvlab.serving.hf.paged_decode_attention(q, k_pool, v_pool, page_table, rows, positions + 1, "
        "scale): request b reads positions 0..positions[b], i.e. seq_len positions[b] + 1, and the "
        "kernel gives query head h the K/V head h // (heads // kv_heads).",
    ],
    solution=paged_attention_step_solution,
)
def paged_attention_step(fn, *, seed: int = 0, n_random: int = 4) -> int:
    """Check ``fn(q, k, v, k_pool, v_pool, page_table, rows, positions, scale)``."""

    def run_one(case: Case) -> None:
        c = case.args
        args = step_layout(c["P"], c["lens"], c["seed"], c["heads"], c["kv_heads"], c["head_dim"],
                           c["scale"])
        a = {**c, "args": args}
        want_k, want_v, want = expected_step(args)
        # the case and the reference live on the CPU; the learner's step runs on the runtime's device
        on = {name: args[name].to(runtime.DEVICE, copy=True) for name in
              ("q", "k", "v", "k_pool", "v_pool", "page_table", "rows", "positions")}
        for name in ("q", "k", "v"):  # as the model hands them over: [N, heads, d] views of [heads, N, d]
            on[name] = on[name].transpose(0, 1).contiguous().transpose(0, 1)
        got = call_learner(fn, on["q"], on["k"], on["v"], on["k_pool"], on["v_pool"],
                           on["page_table"], on["rows"], on["positions"], args["scale"],
                           read_only=(0, 1, 2, 5, 6, 7))
        _check_pools(case.name, a, want_k, want_v, on["k_pool"].cpu(), on["v_pool"].cpu())
        expect_tensor(case.name, "the output", got, floating=True, device=on["q"].device,
                      shape=want.shape, meaning="[batch, heads, head_dim]")
        got = got.float().cpu()
        err = torch.nan_to_num((got - want).abs(), nan=float("inf"))
        if not bool((err <= ATOL).all()):
            b, h = divmod(int(err.amax(-1).flatten().argmax()), want.shape[1])
            raise CheckFailed(
                f"[{case.name}] request {b}, head {h}: off by up to {float(err[b, h].max()):.3g} "
                f"(tolerance {ATOL})\n  expected {want[b, h, :4].tolist()} ...\n  got      "
                f"{got[b, h, :4].tolist()} ...{_diagnose_output(a, want_k, want_v, got)}\n{_where(a)}",
                case=case.name, label=f"request {b}, head {h}")

    return run_cases("paged_attention_step", _cases(seed, n_random), run_one)
