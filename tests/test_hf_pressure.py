"""PagedGenerator under memory pressure, with every policy of chapter 12 (kvlab.serving.pressure).

Whatever the policy, and however often a request is preempted, retracted or swapped out, its
tokens (and logits, float32) are exactly ``model.generate``'s for the prompt alone: page sizes
1 and 16, chunked prefill and the padded decode path on, EOS; a request that can never fit
alone is refused before anything changes; a failure inside the swap copies leaves the
generator usable. Pools are chosen small enough that every policy that can stop a request
does (each test asserts it did).
"""
from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", minversion="4.56",
    reason="kvlab.serving.hf needs transformers >= 4.56: pip install 'transformers>=4.56'")

import kvlab  # noqa: E402
from kvlab import InvalidArgument, OutOfPages  # noqa: E402
from kvlab.serving.hf import PagedGenerator, tiny_model  # noqa: E402
from kvlab.serving.hf.swap import HostKV  # noqa: E402
from kvlab.serving.pressure import RecomputeOnPreempt  # noqa: E402

from faults import Boom, failing  # noqa: E402

ATOL = 1e-4
POLICIES = ["reserve", "recompute", "retract", "swap"]
#: (page size, pages): one long request fits alone, two do not for long
POOLS = {1: 50, 16: 3}
MAX_NEW = 10


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model("llama", str(tmp_path_factory.mktemp("llama")), seed=0, device=kvlab.DEVICE)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randrange(128) for _ in range(n)] for n in (9, 17, 4, 12, 3, 6)]


def reference(model, prompt, max_new_tokens):
    out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_new_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float().cpu()


@pytest.fixture(scope="module")
def expected(model, prompts):
    return [reference(model, p, MAX_NEW) for p in prompts]


def assert_all_back(gen):
    """Nothing runs, every page is free or evictable, the books balance."""
    m = gen.manager
    m.check_integrity()
    assert m.running == [] and m.available_pages == gen.num_pages


@pytest.mark.parametrize("page_size", sorted(POOLS))
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_generates_tokens_under_pressure(model, prompts, expected, policy, page_size):
    gen = PagedGenerator(model, page_size=page_size, num_pages=POOLS[page_size], max_running=6,
                         prefill_budget=7, policy=policy)
    got = gen.generate(prompts, max_new_tokens=MAX_NEW, output_logits=True)
    for i, (want_tokens, want_logits) in enumerate(expected):
        assert got[i] == want_tokens, f"{policy}, prompt {i}: {got[i]} != {want_tokens}"
        assert float((gen.logits[i] - want_logits).abs().max()) <= ATOL
    stops = sum(r.stops for r in gen.requests)
    st = gen.stats
    assert gen.stats["chunks"] > 0 and gen.stats["graph_steps"] > 0   # chunks and padded decode ran
    if policy == "reserve":
        assert stops == 0 and st["reserved_unused"] > 0
    else:  # the pool forced this policy to stop requests, and it says how
        assert stops > 0, f"{policy} never had to make room: the test's pool is too large"
        assert stops == st["preemptions"] + st["retractions"] + st["swaps_out"]
        assert {"recompute": st["preemptions"], "retract": st["retractions"],
                "swap": st["swaps_out"]}[policy] == stops
    if policy == "swap":
        assert st["swaps_in"] == st["swaps_out"] and st["recomputed_tokens"] == 0
        assert st["swapped_in_bytes"] <= st["swapped_out_bytes"]
    if policy in ("recompute", "retract"):
        assert st["recomputed_tokens"] == sum(r.recomputed for r in gen.requests) > 0
    assert_all_back(gen)
    # the same generator again: the same tokens (a warm prefix cache, the same policy state)
    assert gen.generate(prompts[:2], max_new_tokens=MAX_NEW) == got[:2]
    assert_all_back(gen)


@pytest.mark.parametrize("policy", ["recompute", "retract", "swap"])
def test_eos_ends_a_request_under_pressure_as_generate_does(model, prompts, expected, policy, monkeypatch):
    eos = expected[1][0][3]             # prompt 1 stops at its 4th token; others where it appears
    monkeypatch.setattr(model.generation_config, "eos_token_id", [eos])
    want = [reference(model, p, MAX_NEW)[0] for p in prompts]
    gen = PagedGenerator(model, page_size=4, num_pages=8, max_running=6, prefill_budget=7, policy=policy)
    got = gen.generate(prompts, max_new_tokens=MAX_NEW)
    assert got == want and got[1][-1] == eos and gen.requests[1].finished_by == "eos"
    assert sum(r.stops for r in gen.requests) > 0
    assert_all_back(gen)


def test_whole_prompts_and_plain_decode_under_pressure(model, prompts, expected):
    gen = PagedGenerator(model, page_size=16, num_pages=3, max_running=6, chunked_prefill=False,
                         decode_graphs="off", policy="swap")
    got = gen.generate(prompts, max_new_tokens=MAX_NEW)
    assert got == [t for t, _ in expected] and gen.stats["swaps_out"] > 0
    assert gen.stats["chunks"] == 0 and gen.stats["graph_steps"] == 0
    assert_all_back(gen)


def test_a_host_pool_too_small_falls_back_to_recompute(model, prompts, expected):
    gen = PagedGenerator(model, page_size=1, num_pages=50, max_running=6, prefill_budget=7,
                         policy="swap", host_pages=8)
    got = gen.generate(prompts, max_new_tokens=MAX_NEW)
    assert got == [t for t, _ in expected]
    assert gen.stats["preemptions"] > 0                # victims the host pool could not hold
    assert gen.stats["recomputed_tokens"] > 0
    assert_all_back(gen)


def test_chapter_07s_recompute_keeps_nothing_and_still_matches(model, prompts, expected):
    gen = PagedGenerator(model, page_size=1, num_pages=50, max_running=6, prefill_budget=7,
                         policy=RecomputeOnPreempt(keep_computed=False, admit_after_preempt=True))
    assert gen.generate(prompts, max_new_tokens=MAX_NEW) == [t for t, _ in expected]
    assert gen.stats["preemptions"] > 0
    assert_all_back(gen)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_request_that_can_never_fit_alone_is_refused_before_anything_changes(model, policy):
    gen = PagedGenerator(model, page_size=4, num_pages=4, max_running=2, policy=policy)
    before = (sorted(gen.manager.free_slots.tolist()), gen.page_table.clone())
    with pytest.raises(OutOfPages):
        gen.generate([[1, 2, 3], list(range(14))], max_new_tokens=4)   # 17 positions > 16 slots
    assert (sorted(gen.manager.free_slots.tolist()), gen.page_table.clone())[0] == before[0]
    assert torch.equal(gen.page_table, before[1])
    assert_all_back(gen)


def test_end_after_ends_requests_the_scheduler_did_not_foresee(model, prompts, expected):
    gen = PagedGenerator(model, page_size=4, num_pages=9, max_running=6, policy="recompute")
    ends = [2, 10, 1, 5, 3, 7]
    got = gen.generate(prompts, max_new_tokens=MAX_NEW, end_after=ends)
    assert got == [t[:e] for (t, _), e in zip(expected, ends)]
    assert [r.finished_by for r in gen.requests] == ["stop", "length", "stop", "stop", "stop", "stop"]
    assert all(len(r.token_steps) == r.generated for r in gen.requests)
    for bad, argument in (([1, 2], "end_after"), ([0] * 6, "end_after[0]"), ("abc", "end_after")):
        with pytest.raises(InvalidArgument, match=argument.replace("[", r"\[")):
            gen.generate(prompts, max_new_tokens=MAX_NEW, end_after=bad)


@pytest.mark.parametrize("kw, argument", [(dict(policy="lifo"), "policy"), (dict(policy=3), "policy"),
                                          (dict(policy="swap", host_pages=-1), "host_pages"),
                                          (dict(policy="swap", host_pages=1.5), "host_pages")])
def test_bad_policy_options_are_refused(model, kw, argument):
    with pytest.raises(InvalidArgument, match=argument):
        PagedGenerator(model, page_size=4, num_pages=8, **kw)


@pytest.mark.parametrize("where", ["save", "load"])
def test_a_failing_host_copy_leaves_the_generator_usable(model, prompts, expected, where):
    gen = PagedGenerator(model, page_size=1, num_pages=50, max_running=6, prefill_budget=7, policy="swap")
    gen.host.__dict__[where] = failing(getattr(HostKV, where).__get__(gen.host), 0)
    with pytest.raises(Boom):
        gen.generate(prompts, max_new_tokens=MAX_NEW)
    del gen.host.__dict__[where]
    assert_all_back(gen)
    assert gen.generate(prompts, max_new_tokens=MAX_NEW) == [t for t, _ in expected]
    assert_all_back(gen)


@pytest.mark.parametrize("page_size", [1, 3, 4])
def test_host_pool_round_trip_by_pages_and_slots(page_size):
    from kvlab.attention.kv_pool import KVPool

    gen = torch.Generator().manual_seed(page_size)
    pool = KVPool(40, 2, 2, 3, device="cpu")
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    n_host = -(-11 // page_size) + 1
    host = HostKV(pool, page_size, n_host)
    slots = torch.randperm(40, generator=gen)[:11]               # a row's slots, in any order
    pages = host.save(pool, slots)
    assert len(pages) == -(-11 // page_size) and len(host.free_pages) == n_host - len(pages)
    want_k, want_v = pool.k[:, slots].clone(), pool.v[:, slots].clone()
    pool.k.zero_()
    pool.v.zero_()
    dest = torch.randperm(40, generator=gen)[:7]
    host.load(pool, pages, 4, 11, dest)                          # positions 4..10 only
    assert torch.equal(pool.k[:, dest], want_k[:, 4:]) and torch.equal(pool.v[:, dest], want_v[:, 4:])
    host.release(pages)
    assert sorted(host.free_pages) == list(range(n_host))
    with pytest.raises(InvalidArgument):
        host.release(pages)                                      # given back twice
    with pytest.raises(OutOfPages):
        host.save(pool, torch.arange(40))                        # more than the host holds
    assert sorted(host.free_pages) == list(range(n_host))
