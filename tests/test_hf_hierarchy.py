"""PagedGenerator over a KV hierarchy (chapter 13): ``host_cache=`` and ``disk_cache=``.

Multi-turn chats in a pool too small for their histories, so that returning conversations come
back from host memory (and disk): every answer is exactly ``model.generate``'s, float32 logits
included, with every write policy, page sizes 1 and 16, chunked prefill, the padded decode path
(CUDA graphs on a GPU), overlap scheduling on and off, and every memory policy of chapter 12. A
second generator on the same disk -- a restarted kernel, a second process -- reads the first
one's pages and computes less. A failure inside a copy leaves the generator usable. Bad tiers
are refused by name before anything is built.
"""
from __future__ import annotations

import os
import random

import pytest

transformers = pytest.importorskip("transformers", minversion="4.56")

import kvlab  # noqa: E402
from faults import Boom, failing  # noqa: E402
from hf_helpers import ATOL, reference  # noqa: E402
from kvlab.base.errors import InvalidArgument  # noqa: E402
from kvlab.serving.hf import DiskCache, HostCache, PagedGenerator, tiny_model  # noqa: E402

VOCAB = 128
POLICIES = ("write_through", "write_through_selective", "write_back")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model("llama", str(tmp_path_factory.mktemp("llama")), seed=0, device=kvlab.DEVICE)


REFS: dict = {}


class Chats:
    """Conversations that re-send their histories; every answer checked against generate."""

    def __init__(self, model, n=4, seed=3):
        self.model, self.rng = model, random.Random(seed)
        self.histories = [[self.rng.randrange(VOCAB) for _ in range(self.rng.randint(8, 14))] for _ in range(n)]

    def copy(self) -> "Chats":
        twin = Chats(self.model, 0)
        twin.rng.setstate(self.rng.getstate())
        twin.histories = [list(h) for h in self.histories]
        return twin

    def round(self, gen, max_new=4):
        for c in range(len(self.histories)):
            self.histories[c] = self.histories[c] + [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(2, 5))]
        prompts = [list(h) for h in self.histories]
        got = gen.generate(prompts, max_new_tokens=max_new, output_logits=True)
        for i, p in enumerate(prompts):
            key = (id(self.model), tuple(p), max_new)
            if key not in REFS:
                REFS[key] = reference(self.model, p, max_new)
            want, logits = REFS[key]
            assert got[i] == want, f"chat {i} (length {len(p)}): kvlab {got[i]} != generate {want}"
            assert float((gen.logits[i] - logits).abs().max()) <= ATOL
            self.histories[i] = p + got[i]
        gen.manager.check_integrity()
        return gen.stats


#: (page size, device pages): a chat fits alone, the chats' histories do not fit together
POOLS = {1: 48, 4: 14, 16: 5}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", POLICIES)
def test_every_write_policy_gives_generates_tokens_from_the_host(model, policy, page_size):
    chats = Chats(model)
    overlap = policy != "write_back"       # both ways, across the matrix
    gen = PagedGenerator(model, page_size=page_size, num_pages=POOLS[page_size], max_running=2,
                         prefill_budget=9, overlap=overlap,
                         host_cache=HostCache(pages=8 * POOLS[page_size], write_policy=policy))
    loaded = chunks = 0
    for _ in range(3):
        st = chats.round(gen)
        loaded, chunks = loaded + st["prefill_loaded_host"], chunks + st["chunks"]
    assert chunks > 0, "chunked prefill ran"
    assert loaded > 0, "the pool was meant to be too small: some histories come back from the host"
    stats = gen.hierarchy.copies.collect()
    assert stats["h2d_bytes"] > 0 and stats["d2h_bytes"] > 0


@pytest.mark.parametrize("pressure", ["reserve", "recompute", "retract", "swap"])
def test_every_memory_policy_runs_over_the_hierarchy(model, pressure):
    chats = Chats(model, seed=5)
    gen = PagedGenerator(model, page_size=4, num_pages=POOLS[4], max_running=4, prefill_budget=9,
                         policy=pressure, host_cache=HostCache(pages=48, write_policy="write_back"))
    loaded = sum(chats.round(gen, max_new=6)["prefill_loaded_host"] for _ in range(3))
    assert loaded > 0, "some histories came back from host memory"


def test_a_second_generator_reads_the_first_ones_disk(model, tmp_path):
    chats = Chats(model, seed=7)
    tiers = dict(host_cache=HostCache(pages=24, write_policy="write_back"), disk_cache=DiskCache(tmp_path))
    first = PagedGenerator(model, page_size=4, num_pages=POOLS[4], max_running=2, **tiers)
    for _ in range(2):
        chats.round(first)
    assert first.persist_prefix_cache() > 0
    assert len(list(tmp_path.iterdir())) > 0
    twin = chats.copy()                       # the same next round, for a generator without the disk
    warm = PagedGenerator(model, page_size=4, num_pages=POOLS[4], max_running=2, **tiers)
    st = chats.round(warm)
    assert st["prefill_loaded_disk"] > 0, "the first generator's pages were read from disk"
    cold = PagedGenerator(model, page_size=4, num_pages=POOLS[4], max_running=2,
                          host_cache=HostCache(pages=24))
    assert twin.round(cold)["prefill_computed"] > 2 * st["prefill_computed"]


def test_a_foreign_model_never_reads_the_disk(model, tmp_path):
    other = tiny_model("llama", seed=1, device=kvlab.DEVICE)
    chats = Chats(model, seed=9)
    first = PagedGenerator(model, page_size=4, num_pages=POOLS[4], max_running=2,
                           host_cache=HostCache(pages=24), disk_cache=DiskCache(tmp_path))
    chats.round(first)
    first.persist_prefix_cache()
    foreign = PagedGenerator(other, page_size=4, num_pages=POOLS[4], max_running=2,
                             host_cache=HostCache(pages=24), disk_cache=DiskCache(tmp_path))
    foreign.generate([list(h) for h in chats.histories], max_new_tokens=2)
    assert foreign.stats["prefill_loaded_disk"] == 0, "another model's KV is other files"


def test_a_failure_inside_a_copy_leaves_the_generator_usable(model):
    chats = Chats(model, seed=11)
    gen = PagedGenerator(model, page_size=4, num_pages=POOLS[4], max_running=2,
                         host_cache=HostCache(pages=40, write_policy="write_through"))
    chats.round(gen)
    chats.round(gen)
    copies = gen.hierarchy.copies
    for name in ("load", "save"):
        real = getattr(copies, name)
        setattr(copies, name, failing(real, 0))
        try:
            with pytest.raises(Boom):
                for _ in range(3):
                    chats.round(gen)
        finally:
            setattr(copies, name, real)
        gen.manager.check_integrity()
        assert gen.manager.running == []
        chats.round(gen)                    # and the next call is generate's again


def test_bad_tiers_are_refused_by_name_before_anything_is_built(model, tmp_path):
    bad = [(dict(host_cache=0), "host_cache.pages"), (dict(host_cache=True), "host_cache"),
           (dict(host_cache="big"), "host_cache"),
           (dict(disk_cache=str(tmp_path)), "disk_cache"),
           (dict(host_cache=8, disk_cache=str(tmp_path / "missing")), "disk_cache.directory"),
           (dict(host_cache=8, disk_cache=3), "disk_cache")]
    (tmp_path / "a_file").write_text("x")
    bad.append((dict(host_cache=8, disk_cache=str(tmp_path / "a_file")), "disk_cache.directory"))
    for kwargs, argument in bad:
        with pytest.raises(InvalidArgument) as e:
            PagedGenerator(model, page_size=4, num_pages=8, **kwargs)
        assert e.value.argument == argument, (kwargs, e.value)
    with pytest.raises(InvalidArgument, match="write_policy"):
        HostCache(8, write_policy="write_around")
    with pytest.raises(InvalidArgument, match="host_cache.pages"):
        HostCache(-3)
    if os.geteuid() != 0:                   # (root may write a read-only directory)
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        with pytest.raises(InvalidArgument, match="read-only"):
            PagedGenerator(model, page_size=4, num_pages=8, host_cache=8, disk_cache=str(ro))
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(["a_file"] + (["ro"] if os.geteuid() else [])), "nothing was written"


def test_a_models_identity_is_its_weights_not_where_it_was_loaded_from(model, tmp_path):
    from kvlab.serving.hf import model_identity

    again = tiny_model("llama", str(tmp_path / "elsewhere"), seed=0, device=kvlab.DEVICE)
    other = tiny_model("llama", str(tmp_path / "other"), seed=1, device=kvlab.DEVICE)
    assert model_identity(again) == model_identity(model) != model_identity(other)
