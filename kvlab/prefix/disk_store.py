"""The disk tier of the KV hierarchy: one file per page, keyed by the page's chained hash and the
model's identity, trusted only after it proves what it is (chapter 13).

A page's KV depends on every token before it and on the model that computed it, so its name on
disk is both: chapter 11's chained page hash (every token from the start of the prompt to the
end of the page) and the model's identity, hashed together (:func:`disk_key`). A second process,
or a learner's restarted kernel, computing the same prompt with the same model finds the same
names::

    <directory>/<disk_key>.kvpage

    bytes 0-7    b"KVLABPG1"                    what the file is, and the format's version
    bytes 8-11   h, the header's length          little-endian uint32
    12 .. 12+h   the header, JSON:  model, dtype, shape, page_size, page_hash, payload_bytes,
                                    checksum (BLAKE2b-128 of the payload, hex)
    then         the payload: the page's tensor [layers, 2, page_size, kv_heads, head_dim], C order

A file is written to a temporary name and renamed into place (``os.replace``): another process
sees the whole file or none. Reading trusts nothing (:func:`why_untrusted`): a file cut short, a
flipped byte, a header of another model, dtype or page size, or of another page, is *ignored* --
counted, and removed when it is damaged -- never loaded. The store holds at most
``capacity_pages`` files; past that the least recently used go (a read touches its file).

SGLang's file backend (``HiCacheFile``, ``python/sglang/srt/mem_cache/hicache_storage.py``,
sgl-project/sglang ``bb424de2``) names a page ``<sha256 chain hash>_<model>_<tp_rank>_<tp_size>.bin``
and stores the raw tensor, no header: it raises on a short read and would load a file of the right
length whatever it holds. LMCache keys a chunk by ``fmt@model_name@world_size@worker_id@chunk_hash``
(``CacheEngineKey``, ``lmcache/utils.py``, LMCache/LMCache ``f26a4591``).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import uuid
from typing import NamedTuple, Sequence

import torch

from ..base.args import check_int
from ..base.errors import InvalidArgument
from .hash_chain import PageHash, chain_hash

__all__ = ["KVIdentity", "DiskStore", "disk_key", "why_untrusted", "trust_reason", "encode_page",
           "decode_page", "MAGIC", "SUFFIX"]

MAGIC = b"KVLABPG1"
SUFFIX = ".kvpage"
_HEADER_LIMIT = 1 << 16


class KVIdentity(NamedTuple):
    """Whose KV a page is: the model's identity (a name and a fingerprint of its weights), the
    dtype, the shape of one page's tensor, the page size, and the dtype's bytes per element."""

    model: str
    dtype: str
    shape: tuple[int, ...]
    page_size: int
    itemsize: int

    @classmethod
    def of(cls, model: str, layout, page_size: int) -> "KVIdentity":
        """The identity of pages of ``layout`` (a :class:`~kvlab.prefix.host_tier.KVLayout`)."""
        if not isinstance(model, str) or not model:
            raise InvalidArgument("model", "a non-empty string naming the model", f"got {model!r}")
        dtype = str(layout.dtype).replace("torch.", "")
        itemsize = torch.empty((), dtype=layout.dtype).element_size()
        return cls(model, dtype, tuple(layout.page_shape(page_size)), page_size, itemsize)

    @property
    def payload_bytes(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n


def disk_key(model: str, page_hash: PageHash) -> str:
    """The name of a page on disk: BLAKE2b-128 of the model's identity, a zero byte and the
    page's chained hash, in hex (the same tokens under another model: another name)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(model.encode())
    h.update(b"\0")
    h.update(page_hash)
    return h.hexdigest()


def _checksum(payload) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def encode_page(identity: KVIdentity, page_hash: PageHash, page: torch.Tensor) -> bytes:
    """A page's whole file: magic, header, payload."""
    payload = page.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    header = dict(model=identity.model, dtype=identity.dtype, shape=list(identity.shape),
                  page_size=identity.page_size, page_hash=page_hash.hex(), payload_bytes=len(payload),
                  checksum=_checksum(payload))
    text = json.dumps(header, sort_keys=True).encode()
    return MAGIC + struct.pack("<I", len(text)) + text + payload


def decode_page(data: bytes) -> tuple[dict | None, bytes]:
    """``(header, payload)`` of a file's bytes (``header`` is ``None`` when there is none to read)."""
    if len(data) < len(MAGIC) + 4 or data[:len(MAGIC)] != MAGIC:
        return None, b""
    (h,) = struct.unpack("<I", data[len(MAGIC):len(MAGIC) + 4])
    start = len(MAGIC) + 4
    if h > _HEADER_LIMIT or start + h > len(data):
        return None, b""
    try:
        header = json.loads(data[start:start + h].decode())
    except (UnicodeDecodeError, ValueError):
        return None, b""
    return (header if isinstance(header, dict) else None), data[start + h:]


def why_untrusted(identity: KVIdentity, page_hash: PageHash, header: dict | None, payload) -> str:
    """``""`` when a file's ``header`` and ``payload`` are the page ``page_hash`` of this
    ``identity``; else what is wrong: ``"header"``, ``"model"``, ``"layout"``, ``"page_hash"``,
    ``"length"`` or ``"checksum"`` (computed from the payload as read now, never taken on trust)."""
    fields = ("model", "dtype", "shape", "page_size", "page_hash", "payload_bytes", "checksum")
    if not isinstance(header, dict) or any(f not in header for f in fields):
        return "header"
    if header["model"] != identity.model:
        return "model"
    if (header["dtype"] != identity.dtype or list(header["shape"]) != list(identity.shape)
            or header["page_size"] != identity.page_size):
        return "layout"
    if header["page_hash"] != page_hash.hex():
        return "page_hash"
    if header["payload_bytes"] != identity.payload_bytes or len(payload) != identity.payload_bytes:
        return "length"
    if _checksum(payload) != header["checksum"]:
        return "checksum"
    return ""


def trust_reason(identity: KVIdentity, parent: PageHash | None, tokens: Sequence[int], header,
                 payload) -> str:
    """:func:`why_untrusted` for the page of ``tokens`` after the page ``parent`` (its chained
    hash computed here: a page must also be *this* page, not one stored for another prefix)."""
    if len(tokens) != identity.page_size:
        return "layout"
    return why_untrusted(identity, chain_hash(parent, tokens), header, payload)


class DiskStore:
    """Pages of one model's KV in ``directory`` (which must exist and be writable), at most
    ``capacity_pages`` files, least recently used out first. ``stats`` counts what happened."""

    def __init__(self, directory, identity: KVIdentity, capacity_pages: int):
        if not isinstance(directory, (str, os.PathLike)):
            raise InvalidArgument("disk_cache.directory", "a path to a directory", f"got {directory!r}")
        directory = os.fspath(directory)
        if not os.path.exists(directory):
            raise InvalidArgument("disk_cache.directory", "an existing directory", f"{directory!r} does not exist")
        if not os.path.isdir(directory):
            raise InvalidArgument("disk_cache.directory", "a directory, not a file", f"{directory!r} is a file")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise InvalidArgument("disk_cache.directory", "a directory this process may write",
                                  f"{directory!r} is read-only")
        if not isinstance(identity, KVIdentity):
            raise InvalidArgument("identity", "a kvlab.prefix.disk_store.KVIdentity", f"got {type(identity).__name__}")
        self.capacity_pages = check_int("disk_cache.capacity_pages", capacity_pages, minimum=1)
        self.directory, self.identity = directory, identity
        self.stats = dict(written=0, read=0, skipped=0, evicted=0, write_errors=0, missing=0,
                          rejected=0, removed=0)
        self.rejected: dict[str, int] = {}
        self._count = len(self._files())

    # --- names --------------------------------------------------------------------------------

    def key(self, page_hash: PageHash) -> str:
        return disk_key(self.identity.model, page_hash)

    def path(self, page_hash: PageHash) -> str:
        return os.path.join(self.directory, self.key(page_hash) + SUFFIX)

    def _files(self) -> list[os.DirEntry]:
        try:
            return [e for e in os.scandir(self.directory) if e.name.endswith(SUFFIX)]
        except OSError:
            return []

    @property
    def num_pages(self) -> int:
        """Pages on disk now (every process's: the directory is read again)."""
        return len(self._files())

    def contains(self, page_hash: PageHash) -> bool:
        return os.path.exists(self.path(page_hash))

    def run_length(self, hashes: Sequence[PageHash]) -> int:
        """How many of ``hashes``, from the first, have a file (the rest start at the first gap)."""
        for i, h in enumerate(hashes):
            if not self.contains(h):
                return i
        return len(hashes)

    # --- write and read -----------------------------------------------------------------------

    def write(self, page_hash: PageHash, page: torch.Tensor) -> bool:
        """Store ``page`` (a page tensor of this identity's shape) as ``page_hash``; a page already
        there is kept (``skipped``). False when the disk refused (counted in ``write_errors``)."""
        if tuple(page.shape) != tuple(self.identity.shape):
            raise InvalidArgument("page", f"a page tensor of shape {tuple(self.identity.shape)}",
                                  f"got {tuple(page.shape)}")
        path = self.path(page_hash)
        if os.path.exists(path):
            self.stats["skipped"] += 1
            return True
        self._make_room(1)
        tmp = os.path.join(self.directory, f".{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(encode_page(self.identity, page_hash, page))
            os.replace(tmp, path)            # another process sees the whole file or none
        except OSError:
            self.stats["write_errors"] += 1
            try:
                os.remove(tmp)
            except OSError:
                pass
            return False
        self._count += 1
        self.stats["written"] += 1
        return True

    def read(self, page_hash: PageHash, out: torch.Tensor) -> str:
        """Fill ``out`` (a CPU page tensor) with the stored page ``page_hash``: ``""`` when it was
        there and trusted, else why not (``"missing"``, ``"io"``, or :func:`why_untrusted`'s
        reason; ``out`` must not be used then). A damaged file is removed."""
        path = self.path(page_hash)
        try:
            with open(path, "rb") as f:
                data = f.read(len(MAGIC) + 4 + _HEADER_LIMIT + self.identity.payload_bytes + 1)
        except FileNotFoundError:
            self.stats["missing"] += 1
            return "missing"
        except OSError:
            return self._reject("io", None)
        header, payload = decode_page(data)
        why = why_untrusted(self.identity, page_hash, header, payload)
        if why:
            return self._reject(why, path if why in ("header", "length", "checksum") else None)
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        out.copy_(flat.view(out.dtype).view(out.shape))
        try:
            os.utime(path)                   # recently used: the last to be evicted
        except OSError:
            pass
        self.stats["read"] += 1
        return ""

    def _reject(self, why: str, damaged: str | None) -> str:
        self.stats["rejected"] += 1
        self.rejected[why] = self.rejected.get(why, 0) + 1
        if damaged is not None:
            try:
                os.remove(damaged)
                self.stats["removed"] += 1
                self._count -= 1
            except OSError:
                pass
        return why

    def _make_room(self, n: int) -> None:
        """Remove the least recently used files until ``n`` more fit (down to 90% when it must)."""
        if self._count + n <= self.capacity_pages:
            return
        files = self._files()
        keep = max(0, min(self.capacity_pages - n, int(self.capacity_pages * 0.9)))
        if len(files) > keep:
            def age(e):
                try:
                    return e.stat().st_mtime_ns
                except OSError:
                    return 0
            for e in sorted(files, key=age)[: len(files) - keep]:
                try:
                    os.remove(e.path)
                    self.stats["evicted"] += 1
                except OSError:               # another process removed it first
                    pass
        self._count = len(self._files())
