"""Differential test: chapter 11's hash cache against a port of nano-vllm's block manager.

The port (``tests/nanovllm_port.py``, from nano-vllm at commit 2f352ae) and
:class:`kvlab.HashPrefixCache` are driven by the same traces (new sequences from a few shared
prompts, decode steps, finished sequences) and must agree after every step on the hits, each
sequence's pages, every reference count, the free queue in order, and which pages a lookup
can find. The documented departures are recognised where they happen and end that trace:

* a **stale hit**: nano-vllm leaves a reused page's old hash in ``hash_to_block_id`` and only
  compares the page's tokens, so a prompt can hit a page that holds the same tokens after a
  *different* prefix (wrong KV); kvlab drops the hash when the page is reused;
* a **twin**: when two running sequences fill identical pages, nano-vllm's map points at the
  later page, kvlab's keeps the earlier one (vLLM's lookup returns the first cached, too).
"""
from __future__ import annotations

import random

import pytest

from kvlab import HashPrefixCache
from nanovllm_port import NanoBlockManagerPort, PortSequence


class Departure(Exception):
    """The trace reached a documented departure; what follows is not compared."""


def _agree(port: NanoBlockManagerPort, cache: HashPrefixCache, live: dict, where: str) -> None:
    assert [b.ref_count for b in port.blocks] == cache.ref_count, f"{where}: reference counts"
    assert list(port.free_block_ids) == list(cache.free_queue), f"{where}: free queue order"
    assert port.cached_blocks() == set(cache.hash_to_page.values()), f"{where}: findable pages"
    for sid, (seq, pages) in live.items():
        assert seq.block_table == list(pages), f"{where}: pages of sequence {sid}"
    cache.check_integrity()


class Driver:
    """Runs one operation on both block managers and compares them."""

    def __init__(self, num_pages: int, page_size: int):
        self.port = NanoBlockManagerPort(num_pages, page_size)
        self.cache = HashPrefixCache(num_pages, page_size, device="cpu")
        self.P = page_size
        self.live: dict[int, tuple[PortSequence, tuple[int, ...]]] = {}
        self.hits = 0
        self.next_id = 0

    def new(self, tokens: list[int]) -> bool:
        seq = PortSequence(tokens, self.P)
        if not self.port.can_allocate(seq):
            return False
        if self.port.stale_hit(seq) is not None:
            raise Departure("stale hit")
        self.port.allocate(seq)
        got = self.cache.allocate(tokens)
        assert got.cached_len == seq.num_cached_tokens, "hits"
        self.hits += got.cached_len
        self.live[self.next_id] = (seq, got.pages)
        self.next_id += 1
        return True

    def decode(self, sid: int, token: int) -> bool:
        seq, pages = self.live[sid]
        seq.append_token(token)
        if not self.port.can_append(seq):
            seq.token_ids.pop()
            return False
        if self.port.registers_a_twin(seq):
            raise Departure("twin")
        self.port.may_append(seq)
        self.live[sid] = (seq, self.cache.append_token(pages, seq.token_ids))
        return True

    def finish(self, sid: int) -> None:
        seq, pages = self.live.pop(sid)
        self.port.deallocate(seq)
        self.cache.free(pages)


def _run_trace(seed: int, num_pages: int, page_size: int, steps: int = 120) -> tuple[Driver, str | None]:
    rng = random.Random(seed)
    vocab = 50  # sharing comes from the three prompts; rarely a page repeats by chance
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(page_size, 4 * page_size))]
               for _ in range(3)]
    d = Driver(num_pages, page_size)
    try:
        for step in range(steps):
            op = rng.random()
            if op < 0.35 or not d.live:
                base = rng.choice(prompts)
                tokens = base[: rng.randrange(len(base) + 1)] + [rng.randrange(vocab) for _ in range(rng.randrange(0, 2 * page_size))]
                if tokens:
                    d.new(tokens)
            elif op < 0.8:
                sid = rng.choice(sorted(d.live))
                if not d.decode(sid, rng.randrange(vocab)):
                    d.finish(sid)
            else:
                d.finish(rng.choice(sorted(d.live)))
            _agree(d.port, d.cache, d.live, f"seed {seed}, step {step}")
    except Departure as e:
        return d, str(e)
    return d, None


@pytest.mark.parametrize("page_size", [2, 4])
def test_random_traces_agree_at_every_step(page_size):
    departures, hits, evicted, finished = [], 0, 0, 0
    for seed in range(40):
        d, departure = _run_trace(seed, num_pages=12, page_size=page_size)
        hits, evicted = hits + d.hits, evicted + d.cache.evicted_pages
        if departure is None:
            finished += 1
        else:
            departures.append(departure)
    assert set(departures) <= {"stale hit", "twin"}
    assert finished >= 36, f"only {finished} of 40 traces ran to the end ({departures})"
    # the traces share prompts and run short of pages: hits and evictions are compared too
    assert hits > 0 and evicted > 0


def test_a_stale_hash_gives_nano_vllm_a_hit_on_other_kv_and_kvlab_a_miss():
    # page size 2: [5 6] is cached after [1 2] on a page that is then reused for [5 6] after
    # [3 4] (same tokens, another prefix: other KV), while the page of [1 2] stays cached
    d = Driver(6, 2)
    steps = [("new", [3, 4]),             # 0: page 0 = [3 4], held
             ("new", [1, 2, 5, 6]),       # 1: pages 1 = [1 2], 2 = [5 6] after [1 2]
             ("finish", 1),               # queue 3 4 5 | 2 1: the tail page before its parent
             ("new", [7, 7, 8, 8, 9]),    # 2: takes pages 3 4 5, held
             ("new", [3, 4, 5, 6]),       # 3: hits page 0; page 2 is reused for [5 6] after [3 4]
             ("finish", 2)]
    for i, (op, arg) in enumerate(steps):
        d.new(arg) if op == "new" else d.finish(arg)
        _agree(d.port, d.cache, d.live, f"step {i}")
    assert d.live[3][1] == (0, 2)
    probe = PortSequence([1, 2, 5, 6], 2)
    assert d.port.stale_hit(probe) == 2          # the map still sends [1 2|5 6]'s hash to page 2
    d.port.allocate(probe)
    got = d.cache.allocate([1, 2, 5, 6])
    assert probe.num_cached_tokens == 4          # nano-vllm: [5 6] "hit" on KV computed after [3 4]
    assert got.cached_len == 2 and got.pages[1] != 2  # kvlab: [1 2] only; [5 6] is computed again


def test_twin_pages_nano_vllm_points_at_the_later_one_kvlab_keeps_the_earlier():
    P = 2
    d = Driver(8, P)
    d.new([1, 2, 3])
    d.new([1, 2, 3])                       # shares page [1 2]; its own partial page [3]
    d.decode(0, 4)                         # sequence 0 fills [3 4]: cached
    seq1, _ = d.live[1]
    seq1.append_token(4)
    assert d.port.registers_a_twin(seq1)   # sequence 1 fills an identical [3 4]
    d.port.may_append(seq1)
    pages1 = d.cache.append_token(d.live[1][1], seq1.token_ids)
    first_page, second_page = d.live[0][1][1], pages1[1]
    assert d.port.hash_to_block_id[d.port.blocks[second_page].hash] == second_page  # nano: the later
    assert d.cache.match([1, 2, 3, 4]).pages[1] == first_page                          # kvlab: the earlier
    assert d.cache.page_hash[second_page] is None
    d.cache.check_integrity()
    # kvlab still caches what sequence 1 fills next: its chain runs on from the tokens
    pages1 = d.cache.append_token(pages1, seq1.token_ids + [5])
    pages1 = d.cache.append_token(pages1, seq1.token_ids + [5, 6])
    assert d.cache.match([1, 2, 3, 4, 5, 6]).pages == (d.live[0][1][0], first_page, pages1[2])
