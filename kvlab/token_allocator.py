"""``PagedTokenAllocator``: token slots handed out in pages, a whole batch per launch.

Chapter 03 builds :meth:`PagedTokenAllocator.alloc_extend` (prefill / extend) and chapter 04
:meth:`PagedTokenAllocator.alloc_decode` (one token per request per step), after SGLang's
``PagedTokenToKVPoolAllocator``.

The pool has ``num_pages`` pages of ``page_size`` (P) token slots; page ``k`` owns slots
``k*P .. k*P + P - 1``. ``free_pages`` lists the free page ids; allocations take them from
the front, ``free`` appends them at the back::

    free_pages: [ 7  3  9  5  0  2 ... ]        alloc_extend needing 4 pages
                 \\__________/                   -> pages 7, 3, 9, 5 are handed out
                   taken          [ 0  2 ... ]  <- free_pages afterwards

Choices (documented because SGLang differs in places):

* **Every page is usable**: page ids ``0 .. num_pages - 1``. (SGLang reserves page 0 as the
  padding target of CUDA-graph batches; kvlab's page tables mark unmapped entries with -1
  instead, so no page has to be sacrificed.)
* **Empty prefix**: ``last_loc`` is ``-1`` by convention when ``prefix_len == 0`` (as in SGLang).
  The rule ``(last_loc + 1) % P == prefix_len % P`` is checked for every request; ``-1`` passes
  it because ``(-1 + 1) % P == 0``. A non-empty prefix's ``last_loc`` must be a slot of this
  pool on a page that is not free (else part 1 could write into a page handed to someone else).
* **Decode lengths**: ``alloc_decode`` takes ``seq_lens`` AFTER the new token (``seq = pre + 1``).
* **Safe order**: the number of new pages is computed on the host and checked *before* any
  kernel reads ``free_pages``. Short of pages -> :class:`kvlab.OutOfPages`, nothing changed.
  (The source design launched the kernel first and checked the count afterwards: on
  out-of-memory its kernel had already read past the end of ``free_pages``.)
* **Freeing**: ``free(indices)`` takes token slots and frees the pages they lie on
  (``unique(indices // P)``, as SGLang does). It refuses, and changes nothing, when a slot is
  out of range, a slot is given twice, or a page is already free: nothing is freed twice.

``impl`` picks who runs step 4 (the launch); steps 1-3 and 5 are shared methods:
1 ``_validate_*``  2 ``_pages_needed_*``  3 ``_check_enough_pages``  4 ``_launch_*``  5 ``_take_pages``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import runtime  # first: decides compiled Triton vs the interpreter
import triton  # noqa: E402,I001
import triton.language as tl  # noqa: E402
from .errors import IntegrityError, InvalidArgument, OutOfPages

#: the implementations of the launch step this module knows: "fast" (chapter 09, the default:
#: one compilation for every shape, no extra host sync) and "teaching" (chapters 03-04)
IMPLS: tuple[str, ...] = ("fast", "teaching")

_INT_DTYPES = (torch.int32, torch.int64)
#: the largest block ``tl.arange`` may build (Triton's TRITON_MAX_TENSOR_NUMEL)
_MAX_BLOCK: int = getattr(tl, "TRITON_MAX_TENSOR_NUMEL", 1 << 20)


@dataclass(frozen=True)
class AllocatorState:
    """A copy of an allocator's state, for tests and notebooks: compare with :meth:`equals`."""

    free_pages: torch.Tensor
    num_pages: int
    page_size: int

    def equals(self, other: "AllocatorState") -> bool:
        return (self.num_pages == other.num_pages and self.page_size == other.page_size
                and torch.equal(self.free_pages.cpu(), other.free_pages.cpu()))


def _as_int(value, argument: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidArgument(argument, "must be an int", f"got {type(value).__name__}")
    return int(value.__index__())


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _first_bad(mask: torch.Tensor) -> int | None:
    """Index of the first True in ``mask`` (a host sync; validation is host-side on purpose)."""
    idx = mask.nonzero()
    return int(idx[0, 0]) if idx.numel() else None


def _next_pow2(n: int) -> int:
    return max(1, triton.next_power_of_2(n))


class PagedTokenAllocator:
    """Hands out KV token slots in pages of ``page_size``, for whole batches at once.

    >>> alloc = PagedTokenAllocator(num_pages=8, page_size=4)
    >>> alloc.available_size()
    32
    """

    def __init__(self, num_pages: int, page_size: int, device: "torch.device | str | None" = None,
                 *, impl: str = "fast"):
        num_pages = _as_int(num_pages, "num_pages")
        page_size = _as_int(page_size, "page_size")
        if num_pages < 1:
            raise InvalidArgument("num_pages", "num_pages >= 1", f"got {num_pages}")
        if page_size < 1 or page_size & (page_size - 1) or page_size > _MAX_BLOCK:
            # the kernels use tl.arange(0, page_size): a compile-time power of two, capped by Triton
            raise InvalidArgument("page_size", f"a power of two, 1 <= page_size <= {_MAX_BLOCK}",
                                  f"got {page_size}")
        if impl not in IMPLS:
            raise InvalidArgument("impl", f"one of {IMPLS}", f"got {impl!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.impl = impl
        self.device = runtime.default_device(device)
        self.free_pages = torch.arange(num_pages, dtype=torch.int64, device=self.device)
        # the kernels' packed report: (new pages << 32) | new tokens
        self.ret_values = torch.zeros(1, dtype=torch.int64, device=self.device)

    # --- inspection ---------------------------------------------------------------------

    def available_size(self) -> int:
        """Free token slots: free pages x page_size."""
        return int(self.free_pages.numel()) * self.page_size

    @property
    def num_free_pages(self) -> int:
        return int(self.free_pages.numel())

    def state(self) -> AllocatorState:
        """A copy of the state (``free_pages`` cloned); compare two with ``a.equals(b)``."""
        return AllocatorState(self.free_pages.clone(), self.num_pages, self.page_size)

    snapshot = state

    def __repr__(self) -> str:
        return (f"PagedTokenAllocator(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"free_pages={self.num_free_pages}, device={self.device}, impl={self.impl!r})")

    # --- step 1: validate -----------------------------------------------------------------

    def _check_tensor(self, t, argument: str) -> torch.Tensor:
        """A 1-D int32/int64 tensor on this allocator's device, returned as contiguous int64."""
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(argument, "must be a torch.Tensor", f"got {type(t).__name__}")
        if t.dtype not in _INT_DTYPES:
            raise InvalidArgument(argument, "dtype must be torch.int32 or torch.int64", f"got {t.dtype}")
        if t.dim() != 1:
            raise InvalidArgument(argument, "must be 1-D", f"got shape {tuple(t.shape)}")
        if not _same_device(t.device, self.device):
            raise InvalidArgument(argument, f"must be on the allocator's device {self.device}",
                                  f"got {t.device}")
        return t.to(torch.int64).contiguous()

    def _check_last_loc(self, last: torch.Tensor, pre: torch.Tensor, what_pre: str) -> None:
        P = self.page_size
        bad = _first_bad(torch.remainder(last + 1, P) != torch.remainder(pre, P))
        if bad is not None:
            raise InvalidArgument(
                f"last_loc[{bad}]", f"(last_loc + 1) % page_size == {what_pre} % page_size",
                f"got last_loc {int(last[bad])}, {what_pre} {int(pre[bad])}, page_size {P}")
        # a non-empty prefix ends on a real slot of this pool
        bad = _first_bad((pre > 0) & ((last < 0) | (last >= self.num_pages * P)))
        if bad is not None:
            raise InvalidArgument(
                f"last_loc[{bad}]", f"0 <= last_loc < num_pages * page_size = {self.num_pages * P} "
                "when the prefix is not empty", f"got {int(last[bad])}")
        # ... and on a page the request holds: a free page could be handed to someone else
        # in this very batch, and part 1 would then write into it
        is_free = torch.zeros(self.num_pages, dtype=torch.bool, device=self.device)
        is_free[self.free_pages] = True
        on_page = torch.where(pre > 0, last, 0) // P
        bad = _first_bad((pre > 0) & is_free[on_page])
        if bad is not None:
            raise InvalidArgument(
                f"last_loc[{bad}]", "last_loc lies on an allocated page (not in free_pages)",
                f"got {int(last[bad])}, on page {int(last[bad]) // P}, which is free")

    def _validate_extend(self, prefix_lens, seq_lens, last_loc, extend_num_tokens):
        pre = self._check_tensor(prefix_lens, "prefix_lens")
        seq = self._check_tensor(seq_lens, "seq_lens")
        last = self._check_tensor(last_loc, "last_loc")
        if not (pre.numel() == seq.numel() == last.numel()):
            raise InvalidArgument("prefix_lens/seq_lens/last_loc", "same length",
                                  f"got {pre.numel()}, {seq.numel()}, {last.numel()}")
        n_tokens = _as_int(extend_num_tokens, "extend_num_tokens")
        bad = _first_bad(pre < 0)
        if bad is not None:
            raise InvalidArgument(f"prefix_lens[{bad}]", "prefix_lens >= 0", f"got {int(pre[bad])}")
        bad = _first_bad(seq < pre)
        if bad is not None:
            raise InvalidArgument(f"seq_lens[{bad}]", "seq_lens >= prefix_lens",
                                  f"got seq {int(seq[bad])} < pre {int(pre[bad])}")
        total = int((seq - pre).sum())
        if n_tokens != total:
            raise InvalidArgument("extend_num_tokens", "extend_num_tokens == sum(seq_lens - prefix_lens)",
                                  f"got {n_tokens}, the sum is {total}")
        self._check_last_loc(last, pre, "prefix_lens")
        return pre, seq, last, n_tokens

    def _validate_decode(self, seq_lens, last_loc):
        seq = self._check_tensor(seq_lens, "seq_lens")
        last = self._check_tensor(last_loc, "last_loc")
        if seq.numel() != last.numel():
            raise InvalidArgument("seq_lens/last_loc", "same length", f"got {seq.numel()}, {last.numel()}")
        bad = _first_bad(seq < 1)
        if bad is not None:
            raise InvalidArgument(f"seq_lens[{bad}]", "seq_lens >= 1 (the length after the new token)",
                                  f"got {int(seq[bad])}")
        self._check_last_loc(last, seq - 1, "(seq_lens - 1)")
        return seq, last

    # --- step 2: count the new pages on the host ------------------------------------------

    def _pages_needed_extend(self, pre: torch.Tensor, seq: torch.Tensor) -> int:
        P = self.page_size
        return int(((seq + P - 1) // P - (pre + P - 1) // P).sum())

    def _pages_needed_decode(self, seq: torch.Tensor) -> int:
        return int(((seq - 1) % self.page_size == 0).sum())

    # --- step 3: refuse before any kernel reads free_pages ---------------------------------

    def _check_enough_pages(self, needed: int, what: str) -> None:
        if needed > self.num_free_pages:
            raise OutOfPages(needed, self.num_free_pages, what)

    # --- step 4: launch (dispatched on impl) -----------------------------------------------

    def _launch_extend(self, pre, seq, last, out, n_tokens: int, needed: int) -> None:
        if self.impl == "fast":
            self._launch_extend_fast(pre, seq, last, out, n_tokens, needed)
        elif self.impl == "teaching":
            self._launch_extend_teaching(pre, seq, last, out, n_tokens, needed)
        else:  # pragma: no cover - __init__ only accepts IMPLS
            raise InvalidArgument("impl", f"one of {IMPLS}", f"got {self.impl!r}")

    def _launch_decode(self, seq, last, out, needed: int) -> None:
        if self.impl == "fast":
            self._launch_decode_fast(seq, last, out, needed)
        elif self.impl == "teaching":
            self._launch_decode_teaching(seq, last, out, needed)
        else:  # pragma: no cover
            raise InvalidArgument("impl", f"one of {IMPLS}", f"got {self.impl!r}")

    def _launch_extend_fast(self, pre, seq, last, out, n_tokens: int, needed: int) -> None:
        # chapter 09: the counts are already known on the host (steps 1-3), so no sync here
        from .kernels.fast_alloc import alloc_extend_fast

        alloc_extend_fast(pre, seq, last, self.free_pages, self.page_size,
                          extend_num_tokens=n_tokens, num_new_pages=needed, out=out,
                          report=self.ret_values)

    def _launch_decode_fast(self, seq, last, out, needed: int) -> None:
        from .kernels.fast_alloc import alloc_decode_fast

        alloc_decode_fast(seq, last, self.free_pages, self.page_size, num_new_pages=needed, out=out,
                          report=self.ret_values)

    def _launch_extend_teaching(self, pre, seq, last, out, n_tokens: int, needed: int) -> None:
        from .kernels.alloc import alloc_extend_kernel

        bs = pre.numel()
        # the teaching kernel's tl.arange(0, next_power_of_2(n)) is one block: Triton caps its size
        limit = _MAX_BLOCK
        if _next_pow2(n_tokens) > limit or _next_pow2(bs) > limit:
            raise InvalidArgument("extend_num_tokens", f"next_power_of_2(extend_num_tokens) and "
                                  f"next_power_of_2(bs) <= {limit} for the teaching kernel",
                                  f"got {n_tokens} tokens, {bs} requests")
        alloc_extend_kernel[(bs,)](
            pre, seq, last, self.free_pages, out, self.ret_values,
            _next_pow2(bs), self.page_size, _next_pow2(n_tokens),
        )
        # the teaching path reads the packed report back (one host sync) and cross-checks it
        packed = int(self.ret_values.item())
        got = (packed >> 32, packed & 0xFFFF_FFFF)
        if got != (needed, n_tokens):
            raise IntegrityError(f"alloc_extend_kernel reported (pages, tokens) = {got}, "
                                 f"the host counted {(needed, n_tokens)}")

    def _launch_decode_teaching(self, seq, last, out, needed: int) -> None:
        from .kernels.alloc import alloc_decode_kernel

        bs = seq.numel()
        if _next_pow2(bs) > _MAX_BLOCK:
            raise InvalidArgument("seq_lens", f"next_power_of_2(bs) <= {_MAX_BLOCK} for the teaching kernel",
                                  f"got {bs} requests")
        alloc_decode_kernel[(bs,)](seq, last, self.free_pages, out, self.ret_values,
                                   _next_pow2(bs), self.page_size)
        got = int(self.ret_values.item())
        if got != needed:
            raise IntegrityError(f"alloc_decode_kernel reported {got} new pages, "
                                 f"the host counted {needed}")

    # --- step 5: the pages are handed out ---------------------------------------------------

    def _take_pages(self, n: int) -> None:
        self.free_pages = self.free_pages[n:]

    # --- the public API ---------------------------------------------------------------------

    def alloc_extend(self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                     extend_num_tokens: int) -> torch.Tensor:
        """Slots for ``seq - pre`` new tokens per request, requests concatenated (int64).

        Raises :class:`InvalidArgument` on broken rules and :class:`OutOfPages` when too few
        pages are free; in both cases before any launch, with the allocator unchanged.
        """
        pre, seq, last, n_tokens = self._validate_extend(prefix_lens, seq_lens, last_loc,
                                                         extend_num_tokens)
        needed = self._pages_needed_extend(pre, seq)
        self._check_enough_pages(needed, "extend")
        out = torch.empty(n_tokens, dtype=torch.int64, device=self.device)
        if n_tokens > 0:  # nothing to hand out: no launch (the kernel needs >= 1 lane anyway)
            self._launch_extend(pre, seq, last, out, n_tokens, needed)
        self._take_pages(needed)
        return out

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor:
        """One slot per request for one decode step; ``seq_lens`` are lengths AFTER the token."""
        seq, last = self._validate_decode(seq_lens, last_loc)
        needed = self._pages_needed_decode(seq)
        self._check_enough_pages(needed, "decode step")
        out = torch.empty(seq.numel(), dtype=torch.int64, device=self.device)
        if seq.numel() > 0:
            self._launch_decode(seq, last, out, needed)
        self._take_pages(needed)
        return out

    def free(self, indices: torch.Tensor) -> None:
        """Free the pages the token slots ``indices`` lie on (``unique(indices // P)``).

        Refuses (InvalidArgument, nothing changes) a slot out of ``[0, num_pages * P)``, a slot
        given twice, or a page that is already free.
        """
        idx = self._check_tensor(indices, "indices")
        if idx.numel() == 0:
            return
        limit = self.num_pages * self.page_size
        bad = _first_bad((idx < 0) | (idx >= limit))
        if bad is not None:
            raise InvalidArgument(f"indices[{bad}]", f"0 <= slot < num_pages * page_size = {limit}",
                                  f"got {int(idx[bad])}")
        uniq, counts = torch.unique(idx, return_counts=True)
        if bool((counts > 1).any()):
            dup = int(uniq[counts > 1][0])
            raise InvalidArgument("indices", "each slot at most once", f"slot {dup} is given twice")
        pages = torch.unique(idx // self.page_size)
        is_free = torch.zeros(self.num_pages, dtype=torch.bool, device=self.device)
        is_free[self.free_pages] = True
        bad = _first_bad(is_free[pages])
        if bad is not None:
            page = int(pages[bad])
            raise InvalidArgument("indices", "free only pages that are allocated",
                                  f"page {page} (slots {page * self.page_size}.."
                                  f"{(page + 1) * self.page_size - 1}) is already free")
        self.free_pages = torch.cat([self.free_pages, pages])
