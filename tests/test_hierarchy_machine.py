"""A hypothesis state machine serves multi-turn conversations through the KV hierarchy (chapter
13) on a CPU, with real copies and a real disk store, and injects what goes wrong in practice:
an interrupt or an error at any line of the manager, the tiered cache, the host tier, the
copies, the load-back and the disk store (inside a copy included); a host pool kept full; a file
of the store deleted, cut short, with a flipped byte, or replaced by another model's; a second
cache (another process) on the same directory serving and evicting meanwhile.

After every step: the manager's conservation law (every device page free, cached or a running
request's, once), the cache's tiers (every host page in one node or free, the device part closed
under parents, every node somewhere), and every page of every tier holds the right K/V -- and
every request served checked that each position it found cached, loaded or read from disk holds
the K/V its tokens give (so no token a model computed from them could differ).
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile

import pytest
from faults import Boom, Interrupted, interrupt_at_line
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import kvlab.manager.cache_manager
import kvlab.manager.undo
import kvlab.prefix.disk_store
import kvlab.prefix.host_tier
import kvlab.prefix.radix_cache
import kvlab.prefix.tier_host
import kvlab.prefix.tiered_cache
import kvlab.serving.kv_copies
import kvlab.serving.load_back
from hierarchy_helpers import Scene, kv_values
from kvlab.prefix.disk_store import SUFFIX

MODULES = [kvlab.manager.cache_manager, kvlab.manager.undo, kvlab.prefix.radix_cache,
           kvlab.prefix.tiered_cache, kvlab.prefix.tier_host, kvlab.prefix.host_tier,
           kvlab.serving.kv_copies, kvlab.serving.load_back, kvlab.prefix.disk_store]
FAIL = st.one_of(st.none(), st.none(), st.tuples(st.integers(1, 900), st.sampled_from([Interrupted, Boom])))


class HierarchyMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**16), policy=st.sampled_from(
        ["write_through", "write_through_selective", "write_back"]), page_size=st.sampled_from([1, 4]))
    def setup(self, seed, policy, page_size):
        self.rng = random.Random(seed)
        self.dir = tempfile.mkdtemp(prefix="kvlab-store-")
        self.P = page_size
        unit = 4
        self.scene = Scene(page_size, device_pages=6 * unit // page_size, host_pages=10 * unit // page_size,
                           policy=policy, directory=self.dir, disk_pages=40 * unit // page_size)
        self.other = Scene(page_size, device_pages=4 * unit // page_size, host_pages=4 * unit // page_size,
                           policy=policy, directory=self.dir, disk_pages=40 * unit // page_size)
        self.longest = 4 * unit - 2          # every request fits the smaller pool, with room to spare
        self.chats = [[self.rng.randrange(100) for _ in range(self.rng.randint(2, 9))] for _ in range(5)]

    def _settle(self, scene) -> None:
        """What a server does after a failed step: every request still holding a row goes."""
        for req in list(scene.manager.running):
            scene.manager.release_req(req)

    @rule(chat=st.integers(0, 4), grow=st.integers(0, 6), fail=FAIL)
    def serve(self, chat, grow, fail):
        ids = self.chats[chat] + [self.rng.randrange(100) for _ in range(grow)]
        if len(ids) > self.longest:
            ids = ids[-self.longest // 2:]
        self.chats[chat] = ids
        if fail is None:
            self.scene.serve(ids)
            return
        k, error = fail
        try:
            with interrupt_at_line(MODULES, k, error=error):
                self.scene.serve(ids)
        except (Boom, Interrupted):
            self._settle(self.scene)

    @rule(n=st.integers(1, 6))
    def fill_host(self, n):
        """Fresh prompts push everything else down the tiers."""
        for _ in range(n):
            self.scene.serve([self.rng.randrange(100, 200) for _ in range(self.rng.randint(4, 12))])

    @rule(how=st.sampled_from(["delete", "truncate", "flip", "foreign"]))
    def damage_a_file(self, how):
        files = sorted(f for f in os.listdir(self.dir) if f.endswith(SUFFIX))
        if not files:
            return
        path = os.path.join(self.dir, self.rng.choice(files))
        if how == "delete":
            os.remove(path)
            return
        data = bytearray(open(path, "rb").read())
        if how == "truncate":
            data = data[: self.rng.randrange(len(data))]
        elif how == "flip":
            data[self.rng.randrange(len(data))] ^= 0x40
        else:
            other = [f for f in files if os.path.join(self.dir, f) != path]
            if not other:
                return
            data = open(os.path.join(self.dir, self.rng.choice(other)), "rb").read()
        with open(path, "wb") as f:
            f.write(data)

    @rule(chat=st.integers(0, 4))
    def another_process_serves(self, chat):
        self.other.serve(self.chats[chat][: self.rng.randint(1, len(self.chats[chat]))])
        self.other.cache.persist()

    @rule()
    def persist(self):
        self.scene.cache.persist()

    @invariant()
    def every_page_in_one_place_with_the_right_kv(self):
        if hasattr(self, "scene"):
            self.scene.check()
            self.other.check()


TestHierarchyMachine = HierarchyMachine.TestCase
TestHierarchyMachine.settings = settings(max_examples=30, stateful_step_count=25, deadline=None)


def test_a_second_process_reads_what_the_first_wrote(tmp_path):
    """Two real processes on one directory: the second finds the first's pages, right."""
    script = (
        "import sys, random; sys.path.insert(0, {tests!r})\n"
        "from hierarchy_helpers import Scene\n"
        "rng = random.Random(7); ids = [rng.randrange(100) for _ in range(30)]\n"
        "s = Scene(4, device_pages=10, host_pages=10, directory={d!r})\n"
        "got = s.serve(ids); s.check(); s.cache.persist()\n"
        "print(got.disk)\n")
    tests = os.path.dirname(__file__)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    runs = [subprocess.run([sys.executable, "-c", script.format(tests=tests, d=str(tmp_path))], env=env,
                           capture_output=True, text=True, timeout=300) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    first, second = (int(r.stdout.split()[-1]) for r in runs)
    assert first == 0 and second >= 28, f"the second process loaded {second} tokens from disk"


@pytest.mark.parametrize("how", ["truncate", "flip", "foreign", "header"])
def test_a_damaged_or_foreign_file_is_never_loaded(how, tmp_path):
    rng = random.Random(2)
    ids = [rng.randrange(100) for _ in range(17)]
    first = Scene(4, device_pages=8, host_pages=8, directory=tmp_path, model="m")
    first.serve(ids)
    first.cache.persist()
    files = sorted(tmp_path.glob("*" + SUFFIX), key=os.path.getmtime)
    victim = files[1]
    data = bytearray(victim.read_bytes())
    if how == "truncate":
        data = data[:-5]
    elif how == "flip":
        data[-3] ^= 1
    elif how == "header":
        data[20] ^= 1
    victim.write_bytes(bytes(data))
    model = "other" if how == "foreign" else "m"
    second = Scene(4, device_pages=8, host_pages=8, directory=tmp_path, model=model)
    got = second.serve(ids)
    second.check()
    if how == "foreign":
        assert got.disk == 0, "another model's pages are other files"
    else:
        assert got.disk == 4, f"the pages before the damaged one load, it and those after it do not: {got}"
        assert sum(second.disk.rejected.values()) == 1
    assert kv_values(ids)  # (the K/V of every loaded position was checked by serve)
