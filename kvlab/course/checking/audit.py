"""The audit: in Triton's interpreter, every load and store of a kernel is checked as it happens.

Guard bands only notice a stray access by its effects. In the interpreter kvlab can do better:
while a learner's kernel runs, :func:`audited` wraps the interpreter's memory operations, so
each ``tl.load`` / ``tl.store`` (and atomic) is compared, lane by lane, with the memory of the
kernel's arguments::

    guard buffer of each argument      [ before band | the data | after band ]
    an active lane's address in ...        read/write  |   fine   | read/write  -> an Access
    ... no guard buffer at all         "far": recorded, and the lane is switched off

The first accesses outside are recorded with the program that made them and the line of the
kernel, so a message can say "a read past the end of `free_pages` by request 2, part 2 (line
57: ...)". Lanes far outside every buffer are masked off before they touch memory: a wild
pointer becomes a finding instead of a segfault or corrupted memory. Reads inside a guard band
are let through (the memory is ours), so the guard value still shows where it ends up.

The audit also chooses the **order** in which the grid's programs run (:class:`Order`): the
interpreter runs them one after another, ``0, 1, 2, ...``, which hides races that a GPU,
running them at once, would show. Checkers run most cases in another order.
"""
from __future__ import annotations

import contextlib
import os
import random
import sys
from typing import Iterator, NamedTuple

import numpy as np

from .findings import Access

_THIS_FILE = os.path.abspath(__file__)
_MAX_KINDS = 8  # distinct accesses recorded per call; later ones only add to the counts


class Extent(NamedTuple):
    """An argument's memory in bytes: its data ``[start, end)`` inside its guard buffer ``[lo, hi)``."""

    name: str
    start: int
    end: int
    lo: int
    hi: int
    itemsize: int


def extents_of(buffers, names: list[str], spans: list[int], band: int) -> list[Extent]:
    """The extents of guard buffers (1-D CPU tensors of ``band + span + band`` elements)."""
    out = []
    for buf, name, span in zip(buffers, names, spans):
        base, size = buf.data_ptr(), buf.element_size()
        out.append(Extent(name, base + band * size, base + (band + span) * size, base,
                          base + (2 * band + span) * size, size))
    return out


class Store(NamedTuple):
    """The in-bounds lanes of one store of one program into a tracked argument: where they went
    (element indices) and what they wrote, and which line of the kernel wrote them."""

    argument: str
    program: tuple[int, ...]
    filename: str | None
    line: int | None
    function: str | None
    indices: tuple[int, ...]
    values: tuple


class Order(NamedTuple):
    """The order in which the programs of a grid run: "natural", "reversed" or "shuffled"."""

    kind: str = "natural"
    seed: int = 0

    def permutation(self, n: int) -> list[int]:
        order = list(range(n))
        if self.kind == "reversed":
            order.reverse()
        elif self.kind == "shuffled" and n > 1:
            random.Random(self.seed).shuffle(order)
            if n > 2 and order in (list(range(n)), list(range(n - 1, -1, -1))):
                order = order[1:] + order[:1]  # neither forwards nor backwards
        return order

    def describe(self, n: int, limit: int = 12) -> str:
        order = self.permutation(n)
        text = ", ".join(map(str, order[:limit])) + (", ..." if n > limit else "")
        return f"{text} ({self.kind})" if self.kind != "natural" else f"{text} (one after another)"


def _learner_frame(start) -> tuple[str | None, int | None, str | None]:
    """File, line and function of the innermost frame outside Triton, NumPy and this module."""
    import triton

    skip = (os.path.dirname(os.path.abspath(triton.__file__)), os.path.dirname(np.__file__),
            _THIS_FILE)
    frame = start
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(skip):
            return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return None, None, None


class Audit:
    """What one call's loads and stores did outside its arguments (see :func:`audited`)."""

    def __init__(self, extents: list[Extent], order: Order = Order(), track=()):
        self.extents = sorted(extents, key=lambda e: e.lo)
        self.order = order
        self.track = frozenset(track)  # arguments whose in-bounds stores are kept (Store)
        self.stores: list[Store] = []
        self._lo = np.array([e.lo for e in self.extents] or [0], dtype=np.uint64)
        self._hi = np.array([e.hi for e in self.extents] or [0], dtype=np.uint64)
        self._start = np.array([e.start for e in self.extents] or [0], dtype=np.uint64)
        self._end = np.array([e.end for e in self.extents] or [0], dtype=np.uint64)
        self.accesses: list[Access] = []
        self._waiting: list[int] = []  # accesses whose program has not stored since
        self._programs: dict[int, set] = {}  # access -> the programs that made it
        self.grid: tuple[int, int, int] | None = None

    def check(self, kind: str, ptrs: np.ndarray, mask: np.ndarray, itemsize: int,
              program: tuple[int, ...], frame) -> np.ndarray | None:
        """Check the active lanes of one access; the lanes to switch off (far away), or None."""
        addr = np.asarray(ptrs, dtype=np.uint64).ravel()
        active = np.broadcast_to(np.asarray(mask, dtype=bool), np.shape(ptrs)).ravel()
        if not self.extents or addr.size == 0:
            return None
        i = np.clip(np.searchsorted(self._start, addr, side="right").astype(np.int64) - 1, 0, None)
        inside = (addr >= self._start[i]) & (addr + np.uint64(itemsize) <= self._end[i])
        bad = active & ~inside
        if not bad.any():
            if kind == "write" and self._waiting and active.any():
                self._note_store(addr[active][0], program)
            return None
        j = np.clip(np.searchsorted(self._lo, addr, side="right").astype(np.int64) - 1, 0, None)
        in_band = (addr >= self._lo[j]) & (addr < self._hi[j])
        far = bad & ~in_band
        self._record(kind, addr[bad], j[bad], in_band[bad], program, frame)
        if kind == "write" and (active & inside).any():
            self._note_store(addr[active & inside][0], program)
        return far.reshape(np.shape(ptrs)) if far.any() else None

    def note_store(self, ptrs: np.ndarray, mask: np.ndarray, values, itemsize: int,
                   program: tuple[int, ...], frame) -> None:
        """Keep the in-bounds lanes of a store into a tracked argument (see :class:`Store`)."""
        addr = np.asarray(ptrs, dtype=np.uint64).ravel()
        active = np.broadcast_to(np.asarray(mask, dtype=bool), np.shape(ptrs)).ravel()
        try:
            vals = np.broadcast_to(np.asarray(values), np.shape(ptrs)).ravel()
        except ValueError:
            vals = np.full(addr.shape, np.nan)
        for e in self.extents:
            if e.name not in self.track:
                continue
            sel = active & (addr >= np.uint64(e.start)) & (addr + np.uint64(itemsize) <= np.uint64(e.end))
            if sel.any():
                filename, line, function = _learner_frame(frame)
                indices = ((addr[sel] - np.uint64(e.start)) // np.uint64(e.itemsize)).astype(np.int64)
                self.stores.append(Store(e.name, self._program(program), filename, line, function,
                                         tuple(indices.tolist()), tuple(vals[sel].tolist())))

    def _record(self, kind, addrs, idx, in_band, program, frame) -> None:
        filename, line, function = _learner_frame(frame)
        groups: dict[tuple[str, str], list[int]] = {}
        for a, k, banded in zip(addrs.tolist(), idx.tolist(), in_band.tolist()):
            e = self.extents[k] if banded else self._nearest(a)
            if a < e.start:
                side, dist = "before", -(-(e.start - a) // e.itemsize)
            else:
                side, dist = "after", max(1, (a - e.end) // e.itemsize + 1)
            if not banded:
                side = "far"
            groups.setdefault((e.name, side), []).append(dist)
        for (name, side), dists in groups.items():
            access = Access(kind, name, side, max(dists), len(dists), self._program(program),
                            filename, line, function)
            self._add(access)

    def _add(self, access: Access) -> None:
        for n, old in enumerate(self.accesses):
            if old.key() == access.key():
                seen = self._programs.setdefault(n, {old.program})
                seen.add(access.program)
                self.accesses[n] = old._replace(count=old.count + access.count,
                                                distance=max(old.distance, access.distance),
                                                others=len(seen) - 1)
                return
        if len(self.accesses) < _MAX_KINDS:
            self.accesses.append(access)
            if access.kind == "read":
                self._waiting.append(len(self.accesses) - 1)

    def _program(self, program) -> tuple[int, ...]:
        """The grid index with only the grid's dimensions: (3,) for a grid of (bs,)."""
        dims = max([1] + [d + 1 for d, size in enumerate(self.grid or ()) if size > 1])
        return tuple(int(p) for p in program)[:dims]

    def _nearest(self, addr: int) -> Extent:
        return min(self.extents, key=lambda e: min(abs(addr - e.start), abs(addr - e.end)))

    def _note_store(self, addr: int, program: tuple[int, ...]) -> None:
        """The first in-bounds store of a program after its stray reads: where it went."""
        k = int(np.clip(np.searchsorted(self._start, np.uint64(addr), side="right") - 1, 0, None))
        e = self.extents[k]
        still = []
        for n in self._waiting:
            a = self.accesses[n]
            if a.program == self._program(program) and a.next_store is None:
                self.accesses[n] = a._replace(next_store=(e.name, (int(addr) - e.start) // e.itemsize))
            elif a.next_store is None:
                still.append(n)
        self._waiting = still


@contextlib.contextmanager
def audited(audit: Audit) -> Iterator[Audit]:
    """Run the kernels launched inside the block under ``audit`` (Triton's interpreter only)."""
    from triton.runtime import interpreter as tri
    from triton.runtime.interpreter import TensorHandle

    builder = tri.interpreter_builder
    cls = type(builder)
    state = {"order": [], "count": 0, "dims": (1, 1, 1)}

    def set_grid_dim(nx, ny, nz):
        state.update(order=audit.order.permutation(nx * ny * nz), count=0, dims=(nx, ny, nz))
        audit.grid = (nx, ny, nz)
        return cls.set_grid_dim(builder, nx, ny, nz)

    def set_grid_idx(x, y, z):
        _, ny, nz = state["dims"]
        linear = state["order"][state["count"]] if state["count"] < len(state["order"]) else (
            (x * ny + y) * nz + z)
        state["count"] += 1
        return cls.set_grid_idx(builder, linear // (ny * nz), (linear // nz) % ny, linear % nz)

    def guarded(kind, original, ptrs, mask, *rest, **kw):
        item = np.dtype(tri._get_np_dtype(ptrs.get_element_ty())).itemsize
        off = audit.check(kind, ptrs.data, mask.data, item, builder.grid_idx, sys._getframe(2))
        if off is not None:
            mask = TensorHandle(np.asarray(mask.data, dtype=bool) & ~off, mask.dtype)
        return original(ptrs, mask, *rest, **kw)

    def load(ptrs, mask, *rest, **kw):
        return guarded("read", cls.create_masked_load.__get__(builder), ptrs, mask, *rest, **kw)

    def store(ptrs, value, mask, *rest, **kw):
        if audit.track:
            item = np.dtype(tri._get_np_dtype(ptrs.get_element_ty())).itemsize
            audit.note_store(ptrs.data, mask.data, value.data, item, builder.grid_idx,
                             sys._getframe(1))

        def original(p, m, *r, **k):
            return cls.create_masked_store(builder, p, value, m, *r, **k)
        return guarded("write", original, ptrs, mask, *rest, **kw)

    def atomic_rmw(op, ptr, val, mask, *rest, **kw):
        def original(p, m, *r, **k):
            return cls.create_atomic_rmw(builder, op, p, val, m, *r, **k)
        return guarded("write", original, ptr, mask, *rest, **kw)

    patches = {"set_grid_dim": set_grid_dim, "set_grid_idx": set_grid_idx,
               "create_masked_load": load, "create_masked_store": store,
               "create_atomic_rmw": atomic_rmw}
    saved = {name: builder.__dict__[name] for name in patches if name in builder.__dict__}
    for name, fn in patches.items():
        setattr(builder, name, fn)
    try:
        yield audit
    finally:
        for name in patches:
            if name in saved:
                setattr(builder, name, saved[name])
            else:
                builder.__dict__.pop(name, None)
