"""``PagedGenerator(..., host_cache=..., disk_cache=...)``: the generator's prefix cache over a
KV hierarchy (chapter 13).

    gen = PagedGenerator(model, num_pages=256,
                         host_cache=HostCache(pages=1024, write_policy="write_back"),
                         disk_cache=DiskCache("/tmp/kv", pages=100_000))

:func:`build_hierarchy` makes the pieces once per generator -- the host tier (pinned on a GPU,
a second CPU tensor without one), the copies between it and the pool, the disk store named by
the model's identity -- and :func:`tiered_cache` a fresh cache over them for every
``clear_prefix_cache``. Admission loads back what the lower tiers hold of a prompt
(:func:`kvlab.serving.load_back.admit_with_load_back`); ``gen.persist_prefix_cache()`` writes every
cached page the disk lacks, so that the next process (or a restarted kernel) finds it.

The model's identity (:func:`model_identity`) names its KV on disk: the model type, its config,
its dtype and a fingerprint of its weights (a strided sample of every parameter), so two models of
one architecture but other weights never share a page.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ...base.args import check_int
from ...base.errors import InvalidArgument
from ...prefix.write_policy import make_write_policy

__all__ = ["HostCache", "DiskCache", "Hierarchy", "model_identity", "check_tiers", "build_hierarchy",
           "tiered_cache", "TieredGenerator"]


@dataclass(frozen=True)
class HostCache:
    """The host tier: ``pages`` host pages (of the generator's page size) and the write policy
    (:mod:`kvlab.prefix.write_policy`: when a device page gets its host copy)."""

    pages: int
    write_policy: object = "write_through_selective"

    def __post_init__(self):
        check_int("host_cache.pages", self.pages, minimum=1)
        make_write_policy(self.write_policy, "host_cache.write_policy")


@dataclass(frozen=True)
class DiskCache:
    """The disk tier: an existing, writable ``directory`` holding at most ``pages`` page files;
    ``model``: the name the KV is stored under (default: :func:`model_identity`)."""

    directory: object
    pages: int = 1 << 16
    model: str | None = None

    def __post_init__(self):
        if not isinstance(self.directory, (str, os.PathLike)):
            raise InvalidArgument("disk_cache.directory", "a path to a directory", f"got {self.directory!r}")
        check_int("disk_cache.pages", self.pages, minimum=1)
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise InvalidArgument("disk_cache.model", "None or a non-empty string", f"got {self.model!r}")


def check_tiers(host_cache, disk_cache) -> tuple[HostCache | None, DiskCache | None]:
    """The tiers as specs (an int is a host pool in pages, a path a disk directory), checked
    before anything is built: the disk's directory exists, is a directory and may be written."""
    if host_cache is not None and not isinstance(host_cache, HostCache):
        if isinstance(host_cache, bool) or not isinstance(host_cache, int):
            raise InvalidArgument("host_cache", "None, a number of host pages or a kvlab.serving.hf.HostCache",
                                  f"got {type(host_cache).__name__} {host_cache!r}"[:100])
        host_cache = HostCache(host_cache)
    if disk_cache is not None and not isinstance(disk_cache, DiskCache):
        if not isinstance(disk_cache, (str, os.PathLike)):
            raise InvalidArgument("disk_cache", "None, a directory or a kvlab.serving.hf.DiskCache",
                                  f"got {type(disk_cache).__name__}")
        disk_cache = DiskCache(disk_cache)
    if disk_cache is not None:
        if host_cache is None:
            raise InvalidArgument("disk_cache", "a host_cache too (pages reach the disk through host memory)",
                                  "host_cache=None")
        d = os.fspath(disk_cache.directory)
        if not os.path.exists(d):
            raise InvalidArgument("disk_cache.directory", "an existing directory", f"{d!r} does not exist")
        if not os.path.isdir(d):
            raise InvalidArgument("disk_cache.directory", "a directory, not a file", f"{d!r} is a file")
        if not os.access(d, os.W_OK | os.X_OK):
            raise InvalidArgument("disk_cache.directory", "a directory this process may write", f"{d!r} is read-only")
    return host_cache, disk_cache


def model_identity(model) -> str:
    """``<model_type>-<16 hex digits>``: BLAKE2b of the model's config (without the path it was
    loaded from), dtype, parameter names and shapes, and a strided sample (at most 4096 values)
    of every parameter."""
    h = hashlib.blake2b(digest_size=8)
    config = model.config.to_dict() if hasattr(model.config, "to_dict") else dict(vars(model.config))
    config = {k: v for k, v in config.items() if not k.startswith("_") and "name_or_path" not in k}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())   # (not where it was loaded from)
    h.update(str(model.dtype).encode())
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            flat = p.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 4096)][:4096].float().cpu()
            h.update(f"{name}{tuple(p.shape)}".encode())
            h.update(sample.numpy().tobytes())
    return f"{getattr(model.config, 'model_type', 'model')}-{h.hexdigest()}"


class Hierarchy(NamedTuple):
    """What a generator's tiers are made of: the specs, the host tier, the copies, the disk store."""

    host_cache: HostCache
    disk_cache: DiskCache | None
    host: object
    copies: object
    disk: object


def build_hierarchy(pool, page_size: int, model, host_cache: HostCache, disk_cache: DiskCache | None) -> Hierarchy:
    """The host tier (pinned where ``pool`` is on a GPU), its copies and the disk store."""
    from ...prefix.disk_store import DiskStore, KVIdentity
    from ...prefix.host_tier import HostTier, KVLayout
    from ..kv_copies import KVCopies

    layout = KVLayout(pool.num_layers, pool.num_heads, pool.head_dim, pool.k.dtype)
    host = HostTier(host_cache.pages, page_size, layout, pin=pool.k.is_cuda)
    disk = None
    if disk_cache is not None:
        identity = KVIdentity.of(disk_cache.model or model_identity(model), layout, page_size)
        disk = DiskStore(disk_cache.directory, identity, disk_cache.pages)
    return Hierarchy(host_cache, disk_cache, host, KVCopies(pool, host), disk)


def tiered_cache(tiers: Hierarchy, page_size: int, device):
    """A fresh :class:`~kvlab.prefix.tiered_cache.TieredRadixCache` over ``tiers`` (every host
    page free: the last cache gave them back)."""
    from ...prefix.tiered_cache import TieredRadixCache

    return TieredRadixCache(page_size, device, host=tiers.host, policy=tiers.host_cache.write_policy,
                            disk=tiers.disk, copies=tiers.copies)


class TieredGenerator:
    """What :class:`~kvlab.serving.hf.PagedGenerator` does with its tiers (``self.hierarchy``, a
    :class:`Hierarchy` or ``None``): a fresh prefix cache, admission, the flush to disk."""

    hierarchy: Hierarchy | None = None

    def _fresh_prefix_cache(self):
        """``"radix"`` without tiers; else the last cache's host pages freed, a new tiered cache."""
        if self.hierarchy is None:
            return "radix"
        if getattr(self, "manager", None) is not None:
            self.manager.prefix_cache.reset()
        return tiered_cache(self.hierarchy, self.page_size, self.page_table.device)

    def persist_prefix_cache(self) -> int:
        """Write every cached page the disk tier lacks, so that a later process on the same
        directory finds it; returns the pages written (0 without a disk tier)."""
        if self.hierarchy is None or self.hierarchy.disk is None:
            return 0
        return self.manager.prefix_cache.persist()

    def _admit(self, req, spare_pages: int):
        """Admission: match, lock, map; with tiers, and a load-back of what they hold."""
        from ..load_back import admit_with_load_back

        if self.hierarchy is None:
            self.manager.admit(req)
            return None
        return admit_with_load_back(self.manager, req, spare_pages=spare_pages)
