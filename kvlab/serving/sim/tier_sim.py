"""The tier simulator: a KV hierarchy of any size, replayed turn by turn (chapter 13).

The pages here are numbers only -- no K/V is stored -- so a host tier of a million pages costs a
few megabytes of Python lists, and the chapter can draw a hierarchy larger than any laptop. The
cache is the real one (:class:`~kvlab.prefix.tiered_cache.TieredRadixCache` under the real
:class:`~kvlab.CacheManager`, the real load-back); what the simulator adds is a machine:

    tier     capacity (pages)   to the tier above           per transfer
    device   device_pages       --                          --
    host     host.pages         host.read_gbps / write_gbps  host.latency_s
    disk     disk.pages         disk.read_gbps / write_gbps  disk.latency_s

and a prefill rate. Each turn is served alone (one request at a time: no queueing), and its time
to first token is modelled as the disk reads, the host-to-device loads, the write-backs its
evictions waited for, and the prefill of what no tier held::

    ttft = disk pages x page_bytes / disk.read_gbps (+ latency) + loaded pages x page_bytes /
           host.read_gbps (+ latency) + written-back pages x page_bytes / host.write_gbps + computed
           tokens / prefill_tokens_per_s

Defaults: the host link is the pinned bandwidth measured on an H200 (52.7 GB/s host to device,
54.6 back, 9 us per transfer from the 1 MB and 8 MB copies); the disk an assumed NVMe drive
(3 GB/s reads, 2 GB/s writes, 100 us); the prefill rate an assumed 40,000 tokens/s. Pass your
own: ``python -m kvlab.bench --hierarchy`` measures a real model's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from ...base.args import check_int
from ...base.errors import InvalidArgument
from .conversations import Turn

__all__ = ["TierModel", "HierarchyConfig", "MemoryStore", "TurnRecord", "simulate_hierarchy", "summary",
           "H200_HOST", "NVME_DISK"]


class TierModel(NamedTuple):
    """A tier below the device: its capacity in pages and its link to the tier above."""

    pages: int
    read_gbps: float        # towards the device (a load)
    write_gbps: float       # away from it (a copy down)
    latency_s: float = 0.0  # per transfer

    def seconds(self, nbytes: int, *, read: bool = True) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / ((self.read_gbps if read else self.write_gbps) * 1e9)


H200_HOST = TierModel(pages=1 << 20, read_gbps=52.7, write_gbps=54.6, latency_s=9e-6)
NVME_DISK = TierModel(pages=1 << 24, read_gbps=3.0, write_gbps=2.0, latency_s=100e-6)


@dataclass(frozen=True)
class HierarchyConfig:
    """One machine: ``device_pages`` on the GPU, an optional ``host`` and ``disk``
    (:class:`TierModel`), the write policy, the page size and bytes, the prefill rate."""

    device_pages: int = 1024
    host: TierModel | None = None
    disk: TierModel | None = None
    write_policy: str = "write_through_selective"
    page_size: int = 16
    page_bytes: int = 196608            # 16 positions of a 0.5B-shaped model (24 layers, 2 K/V heads of 64, bf16)
    prefill_tokens_per_s: float = 40000.0
    max_len: int = 1 << 15

    def __post_init__(self):
        check_int("config.device_pages", self.device_pages, minimum=2)
        check_int("config.page_size", self.page_size, minimum=1)
        check_int("config.page_bytes", self.page_bytes, minimum=1)
        for name in ("host", "disk"):
            tier = getattr(self, name)
            if tier is not None and (not isinstance(tier, TierModel) or tier.pages < 1
                                     or min(tier.read_gbps, tier.write_gbps) <= 0 or tier.latency_s < 0):
                raise InvalidArgument(f"config.{name}", "None or a TierModel with pages >= 1, bandwidths > 0, "
                                      "latency >= 0", f"got {tier!r}")
        if self.disk is not None and self.host is None:
            raise InvalidArgument("config.disk", "a disk tier under a host tier (pages reach the disk "
                                  "through host memory)", "host=None")
        if not self.prefill_tokens_per_s > 0:
            raise InvalidArgument("config.prefill_tokens_per_s", "> 0", f"got {self.prefill_tokens_per_s!r}")


class MemoryStore:
    """The disk tier as numbers: page hashes, least recently used out past ``pages``."""

    def __init__(self, pages: int):
        self.pages = pages
        self._order: dict[bytes, None] = {}

    def contains(self, h: bytes) -> bool:
        return h in self._order

    def run_length(self, hashes: Sequence[bytes]) -> int:
        for i, h in enumerate(hashes):
            if h not in self._order:
                return i
        return len(hashes)

    def write(self, h: bytes, page=None) -> bool:
        self._order.pop(h, None)
        self._order[h] = None
        while len(self._order) > self.pages:
            del self._order[next(iter(self._order))]
        return True

    def read(self, h: bytes, out=None) -> str:
        if h not in self._order:
            return "missing"
        self._order[h] = self._order.pop(h)
        return ""


class TurnRecord(NamedTuple):
    """What one turn cost: its prompt, where its cached tokens came from, what it computed and
    copied, and its modelled time to first token (seconds)."""

    conversation: int
    index: int
    prompt: int
    device: int
    host: int
    disk: int
    computed: int
    h2d_bytes: int
    d2h_bytes: int
    disk_read_bytes: int
    disk_write_bytes: int
    ttft_s: float


def simulate_hierarchy(turns: Sequence[Turn], config: HierarchyConfig, *, answer_seed: int = 1) -> list[TurnRecord]:
    """Serve ``turns`` one by one through a tiered cache shaped by ``config``; one record each.
    A turn's answer (seeded tokens) becomes part of its conversation's history, as a chat sends."""
    import random

    from ...alloc.paging import new_page_table
    from ...manager.cache_manager import CacheManager, Req
    from ...prefix.host_tier import HostTier
    from ...prefix.tiered_cache import TieredRadixCache
    from ..load_back import admit_with_load_back

    if not isinstance(config, HierarchyConfig):
        raise InvalidArgument("config", "a kvlab.serving.sim.tier_sim.HierarchyConfig", f"got {type(config).__name__}")
    P, rng = config.page_size, random.Random(answer_seed)
    host_pages = config.host.pages if config.host is not None else 1
    cache = TieredRadixCache(P, "cpu", host=HostTier(host_pages, P), policy=config.write_policy,
                             disk=MemoryStore(config.disk.pages) if config.disk is not None else None)
    manager = CacheManager(config.device_pages, P, new_page_table(1, config.max_len, P, device="cpu"),
                           prefix_cache=cache, page_table_writer="host")
    history: dict[int, list[int]] = {}
    records = []
    for turn in turns:
        ids = history.get(turn.conversation, []) + list(turn.message)
        answer = [rng.randrange(1 << 20) for _ in range(turn.answer_len)]
        before = dict(cache.stats)
        req = Req(list(ids), table_idx=0)
        if config.host is None:                       # GPU-only: nothing below the device
            manager.admit(req)
            got = (req.cached_len, 0, 0)
        else:
            lb = admit_with_load_back(manager, req)
            got = (lb.device, lb.host - lb.disk, lb.disk)
        computed = req.input_len - req.cached_len
        req.device_len = req.input_len
        manager.complete_step(manager.mixed_step([req], []), [answer[0]])
        if len(answer) > 1:                           # the rest of the answer in one pass
            req.input_ids.extend(answer[1:-1])
            req.device_len = req.input_len
            manager.complete_step(manager.mixed_step([req], []), [answer[-1]], [True])
        else:
            manager.complete_step(manager.decode_step([req]), [answer[0]], [True])
        history[turn.conversation] = ids + answer
        delta = {k: cache.stats[k] - before.get(k, 0) for k in cache.stats}
        B = config.page_bytes
        h2d, d2h = delta["loaded"] * B, delta["copied_to_host"] * B
        disk_r, disk_w = delta["disk_read"] * B, delta["disk_written"] * B
        ttft = computed / config.prefill_tokens_per_s
        if config.host is not None:                   # (write-through copies run beside the steps)
            ttft += config.host.seconds(h2d) + config.host.seconds(d2h if cache.policy.at_eviction else 0,
                                                                   read=False)
        if config.disk is not None:
            ttft += config.disk.seconds(disk_r)
        records.append(TurnRecord(turn.conversation, turn.index, len(ids), got[0], got[1], got[2], computed,
                                  h2d, d2h, disk_r, disk_w, ttft))
    return records


def summary(records: Sequence[TurnRecord]) -> dict:
    """Hit rates by tier (shares of every prompt token), tokens computed, bytes each way, and the
    modelled time to first token (p50, p99)."""
    from .timeline import percentile

    prompt = sum(r.prompt for r in records) or 1
    ttft = [r.ttft_s for r in records]
    return dict(turns=len(records), prompt_tokens=prompt, computed=sum(r.computed for r in records),
                device_hit=sum(r.device for r in records) / prompt, host_hit=sum(r.host for r in records) / prompt,
                disk_hit=sum(r.disk for r in records) / prompt,
                hit=sum(r.device + r.host + r.disk for r in records) / prompt,
                h2d_bytes=sum(r.h2d_bytes for r in records), d2h_bytes=sum(r.d2h_bytes for r in records),
                disk_read_bytes=sum(r.disk_read_bytes for r in records),
                disk_write_bytes=sum(r.disk_write_bytes for r in records),
                ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99))
