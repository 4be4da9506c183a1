"""The copies of the KV hierarchy: device pages to host pages and back, batched (chapter 13).

The device pool keeps each layer's K and V by token slot (``pool.k[layer, slot]``), so a page of
one request is ``page_size`` slots in every layer: many small strided pieces. A host page keeps
all of them together (:mod:`kvlab.prefix.host_tier`). A copy is therefore three parts, and only
the middle one crosses the link to the host, as one block per run of neighbouring host pages::

    save (device -> host):  gather    pool.k/v[:, slots] -> staged [pages, layers, 2, P, heads, dim]
                                      (one indexing kernel, on the compute stream)
                            transfer  staged -> host.kv[run]   (a copy stream; pinned memory)
    load (host -> device):  transfer  host.kv[run] -> staged   (a copy stream)
                            scatter   staged -> pool.k/v[:, slots]   (the compute stream, after
                                      the transfer's event)

On a GPU the transfers run on their own streams, so they overlap the forward passes: a load-back
for the next step crosses the link while the current step computes, and a write-through copy
while the next ones do. The gather and the scatter run on the compute stream, in order with the
forward passes, so no step reads a page before its K/V has arrived and a device page handed out
again is never overwritten before its K/V was gathered. What the transfers read or fill in host
memory is pending until their events: the host tier keeps those pages pinned / unwritten until
then (:meth:`~kvlab.prefix.host_tier.HostTier.pin`, ``mark_written``).

Measured on an H200 (``/work/gpu-data``-style runs of ``python -m kvlab.bench --hierarchy``): one
pinned block crosses at about 52 GB/s, a gather of scattered pages straight from host memory at
4-12 GB/s -- the reason for the staging. On a CPU every part runs at once, in order.
SGLang's ``HiCacheController`` moves its copies on a ``write_stream`` and a ``load_stream`` the same
way (``python/sglang/srt/managers/cache_controller.py``, ``350cb879``), loading layer by layer
with an event per layer so that the forward pass can start before the last layer arrives.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["KVCopies", "Pending", "runs"]


def runs(pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(index, first page, count)`` for each run of consecutive pages in ``pages``."""
    out: list[tuple[int, int, int]] = []
    for i, p in enumerate(pages):
        if out and out[-1][1] + out[-1][2] == p:
            j, first, n = out[-1]
            out[-1] = (j, first, n + 1)
        else:
            out.append((i, p, 1))
    return out


class Pending:
    """A copy on a CUDA stream: ``done()`` asks its event, ``wait()`` waits for it; it keeps the
    tensors the copy reads alive until then."""

    __slots__ = ("event", "keep")

    def __init__(self, event, keep=()):
        self.event, self.keep = event, keep

    def done(self) -> bool:
        if self.event.query():
            self.keep = ()
            return True
        return False

    def wait(self) -> None:
        self.event.synchronize()
        self.keep = ()


class KVCopies:
    """Moves K/V between ``pool`` (a :class:`~kvlab.KVPool`) and ``host`` (a
    :class:`~kvlab.prefix.host_tier.HostTier` with memory); ``stats`` counts bytes and copies,
    and on a GPU the seconds the host-to-device transfers took."""

    def __init__(self, pool, host):
        if host.kv is None:
            raise ValueError("host: a HostTier with memory (a KVLayout)")
        self.pool, self.host = pool, host
        self.page_size = host.page_size
        self.cuda = pool.k.is_cuda
        self.write_stream = torch.cuda.Stream(device=pool.k.device) if self.cuda else None
        self.load_stream = torch.cuda.Stream(device=pool.k.device) if self.cuda else None
        self.stats = dict(h2d_bytes=0, d2h_bytes=0, loads=0, saves=0, h2d_seconds=0.0, h2d_timed_bytes=0,
                          d2h_seconds=0.0, d2h_timed_bytes=0)
        self._timed: list = []       # (direction, start event, end event, bytes) not read yet
        self.record: list | None = None   # a list: every transfer's events are kept there too

    # --- device -> host ------------------------------------------------------------------------

    def _gather(self, slots: torch.Tensor) -> torch.Tensor:
        """``[pages, layers, 2, P, heads, dim]`` of the pool at ``slots`` (whole pages, in order)."""
        P, pool = self.page_size, self.pool
        idx = slots.to(device=pool.k.device, dtype=torch.long)
        n = idx.numel() // P
        kv = torch.stack([pool.k[:, idx], pool.v[:, idx]], 1)          # [L, 2, n*P, H, D]
        kv = kv.view(pool.num_layers, 2, n, P, pool.num_heads, pool.head_dim)
        return kv.permute(2, 0, 1, 3, 4, 5).contiguous()

    def save(self, slots: torch.Tensor, host_pages: Sequence[int]) -> Pending | None:
        """Copy the device ``slots`` (whole pages) into ``host_pages``; the pending copy, or
        ``None`` when it is done already (a CPU)."""
        staged = self._gather(slots)
        nbytes = staged.numel() * staged.element_size()
        self.stats["d2h_bytes"] += nbytes
        self.stats["saves"] += 1
        if not self.cuda:
            for i, first, n in runs(host_pages):
                self.host.kv[first:first + n].copy_(staged[i:i + n])
            return None
        gathered = torch.cuda.Event()
        gathered.record()
        with torch.cuda.stream(self.write_stream):
            self.write_stream.wait_event(gathered)
            start, end = self._timing()
            for i, first, n in runs(host_pages):
                self.host.kv[first:first + n].copy_(staged[i:i + n], non_blocking=True)
            done = self._finish("d2h", start, end, nbytes)
        staged.record_stream(self.write_stream)
        return Pending(done, (staged,))

    # --- host -> device ------------------------------------------------------------------------

    def load(self, host_pages: Sequence[int], slots: torch.Tensor) -> Pending | None:
        """Copy ``host_pages`` into the device ``slots`` (one slot per position, whole pages); the
        pending read of the host pages (``None`` on a CPU). The forward passes enqueued after
        this call see the K/V: the scatter is on their stream, behind the transfer."""
        pool, P = self.pool, self.page_size
        n = len(host_pages)
        shape = (n, pool.num_layers, 2, P, pool.num_heads, pool.head_dim)
        nbytes = n * self.host.page_bytes
        self.stats["h2d_bytes"] += nbytes
        self.stats["loads"] += 1
        if not self.cuda:
            staged = torch.empty(shape, dtype=pool.k.dtype)
            for i, first, k in runs(host_pages):
                staged[i:i + k].copy_(self.host.kv[first:first + k])
            self._scatter(staged, slots)
            return None
        with torch.cuda.stream(self.load_stream):
            for p in host_pages:                            # a page still being written lands first
                pending = self.host._writer.get(p)
                if pending is not None and hasattr(pending, "event"):
                    self.load_stream.wait_event(pending.event)
            staged = torch.empty(shape, dtype=pool.k.dtype, device=pool.k.device)
            start, end = self._timing()
            for i, first, k in runs(host_pages):
                staged[i:i + k].copy_(self.host.kv[first:first + k], non_blocking=True)
            done = self._finish("h2d", start, end, nbytes)
        torch.cuda.current_stream().wait_event(done)
        staged.record_stream(torch.cuda.current_stream())
        self._scatter(staged, slots)
        return Pending(done)

    def _scatter(self, staged: torch.Tensor, slots: torch.Tensor) -> None:
        pool = self.pool
        idx = slots.to(device=pool.k.device, dtype=torch.long)
        kv = staged.permute(1, 2, 0, 3, 4, 5).reshape(pool.num_layers, 2, idx.numel(), pool.num_heads,
                                                         pool.head_dim)
        pool.k[:, idx] = kv[:, 0]
        pool.v[:, idx] = kv[:, 1]

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """The pages at device ``slots`` on the host, now (a synchronous copy: for a flush to disk)."""
        return self._gather(slots).cpu()

    # --- timing --------------------------------------------------------------------------------

    def _timing(self):
        if not self.cuda:
            return None, None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return start, end

    def _finish(self, direction: str, start, end, nbytes: int):
        end.record()
        self._timed.append((direction, start, end, nbytes))
        if self.record is not None:
            self.record.append((direction, start, end, nbytes))
        return end

    def collect(self) -> dict:
        """``stats`` with the seconds of every transfer that has finished added in."""
        left = []
        for direction, start, end, nbytes in self._timed:
            if end.query():
                self.stats[f"{direction}_seconds"] += start.elapsed_time(end) / 1e3
                self.stats[f"{direction}_timed_bytes"] += nbytes
            else:
                left.append((direction, start, end, nbytes))
        self._timed = left
        return dict(self.stats)

    def drain(self) -> None:
        """Wait for every copy (the end of a call; before a flush to disk)."""
        for stream in (self.write_stream, self.load_stream):
            if stream is not None:
                stream.synchronize()
