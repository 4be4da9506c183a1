"""A KV hierarchy on a CPU with K/V whose right value is known everywhere (chapter 13's tests).

The K/V of the token at position ``i`` is a function of the tokens ``[0, i]`` (a chained hash,
stretched into floats): any page loaded from the wrong host page, the wrong file or for the
wrong prefix shows up as a wrong value, without a model. :class:`Scene` is a cache manager on a
:class:`~kvlab.prefix.tiered_cache.TieredRadixCache` with real copies; :meth:`Scene.serve` runs
one request the way a server does: admission with a load-back, a check of every position it
found cached, the prefill of the rest, one decode step, the end.
"""
from __future__ import annotations

import hashlib

import torch

from kvlab.attention.kv_pool import KVPool
from kvlab.manager.cache_manager import CacheManager, Req
from kvlab.alloc.paging import new_page_table
from kvlab.prefix.disk_store import DiskStore, KVIdentity
from kvlab.prefix.host_tier import HostTier, KVLayout
from kvlab.prefix.tiered_cache import TieredRadixCache
from kvlab.serving.kv_copies import KVCopies
from kvlab.serving.load_back import admit_with_load_back

LAYERS, HEADS, DIM = 2, 2, 3


def kv_values(ids) -> list[torch.Tensor]:
    """``[2, layers, heads, dim]`` per position of ``ids``: the K/V a model would compute there."""
    out, h = [], b""
    n = 2 * LAYERS * HEADS * DIM
    for t in ids:
        h = hashlib.blake2b(h + int(t).to_bytes(8, "little", signed=True), digest_size=16).digest()
        raw = torch.frombuffer(bytearray(hashlib.shake_128(h).digest(4 * n)), dtype=torch.int32)
        out.append((raw.float() / 2**31).view(2, LAYERS, HEADS, DIM))
    return out


def layout() -> KVLayout:
    return KVLayout(LAYERS, HEADS, DIM, torch.float32)


class Scene:
    """A cache manager of ``device_pages`` pages over a tiered cache with ``host_pages`` and,
    given a ``directory``, a disk store (model ``model``) of ``disk_pages``."""

    def __init__(self, page_size=4, device_pages=10, host_pages=12, policy="write_back", *,
                 directory=None, disk_pages=1000, model="scene", rows=2, max_len=128, device="cpu"):
        P = self.P = page_size
        device = torch.device(device)
        self.pool = KVPool((device_pages + 1) * P, LAYERS, HEADS, DIM, device=device)
        self.host = HostTier(host_pages, P, layout(), pin=device.type == "cuda")
        self.disk = (DiskStore(directory, KVIdentity.of(model, layout(), P), disk_pages)
                     if directory is not None else None)
        self.cache = TieredRadixCache(P, device, host=self.host, policy=policy, disk=self.disk,
                                      copies=KVCopies(self.pool, self.host))
        self.manager = CacheManager(device_pages, P, new_page_table(rows, max_len, P, device=device),
                                    prefix_cache=self.cache, page_table_writer="host")
        self.loads: list = []

    def write(self, req: Req, start: int, end: int) -> None:
        """What the forward pass does: the K/V of positions [start, end) into the row's slots."""
        values = kv_values(req.input_ids[:end])
        row = self.manager.page_table[req.table_idx]
        for pos in range(start, end):
            slot = int(row[pos])
            self.pool.k[:, slot] = values[pos][0].to(self.pool.k.device)
            self.pool.v[:, slot] = values[pos][1].to(self.pool.v.device)

    def check_row(self, req: Req, n: int) -> None:
        """Positions [0, n) of the request's row hold the right K/V."""
        values = kv_values(req.input_ids[:n])
        row = self.manager.page_table[req.table_idx]
        for pos in range(n):
            slot = int(row[pos])
            got = torch.stack([self.pool.k[:, slot], self.pool.v[:, slot]]).cpu()
            assert torch.equal(got, values[pos]), (f"position {pos} (slot {slot}) of row "
                                                   f"{req.table_idx} holds the wrong K/V")

    def serve(self, ids, row: int = 0, answer: int = 3):
        """One request of ``ids`` on ``row``: load-back, check, prefill, one decode step, done.
        Returns its :class:`~kvlab.serving.load_back.LoadBack`."""
        req = Req(list(ids), table_idx=row)
        got = admit_with_load_back(self.manager, req)
        self.loads.append(got)
        self.check_row(req, req.cached_len)
        start = req.cached_len
        req.device_len = req.input_len
        batch = self.manager.mixed_step([req], [])
        self.write(req, start, req.input_len)
        self.manager.complete_step(batch, [answer])
        batch = self.manager.decode_step([req])
        self.write(req, req.input_len - 1, req.input_len)
        self.manager.complete_step(batch, [answer + 1], [True])
        return got

    def check(self) -> None:
        """The manager's conservation law and the cache's tiers; every cached page right."""
        if self.pool.k.is_cuda:
            torch.cuda.synchronize()
            self.cache.copies.drain()
        self.manager.check_integrity()
        self.cache.check_integrity()
        for node in self.cache.nodes():
            path = list(node.path_to_root())[::-1]
            ids = [t for n in path for t in n.key]
            values = kv_values(ids)[len(ids) - node.length:]
            if node.on_device:
                for i, slot in enumerate(node.value.tolist()):
                    got = torch.stack([self.pool.k[:, slot], self.pool.v[:, slot]]).cpu()
                    assert torch.equal(got, values[i]), f"node {node.uid}, its token {i}: wrong K/V on the device"
            for j, page in enumerate(node.host or ()):
                for i in range(self.P):
                    got = self.host.kv[page, :, :, i].permute(1, 0, 2, 3)
                    assert torch.equal(got, values[j * self.P + i]), (
                        f"node {node.uid}, page {j}: wrong K/V in host page {page}")
