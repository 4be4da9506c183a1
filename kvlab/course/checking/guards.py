"""Guard bands: every tensor argument is copied into a larger buffer with sentinels at both ends.

A load or store just outside a tensor rarely crashes: it silently reads or corrupts a
neighbour. So the learner gets a view of the middle of a *guard buffer*::

    guard buffer of `free_pages` (int64, BAND elements each side)
    ┌──────── before band ────────┬───── the real data ─────┬──────── after band ────────┐
    │ -7777 -7777 ... -7777 -7777 │ 4  9  2  7  ...         │ -8277 -8277 ... -8277 -8277│
    └─────────────────────────────┴─────────────────────────┴────────────────────────────┘
                                  ^ the learner's tensor is a view starting here

After the call a changed sentinel is a *write outside* the tensor (:func:`band_accesses`), and
a sentinel value turning up in an output is a *read outside* it (:func:`sentinel_reads`): every
argument has its own before/after values, so the message names the argument and the side.
Works on every runtime; in the interpreter the audit (:mod:`kvlab.course.checking.audit`) sees more.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .findings import Access

#: Elements of guard band on each side of every tensor argument.
BAND = 128
_MAX_SENTINEL_SLOTS = 24  # distinct sentinel pairs; arguments beyond that share them
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Sentinel(NamedTuple):
    """One guard value: which argument's band it fills, on which side, as raw integer bits."""

    argument: str
    side: str  # "before" or "after"
    bits: int  # the value seen through the integer view of the buffer
    is_float: bool
    width: int  # bytes per element

    def describe(self) -> str:
        if self.is_float:
            return f"NaN with guard bit pattern {self.bits & 0xFFFFFFFFFFFFFFFF:#x}"
        return str(self.bits)


def int_view_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The signed integer dtype of the same width, through which sentinels are written and read."""
    if dtype.is_complex:
        return None
    return _INT_VIEW.get(torch.empty((), dtype=dtype).element_size())


def signed(bits: int, int_dtype: torch.dtype | None) -> int:
    """``bits`` as a signed integer of ``int_dtype``'s width."""
    if int_dtype is None:
        return 0
    width = torch.empty((), dtype=int_dtype).element_size() * 8
    bits &= (1 << width) - 1
    return bits - (1 << width) if bits >= 1 << (width - 1) else bits


def sentinel_bits(slot: int, dtype: torch.dtype) -> tuple[int, int]:
    """The (before, after) sentinel bits for the ``slot``-th guarded argument of ``dtype``.

    Integers get negative values no slot or page index can have (-7777, -8277, -8777, ...);
    floats get quiet NaNs with a recognisable payload, so that arithmetic on them is loud too.
    """
    slot %= _MAX_SENTINEL_SLOTS
    width = torch.empty((), dtype=dtype).element_size()
    if dtype.is_floating_point:
        payload = 0x60 + 2 * slot if width >= 4 else 1 + 2 * slot
        base = {2: 0x7FC0, 4: 0x7FC01E00, 8: 0x7FF8000000001E00}[width]
        return base | payload, base | (payload + 1)
    if width == 1:
        return -70 - 2 * slot, -71 - 2 * slot
    return -7777 - 1000 * slot, -8277 - 1000 * slot


@dataclass
class GuardedStorage:
    """One guard buffer: a copy of the part of a storage that the arguments in it use."""

    names: list[str]
    original_flat: torch.Tensor  # the caller's memory [lo, hi) as a 1-D tensor
    buffer: torch.Tensor  # BAND + span + BAND elements
    span: int
    before: Sentinel
    after: Sentinel
    int_dtype: torch.dtype | None

    def bands(self) -> tuple[torch.Tensor, torch.Tensor]:
        ints = self.buffer.view(self.int_dtype)
        return ints[:BAND], ints[BAND + self.span:]


@dataclass
class GuardedArg:
    name: str
    original: torch.Tensor
    view: torch.Tensor  # what the learner gets
    initial: torch.Tensor  # a copy of the original contents, to tell new values from old


@dataclass
class Guards:
    storages: list[GuardedStorage] = field(default_factory=list)
    args: list[GuardedArg] = field(default_factory=list)

    def sentinels(self) -> list[Sentinel]:
        return [s for g in self.storages for s in (g.before, g.after)]

    def views(self) -> list[torch.Tensor]:
        return [a.view for a in self.args]


def _extent(t: torch.Tensor) -> int:
    """How many elements of storage a view reaches: 1 + sum((size-1) * stride)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def guard_tensors(named: list[tuple[str, torch.Tensor]]) -> Guards:
    """Copy every tensor into a guard buffer; ``Guards.views()`` are what to hand out, in order.

    Tensors that share memory (same storage and dtype) share one guard buffer, so a write
    through one is still seen through the other. Strides are kept: a learner kernel that is
    given ``page_table.stride(0)`` still indexes the same way.
    """
    guards = Guards()
    groups: dict[Any, list[int]] = {}
    for i, (_, t) in enumerate(named):
        groups.setdefault((t.device, t.untyped_storage().data_ptr(), t.dtype), []).append(i)
    views: dict[int, GuardedArg] = {}
    for slot, idxs in enumerate(groups.values()):
        tensors = [named[i][1] for i in idxs]
        dtype, device = tensors[0].dtype, tensors[0].device
        lo = min(t.storage_offset() for t in tensors)
        span = max(lo, max(t.storage_offset() + _extent(t) for t in tensors)) - lo
        original_flat = torch.empty(0, dtype=dtype, device=device).set_(
            tensors[0].untyped_storage(), lo, (span,), (1,))
        buffer = torch.empty(BAND + span + BAND, dtype=dtype, device=device)
        int_dtype = int_view_dtype(dtype)
        names = [named[i][0] for i in idxs]
        if int_dtype is not None:
            b_bits, a_bits = (signed(b, int_dtype) for b in sentinel_bits(slot, dtype))
            ints = buffer.view(int_dtype)
            ints[:BAND] = b_bits
            ints[BAND + span:] = a_bits
        else:  # complex: no sentinel, but the band still absorbs small overruns
            b_bits = a_bits = 0
            buffer.zero_()
        width = buffer.element_size()
        before = Sentinel(names[0], "before", b_bits, dtype.is_floating_point, width)
        after = Sentinel(names[0], "after", a_bits, dtype.is_floating_point, width)
        buffer[BAND:BAND + span] = original_flat
        guards.storages.append(GuardedStorage(names, original_flat, buffer, span, before, after,
                                              int_dtype))
        for i in idxs:
            name, t = named[i]
            view = buffer.as_strided(t.shape, t.stride(),
                                     buffer.storage_offset() + BAND + t.storage_offset() - lo)
            views[i] = GuardedArg(name, t, view, t.detach().clone())
    guards.args = [views[i] for i in range(len(named))]
    return guards


def copy_back(guards: Guards) -> None:
    """Copy the middle of every guard buffer back into the caller's memory."""
    for g in guards.storages:
        if g.span:
            g.original_flat.copy_(g.buffer[BAND:BAND + g.span])


class BandWrite(NamedTuple):
    """Writes into one side of one argument's guard band (for the failure picture)."""

    argument: str
    side: str  # "before" or "after"
    distances: list[int]  # how far outside, 1 = the element right next to the data
    length: int  # elements of real data


def band_writes(guards: Guards) -> list[BandWrite]:
    """Every side of every guard band that changed, with the distances of the changed elements."""
    found = []
    for g in guards.storages:
        if g.int_dtype is None:
            continue
        before, after = g.bands()
        changed_before = (before != g.before.bits).nonzero().flatten().tolist()
        changed_after = (after != g.after.bits).nonzero().flatten().tolist()
        if changed_before:
            found.append(BandWrite(g.names[0], "before", [BAND - i for i in changed_before], g.span))
        if changed_after:
            found.append(BandWrite(g.names[0], "after", [i + 1 for i in changed_after], g.span))
    return found


def band_accesses(writes: list[BandWrite]) -> list[Access]:
    """The band writes as :class:`Access` findings (a write, no program or line known)."""
    return [Access("write", w.argument, w.side, max(w.distances), len(w.distances),
                   reaches_band_end=max(w.distances) >= BAND) for w in writes]


def _sentinel_hits(values: torch.Tensor, sentinels: list[Sentinel],
                   new_only: torch.Tensor | None = None):
    """(index tuple, sentinel) for every element of ``values`` equal to some sentinel's bits."""
    int_dtype = int_view_dtype(values.dtype)
    if int_dtype is None or values.numel() == 0:
        return []
    ints = values.detach().reshape(values.shape or (1,)).view(int_dtype)
    hits = []
    for s in sentinels:
        if s.is_float != values.dtype.is_floating_point:
            continue
        if s.is_float and s.width != values.element_size():
            continue  # a float pattern only survives a copy at the same width
        if signed(s.bits, int_dtype) != s.bits:  # does not fit this integer width
            continue
        mask = ints == s.bits
        if new_only is not None:
            mask &= new_only
        for idx in mask.nonzero().tolist()[:3]:
            hits.append((tuple(idx), s))
    return hits


def sentinel_reads(guards: Guards, returned: list[tuple[str, torch.Tensor]] = ()) -> list[Access]:
    """Reads outside a tensor seen by their value: a sentinel in a new output value."""
    sentinels = guards.sentinels()
    found = []
    for a in guards.args:
        int_dtype = int_view_dtype(a.view.dtype)
        if int_dtype is None or a.view.numel() == 0:
            continue
        new = a.view.view(int_dtype) != a.initial.to(a.view.device).view(int_dtype)
        found += [_read(a.name, idx, s) for idx, s in _sentinel_hits(a.view, sentinels, new)]
    for name, t in returned:
        found += [_read(name, idx, s) for idx, s in _sentinel_hits(t, sentinels)]
    return found


def _read(name: str, idx: tuple, s: Sentinel) -> Access:
    where = f"{name}[{', '.join(map(str, idx))}]" if idx else name
    return Access("read", s.argument, s.side, 1, landed=where)


def explain_value(value: int, sentinels: list[Sentinel]) -> str | None:
    """If an integer is (or looks computed from) one of ``sentinels``, say whose.

    A kernel that reads ``free_pages`` one past its end gets -8277 and then may compute
    ``-8277 * page_size + k``; both are recognised here.
    """
    value = int(value)
    for s in sentinels:
        if s.is_float:
            continue
        side = "past the end of" if s.side == "after" else "before the start of"
        if value == s.bits:
            return (f"{value} is the guard value of `{s.argument}`: your code read {side} "
                    f"`{s.argument}`")
        if abs(value - s.bits) <= 64 or any(value // (1 << k) == s.bits for k in range(1, 17)):
            return (f"{value} looks computed from the guard value {s.bits} of "
                    f"`{s.argument}`: your code probably read {side} `{s.argument}`")
    return None
