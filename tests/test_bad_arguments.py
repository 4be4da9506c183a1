"""No public call of the cache manager's floor lets a raw Python or torch exception out for a bad
argument, and a refused call changes nothing.

Every public method of CacheManager, RadixPrefixCache, HashPrefixCache, FreeQueue and ForwardBatch
(and the chained hash's functions) is called with each argument in turn replaced by each value of
a catalogue of wrong ones (None, bools, floats, NaN, strings, huge and negative ints, nested and
empty lists, tensors of the wrong dtype or shape, foreign objects), the other arguments valid. A
call may accept the value (an owner may be any hashable) or refuse it with a kvlab error
(InvalidArgument, CacheMisuse, OutOfPages); nothing else. A refused call leaves every piece of
state as it was (tests/cache_state.py).
"""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
from cache_state import hash_cache_state, manager_state

from kvlab import CacheManager, HashPrefixCache, RadixPrefixCache, Req
from kvlab.base.errors import KvlabError
from kvlab.prefix.hash_chain import FreeQueue, chain_hash, page_hashes
from kvlab.alloc.paging import new_page_table

BAD = [None, True, 1.5, float("nan"), "x", b"1", -1, 2**63, 10**30, [], [None], [1.5], [-1], [2**64],
       [[1]], {}, object(), torch.tensor([1.5]), torch.zeros(2, 2, dtype=torch.int64), torch.tensor(3)]


def fresh_bad() -> list:
    """A copy of :data:`BAD` per use: a call may rightly fill a list it is given (``into=[]``),
    and one test's call must not change the values the next test tries."""
    return copy.deepcopy(BAD)


#: calls that only answer a question: they may answer False (or 0) to a wrong argument
READS = {"holds", "is_locked_by", "locks_held", "allocated_pages"}


def served(cache: str):
    """A manager with a request finished (its prefix cached), one running, one admitted."""
    cm = CacheManager(12, 2, new_page_table(4, 16, 2), cache, page_table_writer="host")
    a, b, c = Req([1, 2, 3, 4, 5], 0), Req([1, 2, 3, 4, 6], 1), Req([1, 2, 9], 2)
    cm.complete_step(cm.prefill([a]), [7], [True])
    batch = cm.prefill([b])
    cm.admit(c)
    return cm, [a, b, c], batch


def manager_calls(cm: CacheManager, reqs, batch) -> dict:
    """Public method -> valid arguments (positional), for a manager from :func:`served`."""
    a, b, c = reqs
    handle = b.cache_handle
    return {"pages_needed": ([b],), "allocated_pages": (b,), "match_req": (c,), "lock": (handle, "x"),
            "unlock": (handle, b), "admit": (Req([1, 2, 3, 4], 3),), "prefill": ([Req([1, 2, 3], 3)],),
            "decode_step": ([],), "mixed_step": ([Req([1, 2], 3)], []),
            "complete_step": (batch, [8], [False]), "allocate_paged": ([c],), "cache_req": (b,),
            "release_req": (c,)}


def _call(fn, args, kwargs, state) -> bool:
    """Whether ``fn`` refused the arguments (with a kvlab error, changing nothing)."""
    before = state()
    try:
        fn(*args, **kwargs)
    except KvlabError:
        assert state() == before, "a refused call changed the state"
        return True
    except Exception as e:  # noqa: BLE001 - that is the point
        pytest.fail(f"{fn.__qualname__}{args!r:.120} {kwargs!r:.60} leaked {type(e).__name__}: {e}")
    return False


@pytest.mark.parametrize("cache", ["radix", "hash"])
@pytest.mark.parametrize("method", sorted(manager_calls(*served("radix"))))
def test_every_manager_call_refuses_a_bad_argument_with_a_kvlab_error(method, cache):
    params = list(inspect.signature(getattr(CacheManager, method)).parameters.values())[1:]
    refused = 0
    for i in range(len(params)):
        for bad in fresh_bad():
            cm, reqs, batch = served(cache)
            args = list(manager_calls(cm, reqs, batch)[method])
            kwargs = {"finished": False} if method == "cache_req" else {}
            if i < len(args):
                args[i] = bad
            elif params[i].kind is inspect.Parameter.VAR_KEYWORD:
                continue
            else:
                kwargs[params[i].name] = bad
            refused += _call(getattr(cm, method), args, kwargs, lambda: manager_state(cm, reqs, stamps=False))
    assert refused >= len(BAD) // 2 or method in READS, "the catalogue reached the method's checks"


def cache_calls(cache) -> dict:
    """Public method -> valid arguments, for a cache with [1 2|3 4] cached and locked by "a"."""
    P = cache.page_size
    if isinstance(cache, HashPrefixCache):
        held = cache.allocate([1, 2, 3, 4, 5]).pages
        handle = cache.match([1, 2, 3, 4])
        cache.lock_handle(handle, owner="a")
        mine = cache.evict_leaves(P)
        return {"lookup": (handle.hashes[0], [1, 2]), "take_cached": (held[0],), "take_free": (),
                "cache_page": (mine[0].page, chain_hash(None, [7, 7]), [7, 7], None),
                "match": ([1, 2, 3],), "pages_needed": ([1, 2, 3],), "allocate": ([1, 2, 8],),
                "free": (list(held),), "append_token": (list(held), [1, 2, 3, 4, 5, 6]),
                "match_prefix": ([1, 2],), "insert_prefix": ([7, 7], [mine[0].page * P, mine[0].page * P + 1]),
                "lock_handle": (handle,), "evict_leaves": (2,), "evict": (2,), "undo_evict": (mine,),
                "undo_lock": (handle, "a"), "undo_free": ([mine[0].page],),
                "undo_insert": ([mine[0].page * P, mine[0].page * P + 1],), "holds": (handle,),
                "is_locked_by": (handle, "a"), "locks_held": (handle, "a")}
    cache.insert_prefix([1, 2, 3, 4], torch.arange(4))
    cache.insert_prefix([5, 5], torch.arange(4, 6))
    handle = cache.match_prefix([1, 2, 3, 4]).handle
    cache.lock_handle(handle, owner="a")
    return {"match_prefix": ([1, 2],), "insert_prefix": ([7, 7], [8, 9]), "lock_handle": (handle,),
            "is_locked_by": (handle, "a"), "locks_held": (handle, "a"), "evict": (2,), "evict_leaves": (2,),
            "undo_evict": ([],), "undo_lock": (handle, "a"), "undo_insert": ([8, 9],)}


def _cache_state(cache):
    if isinstance(cache, HashPrefixCache):
        return hash_cache_state(cache)
    from cache_state import cache_state
    return cache_state(cache, stamps=False)


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_every_prefix_cache_call_refuses_a_bad_argument_with_a_kvlab_error(kind):
    def make():
        return RadixPrefixCache(2, device="cpu") if kind == "radix" else HashPrefixCache(8, 2, device="cpu")

    for method in cache_calls(make()):
        params = list(inspect.signature(getattr(type(make()), method)).parameters.values())[1:]
        refused = 0
        for i in range(len(params)):
            for bad in fresh_bad():
                cache = make()
                args = list(cache_calls(cache)[method])
                kwargs = {}
                if i < len(args):
                    args[i] = bad
                else:
                    kwargs[params[i].name] = bad
                refused += _call(getattr(cache, method), args, kwargs, lambda: _cache_state(cache))
        assert refused >= len(BAD) // 2 or method in READS or not params, f"{method}: the catalogue reached its checks"


@pytest.mark.parametrize("bad", BAD, ids=[f"{i}-{type(b).__name__}" for i, b in enumerate(BAD)])
def test_constructors_and_free_functions_refuse_a_bad_argument_with_a_kvlab_error(bad):
    table = new_page_table(2, 8, 2)
    calls = [lambda: HashPrefixCache(bad, 2), lambda: HashPrefixCache(4, bad), lambda: HashPrefixCache(4, 2, bad),
             lambda: HashPrefixCache(4, 2, uncached_first=bad), lambda: RadixPrefixCache(bad),
             lambda: RadixPrefixCache(2, bad), lambda: CacheManager(bad, 2, table), lambda: CacheManager(4, bad, table),
             lambda: CacheManager(4, 2, bad), lambda: CacheManager(4, 2, table, bad),
             lambda: CacheManager(4, 2, table, page_table_writer=bad),
             lambda: CacheManager(4, 2, table, remap_duplicates=bad), lambda: Req(bad, 0), lambda: Req([1], bad),
             lambda: Req([1], 0, cached_len=bad), lambda: chain_hash(bad, [1, 2]), lambda: chain_hash(None, bad),
             lambda: page_hashes(bad, 2), lambda: page_hashes([1, 2], bad)]
    queue = FreeQueue([3, 1, 2])
    calls += [lambda: queue.append(bad), lambda: queue.appendleft(bad), lambda: queue.remove(bad),
              lambda: queue.restore(bad), lambda: queue.head(bad), lambda: queue.can_restore(bad)]
    cm, reqs, batch = served("hash")
    calls += [lambda: batch.slots(bad)]
    for call in calls:
        try:
            call()
        except KvlabError:
            pass
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{inspect.getsource(call).strip()[:90]} with {bad!r:.40} leaked {type(e).__name__}: {e}")


# --- chapter 09's public attention call -------------------------------------------------------


def _attention_case():
    from kvlab.attention.kv_pool import random_paged_layout

    return random_paged_layout(3, 4, [6, 3], heads=4, kv_heads=2, head_dim=16, device=kvlab_device())


def kvlab_device():
    from kvlab import runtime

    return runtime.DEVICE


#: arguments of fast_paged_decode_attention that only the host judges: a wrong one is refused
#: before any launch (issue 40's list, then the class they stand for)
HOST_RULES = [("config", {"block_n": 16}), ("config", (16, True, 4, 2)), ("max_context", "long"),
              ("max_context", 0), ("num_splits", 10**12), ("num_splits", 0), ("num_splits", True),
              ("num_splits", 2.0), ("scale", float("nan")), ("scale", 0.0), ("scale", -1.0), ("scale", True),
              ("scale", float("inf")), ("scale", "0.5"), ("out_dtype", 5), ("out_dtype", True),
              ("out_dtype", torch.int32), ("out_dtype", "float32"), ("check", "yes"), ("check", 1)]


@pytest.mark.parametrize("name, bad", HOST_RULES, ids=[f"{n}={b!r:.20}" for n, b in HOST_RULES])
def test_the_fast_attention_call_refuses_a_bad_option_before_any_launch(name, bad, kernel_run):
    from kvlab.attention.paged_attention import fast_paged_decode_attention
    from kvlab.base.errors import InvalidArgument
    from kvlab.attention import split_kernels as fast_attention

    q, k, v, table, rows, lens = _attention_case()
    fast_paged_decode_attention(q, k, v, table, rows, lens)                 # a plan for good arguments
    before = (k.clone(), v.clone())

    def no_launch(*args, **kwargs):
        raise AssertionError("launched")

    kernel_run(fast_attention.split_decode_kernel, no_launch)
    for _ in range(2):                  # the second time a cached plan must not let it through
        with pytest.raises(InvalidArgument) as err:
            fast_paged_decode_attention(q, k, v, table, rows, lens, **{name: bad})
        assert err.value.argument.split(".")[0] == name, err.value
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


def test_the_fast_attention_call_takes_any_integer_kvlab_takes_for_num_splits():
    """kvlab's rule for an integer argument (kvlab.args): an int, a NumPy integer or a 0-d integer
    tensor, not a bool: each gives what the int gives."""
    import numpy as np

    from kvlab.attention.paged_attention import fast_paged_decode_attention

    args = _attention_case()
    want = fast_paged_decode_attention(*args, num_splits=2)
    for splits in (np.int64(2), np.int32(2), torch.tensor(2)):
        torch.testing.assert_close(fast_paged_decode_attention(*args, num_splits=splits), want)
    torch.testing.assert_close(fast_paged_decode_attention(*args, max_context=np.int64(6)),
                               fast_paged_decode_attention(*args, max_context=6))


@pytest.mark.parametrize("position", range(6))
def test_every_argument_of_the_fast_attention_call_is_refused_with_a_kvlab_error(position):
    """Each positional argument in turn replaced by each value of the catalogue: accepted, or
    refused with a kvlab error, the pools unchanged; never a raw Python, torch or Triton error."""
    from kvlab.attention.paged_attention import check_attention_errors, fast_paged_decode_attention

    for bad in fresh_bad():
        args = list(_attention_case())
        before = (args[1].clone(), args[2].clone())
        args[position] = bad
        try:
            fast_paged_decode_attention(*args)
            check_attention_errors()
        except KvlabError:
            pass
        except Exception as e:  # noqa: BLE001 - that is the point
            pytest.fail(f"argument {position} = {bad!r:.40} leaked {type(e).__name__}: {e}")
        k, v = (args[1], args[2]) if position not in (1, 2) else before
        assert torch.equal(k, before[0]) and torch.equal(v, before[1]), "a refused call changed a pool"


@pytest.mark.parametrize("name", ["scale", "num_splits", "config", "out_dtype", "max_context", "check"])
def test_every_option_of_the_fast_attention_call_is_refused_with_a_kvlab_error(name):
    from kvlab.attention.paged_attention import check_attention_errors, fast_paged_decode_attention

    refused = 0
    for bad in fresh_bad():
        args = _attention_case()
        try:
            out = fast_paged_decode_attention(*args, **{name: bad})
            check_attention_errors()
        except KvlabError:
            refused += 1
            continue
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{name}={bad!r:.40} leaked {type(e).__name__}: {e}")
        assert out.shape == args[0].shape and not torch.isnan(out).any(), f"{name}={bad!r:.40}"
    assert refused >= len(BAD) // 2, "the catalogue reached the option's checks"
