"""The newest serving surfaces keep the promise of tests/test_bad_arguments.py: a bad argument
gets a kvlab error naming it and the rule, before anything changes, or the call is right to
accept it (each acceptance listed, with why).

* the swap policy's host pool (``kvlab.serving.hf.swap.HostKV``) and its size (``host_pool_pages``);
* chapter 12's rules (``kvlab.serving.pressure``: victim_order, next_token_ratio, resume_plan,
  make_policy, the policies' settings, a PolicyRun's victim and ratio);
* where ``python -m kvlab.bench`` writes (``kvlab.bench.output.checked_out``).

Each public call is made with each argument in turn replaced by each value of the catalogue of
wrong ones (tests/test_bad_arguments.py's ``BAD``), the other arguments valid; then with the
wrong values of each class these surfaces were found to accept (slots out of range, negative,
float, 2-D or a list; host pages out of range, free, float, repeated or never saved into; a
ratio that is a string or NaN; a policy name where a policy's settings are read; ...).
"""
from __future__ import annotations

import inspect

import pytest
import torch
from test_bad_arguments import BAD, fresh_bad

import kvlab
from kvlab.bench.output import BadOut, checked_out
from kvlab.base.errors import InvalidArgument, KvlabError
from kvlab.serving.hf.swap import HostKV, host_pool_pages
from kvlab.attention.kv_pool import KVPool
from kvlab.serving.pressure import (PolicyRun, RecomputeOnPreempt, RequestView, RetractDecode, SwapToHost,
                            make_policy, next_token_ratio, resume_plan, victim_order)

DEV = kvlab.DEVICE
P = 4


def host_scene():
    """A pool of 24 slots; host pages of 4: three hold a saved row of 10 positions (4, 4, 2),
    one is taken but holds nothing saved, two are free."""
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(24, 2, 2, 3, device=DEV)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    host = HostKV(pool, P, 6)
    saved = host.save(pool, torch.arange(3, 13, device=DEV))
    unsaved = host.take(1)
    return pool, host, saved, unsaved


def host_state(pool, host) -> tuple:
    return (list(host.free_pages), {p: host.saved_positions(p) for p in range(host.num_pages)},
            *(t.clone().cpu() for t in (host.k, host.v, pool.k, pool.v)))


def same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def host_calls(pool, host, saved, unsaved) -> dict:
    """Public call -> (the call, its valid arguments)."""
    return {"save": (host.save, (pool, torch.arange(2, device=DEV))),
            "load": (host.load, (pool, saved, 1, 9, torch.arange(14, 22, device=DEV))),
            "release": (host.release, (saved,)), "take": (host.take, (1,)), "fits": (host.fits, (3,)),
            "HostKV": (HostKV, (pool, P, 2))}


#: an integer argument may be given as a 0-d integer tensor (kvlab.base.args' rule for every door)
INT_TENSOR = repr(torch.tensor(3))

#: (call, argument index, value) a call is right to accept
HOST_ACCEPTS = {("release", 0, "[]"): "giving back no pages changes nothing",
                ("fits", 0, repr(2**63)): "so many positions do not fit: False",
                ("fits", 0, repr(10**30)): "so many positions do not fit: False",
                ("fits", 0, INT_TENSOR): "an integer",
                ("HostKV", 1, INT_TENSOR): "an integer page size",
                ("HostKV", 2, INT_TENSOR): "an integer number of pages"}


def _refused(call, args, kwargs, state) -> bool:
    """Whether ``call`` refused (a kvlab error, nothing changed); any other exception fails."""
    before = state()
    try:
        call(*args, **kwargs)
    except KvlabError:
        assert same(state(), before), f"{getattr(call, '__qualname__', call)}: a refused call changed the state"
        return True
    except Exception as e:  # noqa: BLE001 - that is the point
        pytest.fail(f"{getattr(call, '__qualname__', call)}{args!r:.160} {kwargs!r:.80} leaked "
                    f"{type(e).__name__}: {e}")
    return False


@pytest.mark.parametrize("name", sorted(host_calls(*host_scene())))
def test_every_host_pool_call_refuses_a_bad_argument_with_a_kvlab_error(name):
    accepted = set()
    for i in range(len(host_calls(*host_scene())[name][1])):
        for bad in fresh_bad():
            pool, host, saved, unsaved = host_scene()
            call, args = host_calls(pool, host, saved, unsaved)[name]
            args = list(args)
            args[i] = bad
            if not _refused(call, args, {}, lambda: host_state(pool, host)):
                accepted.add((name, i, repr(bad)))
    assert accepted == {k for k in HOST_ACCEPTS if k[0] == name}, accepted


def _host_cases():
    """(why, call name, arguments built from the scene, the argument to blame)."""
    other = KVPool(24, 2, 4, 3, device=DEV)      # 4 heads: not the layout of these host pages
    return [
        ("slots past the pool", "save", lambda s: (s.pool, torch.tensor([3, 24])), "slots"),
        ("a negative slot", "save", lambda s: (s.pool, torch.tensor([-1, 3])), "slots"),
        ("slots as a list", "save", lambda s: (s.pool, [3, 4]), "slots"),
        ("slots as a 2-D tensor", "save", lambda s: (s.pool, torch.arange(4).view(2, 2)), "slots"),
        ("float slots", "save", lambda s: (s.pool, torch.tensor([3.0, 4.0])), "slots"),
        ("bool slots", "save", lambda s: (s.pool, torch.tensor([True, False])), "slots"),
        ("slots on no device of the pool's", "save", lambda s: (s.pool, torch.zeros(2, dtype=torch.int64,
                                                                                     device="meta")), "slots"),
        ("another layout's pool", "save", lambda s: (other, torch.arange(2)), "pool"),
        ("no pool", "save", lambda s: (None, torch.arange(2)), "pool"),
        ("a host page past the pool", "load", lambda s: (s.pool, [99], 0, 1, torch.arange(1)), "pages[0]"),
        ("a free host page", "load", lambda s: (s.pool, [s.host.free_pages[0]], 0, 1, torch.arange(1)), "pages[0]"),
        ("a float host page", "load", lambda s: (s.pool, [float(s.saved[0])], 0, 1, torch.arange(1)), "pages[0]"),
        ("host pages as a tensor", "load", lambda s: (s.pool, torch.tensor(s.saved), 0, 1, torch.arange(1)), "pages"),
        ("a host page twice", "load", lambda s: (s.pool, [s.saved[0]] * 2, 0, 1, torch.arange(1)), "pages"),
        ("a page nobody saved into", "load", lambda s: (s.pool, s.unsaved, 0, 1, torch.arange(1)), "pages"),
        ("past what the last page holds", "load", lambda s: (s.pool, s.saved, 8, 12, torch.arange(4)), "pages"),
        ("start after end", "load", lambda s: (s.pool, s.saved, 5, 4, torch.arange(0)), "end"),
        ("a float start", "load", lambda s: (s.pool, s.saved, 1.0, 4, torch.arange(3)), "start"),
        ("an end past the pages", "load", lambda s: (s.pool, s.saved, 0, 13, torch.arange(13)), "end"),
        ("too few slots", "load", lambda s: (s.pool, s.saved, 1, 9, torch.arange(7)), "slots"),
        ("slots past the pool", "load", lambda s: (s.pool, s.saved, 0, 2, torch.tensor([1, 24])), "slots"),
        ("a number, not a list", "release", lambda s: (3,), "pages"),
        ("a string", "release", lambda s: ("01",), "pages"),
        ("a tensor", "release", lambda s: (torch.tensor(s.saved),), "pages"),
        ("a float page", "release", lambda s: ([float(s.saved[0])],), "pages[0]"),
        ("a free page", "release", lambda s: ([s.host.free_pages[0]],), "pages[0]"),
        ("a page twice", "release", lambda s: ([s.saved[0], s.saved[0]],), "pages"),
        ("a negative count", "take", lambda s: (-1,), "n"),
        ("a host pool larger than the machine", "HostKV", lambda s: (s.pool, P, 2**40), "host_pages"),
    ]


class Scene:
    def __init__(self):
        self.pool, self.host, self.saved, self.unsaved = host_scene()


@pytest.mark.parametrize("why, name, make, argument", _host_cases(), ids=[c[0] for c in _host_cases()])
def test_the_host_pool_refuses_each_class_of_wrong_argument(why, name, make, argument):
    s = Scene()
    call = host_calls(s.pool, s.host, s.saved, s.unsaved)[name][0]
    before = host_state(s.pool, s.host)
    with pytest.raises(InvalidArgument) as info:
        call(*make(s))
    assert info.value.argument == argument, (why, info.value)
    assert same(host_state(s.pool, s.host), before), why


def test_what_the_host_pool_accepts_is_right():
    s = Scene()
    s.host.load(s.pool, s.saved, 8, 10, torch.arange(20, 22))   # the last page's 2 saved positions
    assert torch.equal(s.pool.k[:, 20:22], s.pool.k[:, 11:13])
    s.host.load(s.pool, s.saved, 4, 4, torch.arange(0))          # nothing to copy: nothing copied
    s.host.release(s.saved)
    assert all(s.host.saved_positions(p) == 0 for p in s.saved)   # given back: nothing to load
    with pytest.raises(InvalidArgument):
        s.host.load(s.pool, s.unsaved, 0, 1, torch.arange(1))


# --- the host pool's size ------------------------------------------------------------------

@pytest.mark.parametrize("bad", BAD, ids=[f"{i}-{type(b).__name__}" for i, b in enumerate(BAD)])
def test_the_host_pools_size_refuses_a_bad_argument(bad):
    for args in ((bad, None, 8), ("swap", bad, 8), ("swap", None, bad)):
        try:
            size = host_pool_pages(*args)
        except KvlabError:
            continue
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"host_pool_pages{args!r:.80} leaked {type(e).__name__}: {e}")
        # accepted: a host pool of that many pages (a number of pages the policy may hold)
        assert isinstance(size, int) and size >= 0, (args, size)


def test_the_host_pools_size_comes_from_the_generator_or_the_policy():
    assert host_pool_pages("swap", None, 8) == 8
    assert host_pool_pages(SwapToHost(host_pages=0), None, 8) == 0
    assert host_pool_pages(SwapToHost(host_pages=3), 3, 8) == 3
    assert host_pool_pages("recompute", None, 8) is None
    for args in ((SwapToHost(host_pages=3), 5, 8), ("retract", 4, 8)):
        with pytest.raises(InvalidArgument, match="host_pages"):
            host_pool_pages(*args)


# --- chapter 12's rules --------------------------------------------------------------------

def views() -> list[RequestView]:
    return [RequestView("a", 10, 3, 16, 13, 4, admitted=0, arrived=1),
            RequestView("b", 4, 8, 64, 12, 3, admitted=1, arrived=0)]


def pressure_calls() -> dict:
    """Public rule -> (a fresh call, its valid arguments, keyword arguments, the state it keeps)."""
    run = PolicyRun(RetractDecode())
    return {
        "victim_order": (victim_order, ("retract", views()), {}, lambda: None),
        "next_token_ratio": (next_token_ratio, (RetractDecode(), 0.5), dict(retracted=True, remaining=views()),
                             lambda: None),
        "resume_plan": (resume_plan, ("swap",), dict(saved=9, hit=4, input_len=12), lambda: None),
        "make_policy": (make_policy, ("swap",), {}, lambda: None),
        "RetractDecode": (RetractDecode, (0.7, 0.14, 600.0, 20, 4096), {}, lambda: None),
        "RecomputeOnPreempt": (RecomputeOnPreempt, (True, False), {}, lambda: None),
        "SwapToHost": (SwapToHost, (4,), {}, lambda: None),
        "PolicyRun.victim": (run.victim, (views(),), {}, lambda: run.ratio),
        "PolicyRun.after_decode": (run.after_decode, (), dict(retracted=False, remaining=views()),
                                   lambda: run.ratio),
    }


#: (rule, argument, value) a rule is right to accept
PRESSURE_ACCEPTS = {
    ("victim_order", 1, "[]"): "nobody to stop: an empty order",
    ("next_token_ratio", "remaining", "[]"): "nobody left after a retraction: the initial ratio",
    ("next_token_ratio", "retracted", "True"): "a retraction (the valid call's own value)",
    ("PolicyRun.after_decode", "remaining", "[]"): "nobody left: the ratio decays (or resets)",
    ("PolicyRun.after_decode", "retracted", "True"): "a retraction: the ratio jumps",
    ("RecomputeOnPreempt", 0, "True"): "keep_computed is a bool",
    ("RecomputeOnPreempt", 1, "True"): "admit_after_preempt is a bool",
    ("SwapToHost", 0, "None"): "None: a host pool as large as the device's",
    ("SwapToHost", 0, INT_TENSOR): "an integer (kept as an int)",
    ("SwapToHost", 0, repr(2**63)): "a size only: the simulator counts pages; a generator checks memory",
    ("SwapToHost", 0, repr(10**30)): "a size only: the simulator counts pages; a generator checks memory",
    ("RetractDecode", 2, "1.5"): "decay_steps may be any number > 0",
    ("RetractDecode", 2, repr(2**63)): "decay_steps: a ratio that barely decays",
    ("RetractDecode", 2, repr(10**30)): "decay_steps: a ratio that barely decays",
    ("RetractDecode", 3, INT_TENSOR): "an integer (kept as an int)",
    ("RetractDecode", 3, repr(2**63)): "retract_decode_steps: a ratio capped at 1 after a retraction",
    ("RetractDecode", 3, repr(10**30)): "retract_decode_steps: a ratio capped at 1 after a retraction",
    ("RetractDecode", 4, INT_TENSOR): "an integer (kept as an int)",
    ("RetractDecode", 4, repr(2**63)): "a clip larger than any answer: nothing clipped",
    ("RetractDecode", 4, repr(10**30)): "a clip larger than any answer: nothing clipped",
    ("resume_plan", "saved", INT_TENSOR): "an integer",
    ("resume_plan", "hit", INT_TENSOR): "an integer",
    ("resume_plan", "input_len", repr(2**63)): "a long input: the plan is ranges only",
    ("resume_plan", "input_len", repr(10**30)): "a long input: the plan is ranges only",
}


@pytest.mark.parametrize("name", sorted(pressure_calls()))
def test_every_pressure_rule_refuses_a_bad_argument_with_a_kvlab_error(name):
    call, args, kwargs, _ = pressure_calls()[name]
    places = list(range(len(args))) + list(kwargs)
    accepted = set()
    for place in places:
        for bad in fresh_bad():
            call, args, kwargs, state = pressure_calls()[name]
            args, kwargs = list(args), dict(kwargs)
            if isinstance(place, int):
                args[place] = bad
            else:
                kwargs[place] = bad
            if not _refused(call, args, kwargs, lambda: (state(),)):
                accepted.add((name, place, repr(bad)))
    assert accepted == {k for k in PRESSURE_ACCEPTS if k[0] == name}, accepted


@pytest.mark.parametrize("why, call, argument", [
    ("victim_order of plain tuples", lambda: victim_order("swap", [tuple(v) for v in views()]), "views[0]"),
    ("victim_order of dicts", lambda: victim_order("swap", [v._asdict() for v in views()]), "views[0]"),
    ("victim_order of a view with a float length", lambda: victim_order(
        "retract", [views()[0]._replace(generated=2.5)]), "views[0].generated"),
    ("a PolicyRun's victim among strings", lambda: PolicyRun(RetractDecode()).victim(["a", "b"]), "views[0]"),
    ("the ratio of a policy name", lambda: next_token_ratio("recompute", 0.5, retracted=False), "policy"),
    ("the ratio of another policy", lambda: next_token_ratio(SwapToHost(), 0.5, retracted=False), "policy"),
    ("a string ratio", lambda: next_token_ratio(RetractDecode(), "0.5", retracted=False), "ratio"),
    ("a NaN ratio", lambda: next_token_ratio(RetractDecode(), float("nan"), retracted=False), "ratio"),
    ("a ratio above 1", lambda: next_token_ratio(RetractDecode(), 1.5, retracted=False), "ratio"),
    ("remaining lengths as ints", lambda: next_token_ratio(RetractDecode(), 0.5, retracted=True,
                                                           remaining=[10, 20]), "remaining[0]"),
    ("retracted as 0/1", lambda: next_token_ratio(RetractDecode(), 0.5, retracted=1), "retracted"),
    ("a float saved", lambda: resume_plan("swap", saved=2.5, hit=0, input_len=4), "saved"),
    ("a bool saved", lambda: resume_plan("swap", saved=True, hit=0, input_len=4), "saved"),
    ("a float input_len", lambda: resume_plan("swap", saved=2, hit=0, input_len=4.0), "input_len"),
    ("an unknown how", lambda: resume_plan("copy", saved=2, hit=0, input_len=4), "how"),
])
def test_chapter_12s_rules_refuse_each_class_of_wrong_argument(why, call, argument):
    with pytest.raises(InvalidArgument) as info:
        call()
    assert info.value.argument == argument, (why, info.value)


def test_what_the_rules_accept_is_right():
    assert next_token_ratio("retract", 0.5, retracted=False) == pytest.approx(0.5 - RetractDecode().decay)
    assert next_token_ratio(RetractDecode(), 1, retracted=True, remaining=[]) == RetractDecode().init_ratio
    assert victim_order("swap", []) == []
    assert resume_plan("keep", saved=9, hit=4, input_len=12).compute == (4, 12)
    assert type(SwapToHost(host_pages=torch.tensor(3)).host_pages) is int     # stored as an int
    assert type(RetractDecode(clip_max_new=torch.tensor(8)).clip_max_new) is int


# --- where the benchmark writes ------------------------------------------------------------

@pytest.mark.parametrize("bad", BAD, ids=[f"{i}-{type(b).__name__}" for i, b in enumerate(BAD)])
def test_the_benchmarks_output_folder_refuses_a_bad_value_in_one_line(bad, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        out = checked_out(bad, adds_to_existing=True)
    except BadOut as e:
        assert "\n" not in str(e) and str(e).startswith("--out")
        return
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"checked_out({bad!r:.60}) leaked {type(e).__name__}: {e}")
    # accepted: only a string, a folder made here
    assert isinstance(bad, str) and (tmp_path / out).is_dir()


def test_the_catalogue_reaches_every_public_call_here():
    """A new public method of HostKV, or a new rule of kvlab.serving.pressure, joins the catalogue."""
    methods = {n for n, f in inspect.getmembers(HostKV, inspect.isfunction) if not n.startswith("_")}
    assert methods - {"reset", "saved_positions"} <= set(host_calls(*host_scene()))
    rules = {"victim_order", "next_token_ratio", "resume_plan", "make_policy"}
    assert rules <= set(pressure_calls())
