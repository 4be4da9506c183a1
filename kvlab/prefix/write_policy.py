"""When a device page gets its host copy: the write policies of the KV hierarchy (chapter 13).

A page of the prefix cache on the GPU may also have a copy in host memory. The copy costs a
transfer over the host link; having it makes the page's eviction from the device free (drop the
device copy, keep the host one) and lets a later hit load it back instead of computing it again.
SGLang's ``HiCacheController`` (``python/sglang/srt/managers/cache_controller.py``,
sgl-project/sglang ``350cb879``) refuses any other name than these three, and ``HiRadixCache``
(``python/sglang/srt/mem_cache/hiradix_cache.py``, ``263bc85d``) sets their thresholds::

    policy                    the host copy is written ...              SGLang
    ──────────────────────    ──────────────────────────────────────    ─────────────────────────
    write_through             when the node is cached (its first hit)   write_through_threshold = 1
    write_through_selective   once it has been hit ``threshold`` times  write_through_threshold = 2
    write_back                only when the device evicts it            ``evict``: write_backup(x,
                                                                        write_back=True)

A *hit* is an insert that reaches the node (``_inc_hit_count`` runs in ``insert``, once per request
that caches through it; write-back counts none). Under the write-through policies a node evicted
without its copy is forgotten, as on a GPU-only cache (``_evict_regular``); under write-back it is
copied first (``dirty``: on the device only).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..base.args import check_int
from ..base.errors import InvalidArgument

__all__ = ["WritePolicy", "WriteThrough", "WriteThroughSelective", "WriteBack", "WRITE_POLICIES",
           "make_write_policy"]


@dataclass(frozen=True)
class WritePolicy:
    """One answer to "when does a device page get its host copy"."""

    name: ClassVar[str] = ""
    at_eviction: ClassVar[bool] = False   # copy a dirty node when the device evicts it

    @property
    def threshold(self) -> int | None:
        """Hits after which a node is copied to host memory (``None``: never before eviction)."""
        return None

    def copies_on_hit(self, hits: int) -> bool:
        """A node that has just been hit ``hits`` times (and has no host copy) is copied now."""
        return self.threshold is not None and hits >= self.threshold


@dataclass(frozen=True)
class WriteThrough(WritePolicy):
    """Copy every node to host memory as soon as it is cached."""

    name: ClassVar[str] = "write_through"

    @property
    def threshold(self) -> int:
        return 1


@dataclass(frozen=True)
class WriteThroughSelective(WritePolicy):
    """Copy a node once ``hits`` inserts have reached it (SGLang: 2), so that a prefix used once
    never costs a transfer."""

    hits: int = 2
    name: ClassVar[str] = "write_through_selective"

    def __post_init__(self):
        check_int("policy.hits", self.hits, minimum=1)

    @property
    def threshold(self) -> int:
        return self.hits


@dataclass(frozen=True)
class WriteBack(WritePolicy):
    """Copy a node only when the device evicts it, and only if it has no copy yet."""

    name: ClassVar[str] = "write_back"
    at_eviction: ClassVar[bool] = True


WRITE_POLICIES: dict[str, WritePolicy] = {p.name: p for p in (WriteThrough(), WriteThroughSelective(),
                                                               WriteBack())}


def make_write_policy(policy, argument: str = "write_policy") -> WritePolicy:
    """A write policy from its name (one of :data:`WRITE_POLICIES`) or a :class:`WritePolicy`."""
    if isinstance(policy, WritePolicy) and type(policy) is not WritePolicy:
        return policy
    if isinstance(policy, str) and policy in WRITE_POLICIES:
        return WRITE_POLICIES[policy]
    raise InvalidArgument(argument, f"one of {sorted(WRITE_POLICIES)} or a kvlab.prefix.write_policy."
                          "WritePolicy", f"got {policy!r}")
