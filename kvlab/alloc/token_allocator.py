"""``PagedTokenAllocator``: token slots handed out in pages, a whole batch per launch.

Chapter 03 builds :meth:`PagedTokenAllocator.alloc_extend` (prefill / extend) and chapter 04
:meth:`PagedTokenAllocator.alloc_decode` (one token per request per step), after SGLang's
``PagedTokenToKVPoolAllocator``; chapter 09 makes them fast.

The pool has ``num_pages`` pages of ``page_size`` (P) token slots; page ``k`` owns slots
``k*P .. k*P + P - 1``. ``free_pages`` lists the free page ids; allocations take them from
the front, ``free`` appends them at the back::

    free list:  [ 7  3  9  5  0  2 ... ]        alloc_extend needing 4 pages
                  ^ head                        -> pages 7, 3, 9, 5 are handed out
                 \\__________/ ^ head afterwards  (free_pages = the list from head on)
    page_free:  one byte per page, 1 = free     (what the kernels check last_loc against)

Choices (documented because SGLang differs in places):

* **Every page is usable**: page ids ``0 .. num_pages - 1``. (SGLang reserves page 0 as the
  padding target of CUDA-graph batches; kvlab's page tables mark unmapped entries with -1.)
* **Empty prefix**: ``last_loc`` is ``-1`` by convention when ``prefix_len == 0``. The rule
  ``(last_loc + 1) % P == prefix_len % P`` holds for every request; a non-empty prefix's
  ``last_loc`` must be a slot of this pool on a page that is not free (else part 1 could
  write into a page handed to someone else in this very batch).
* **Decode lengths**: ``alloc_decode`` takes ``seq_lens`` AFTER the new token (``seq = pre + 1``).
* **Safe order**: no kernel reads ``free_pages`` past the pages that are free. With host
  lengths the page count is checked on the host before the launch; without, the kernel
  counts and refuses by itself before reading. (The source design launched first and
  checked afterwards: on out-of-memory its kernel had already read past ``free_pages``.)
* **Freeing**: ``free(indices)`` takes token slots and frees the pages they lie on
  (``unique(indices // P)``). It refuses a slot out of range, a slot given twice, or a page
  that is already free: nothing is freed twice.

Syncs and errors (chapter 09). A call with host copies of the lengths (``prefix_lens_cpu`` /
``seq_lens_cpu``: what a scheduler has) never waits for the GPU; a call without them waits
once, for the page count. The checks stay on either way: rules on the lengths run on the host
copies; rules only the device can read run inside the kernel, which refuses a bad batch
before it writes anything (slots of -1, no page taken, see :mod:`kvlab.alloc.fast_alloc_kernels`).
Such a refusal is raised by the next call that reads the device: any call without host
lengths, :meth:`free`, :meth:`check_device_errors`, or a call the host refuses (before its
own error); every allocation in between was refused too, and the allocator is rolled back to
just before the refused call. The counters (``num_free_pages``, ``free_pages``, ``state()``)
count only calls that stand: after a call with host lengths they read the device once to know.
On a CPU, where reading the device costs nothing, the refusal is raised by the call itself
(``eager_errors``). A launch that fails or is interrupted (a ``KeyboardInterrupt`` while the
interpreter runs a kernel) leaves nothing behind: the pages it may have marked are free again.
On a GPU ``ret_values`` (the kernels' packed report) lives in pinned host memory that the
kernels write directly, so the one wait of a call without host lengths copies nothing; read it
only after a call that waited (or ``torch.cuda.synchronize()``).

``impl`` picks the kernels: ``"fast"`` (chapter 09, the default; one compilation per page
size, made in the constructor, serves every batch) or ``"teaching"`` (chapters 03-04; its
kernels read ``free_pages`` unmasked, so the verdict is read back before they launch: one
sync per call, whatever the caller passes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import runtime  # first: decides compiled Triton vs the interpreter
from . import native_counts
import triton.language as tl  # noqa: E402,I001
from .host_checks import (capacity_error, check_count, check_devices, check_index_tensor, decode_counts,
                           extend_counts, fits, same_device)
from .verdict import DeviceReport, Verdicts
from ..base.args import check_int, check_page_size, next_pow2
from ..base.errors import InvalidArgument, OutOfPages
from . import fast_alloc_kernels as K
from .kernel_checks import STATUS_WORDS, TOTAL_LIMIT
from ..base.launch import launch_ready

#: the implementations of the launch step: "fast" (chapter 09, the default) and "teaching"
IMPLS: tuple[str, ...] = ("fast", "teaching")
_EXTEND_NAMES = ("prefix_lens", "seq_lens", "last_loc")
_DECODE_NAMES = ("seq_lens", "last_loc")
#: the largest block ``tl.arange`` may build (Triton's TRITON_MAX_TENSOR_NUMEL)
_MAX_BLOCK: int = getattr(tl, "TRITON_MAX_TENSOR_NUMEL", 1 << 20)
_MAX_PAGES = 1 << 31


@dataclass(frozen=True)
class AllocatorState:
    """A copy of an allocator's state, for tests and notebooks: compare with :meth:`equals`."""

    free_pages: torch.Tensor
    num_pages: int
    page_size: int

    def equals(self, other: "AllocatorState") -> bool:
        return (self.num_pages == other.num_pages and self.page_size == other.page_size
                and torch.equal(self.free_pages.cpu(), other.free_pages.cpu()))


def _pinned_device(device) -> torch.device:
    """``cuda`` becomes ``cuda:<current>``, so that comparing it with a tensor's device is exact."""
    device = runtime.default_device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class PagedTokenAllocator(Verdicts):
    """Hands out KV token slots in pages of ``page_size``, for whole batches at once.

    >>> alloc = PagedTokenAllocator(num_pages=8, page_size=4)
    >>> alloc.available_size()
    32
    """

    def __init__(self, num_pages: int, page_size: int, device: "torch.device | str | None" = None,
                 *, impl: str = "fast", eager_errors: bool | None = None):
        num_pages = check_int("num_pages", num_pages, minimum=1)
        if num_pages >= _MAX_PAGES:  # (the kernels report a page count in the upper 32 bits of a word)
            raise InvalidArgument("num_pages", "num_pages < 2**31", f"got {num_pages}")
        page_size = check_page_size(page_size)
        if page_size & (page_size - 1) or page_size > _MAX_BLOCK:
            # the teaching kernels use tl.arange(0, page_size): a power of two, capped by Triton
            raise InvalidArgument("page_size", f"a power of two, 1 <= page_size <= {_MAX_BLOCK}",
                                  f"got {page_size}")
        if impl not in IMPLS:
            raise InvalidArgument("impl", f"one of {IMPLS}", f"got {impl!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.impl = impl
        self.device = _pinned_device(device)
        if not runtime.INTERPRET and self.device.type != "cuda":
            raise InvalidArgument("device", "must be a CUDA device: the kernels are compiled for the GPU",
                                  f"got {self.device}")
        self.eager_errors = self.device.type == "cpu" if eager_errors is None else bool(eager_errors)
        i64 = dict(dtype=torch.int64, device=self.device)
        self._head = 0
        self._page_free = torch.ones(num_pages, dtype=torch.int8, device=self.device)
        self._status = torch.zeros(STATUS_WORDS, **i64)   # refusals, for the host
        self._scratch, self._scratch_words, self._scratch_addr = torch.empty(0, **i64), 0, 0
        self._calls = 0
        self._unverified = False  # a call with host lengths launched since the host last read status
        self._extend_key, self._decode_key = K.int64_key(page_size, 4), K.int64_key(page_size, 3)
        # The kernels' packed report: (new pages << 32) | new tokens; decode: new pages. On a GPU
        # it lives in pinned host memory, which the kernel writes directly: after the one sync
        # of a call without host lengths the host reads it with no copy (.item() would copy).
        cuda = self.device.type == "cuda"
        self.ret_values = torch.zeros(1, dtype=torch.int64, pin_memory=cuda) if cuda else torch.zeros(1, **i64)
        self._report_host = self.ret_values.numpy() if cuda else None
        self._stream_handle, self._stream = None, None
        #: seconds each kernel took to compile here (0.0: it came from Triton's cache, or the
        #: interpreter): after this, no call compiles
        self.compile_seconds = K.warm_up(page_size, self.device, fill=impl == "fast")
        native_counts.load()  # the host counts' C helper: built once per machine, loaded here
        # the fused extend and the decode kernel, called through Triton's C launcher with
        # addresses (None: the interpreter, or a Triton whose launcher kvlab does not know)
        self._direct = K.direct_kernels(page_size, self.device) if impl == "fast" else None
        self._set_free_list(torch.arange(num_pages, **i64))    # free pages: _free_list[_head:]

    # --- inspection (a device read only to learn whether a call with host lengths stands) ---

    @property
    def num_free_pages(self) -> int:
        return self._free_list.numel() - self._standing_head()

    def available_size(self) -> int:
        """Free token slots: free pages x page_size."""
        return self.num_free_pages * self.page_size

    @property
    def free_pages(self) -> torch.Tensor:
        """The free page ids, in the order they will be handed out."""
        return self._free_list[self._standing_head():]

    @free_pages.setter
    def free_pages(self, pages: torch.Tensor) -> None:
        """Replace the free list (tests and notebooks); every other page counts as allocated."""
        check_index_tensor("free_pages", pages)
        check_devices("the allocator", self.device, free_pages=pages)
        pages = pages.to(torch.int64).contiguous()
        if pages.numel():
            lo, hi = torch.stack([pages.min(), pages.max()]).tolist()
            distinct = pages.unique().numel()
            if lo < 0 or hi >= self.num_pages or distinct != pages.numel():
                raise InvalidArgument("free_pages", f"distinct page ids in [0, {self.num_pages})",
                                      f"got min {lo}, max {hi}, {distinct} distinct of {pages.numel()}")
        self._set_free_list(pages)
        self._page_free.zero_()
        self._page_free[pages] = 1
        self._status.zero_()
        self._unverified = False

    def state(self) -> AllocatorState:
        """A copy of the state (``free_pages`` cloned); compare two with ``a.equals(b)``."""
        return AllocatorState(self.free_pages.clone(), self.num_pages, self.page_size)

    snapshot = state

    def __repr__(self) -> str:
        return (f"PagedTokenAllocator(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"free_pages={self.num_free_pages}, device={self.device}, impl={self.impl!r})")

    # --- step 1: the arguments the host can judge ----------------------------------------------

    def _device_lengths(self, names: tuple, tensors: tuple) -> tuple:
        """1-D integer tensors on this device, one entry per request, as contiguous int64."""
        first, dev, i64 = tensors[0], self.device, torch.int64
        if isinstance(first, Tensor):  # the common case, judged in one pass
            shape = first.shape
            for t in tensors:
                if not (isinstance(t, Tensor) and t.dtype is i64 and t.shape == shape and len(shape) == 1
                        and t.device == dev and t.is_contiguous()):
                    break
            else:
                return tensors
        for name, t in zip(names, tensors):
            check_index_tensor(name, t)
            if not same_device(t.device, dev):
                raise InvalidArgument(name, f"must be on the allocator's device {dev}", f"got {t.device}")
        if len({t.numel() for t in tensors}) != 1:
            raise InvalidArgument("/".join(names), "same length", f"got {[t.numel() for t in tensors]}")
        return tuple(t.to(torch.int64).contiguous() for t in tensors)

    def _scratch_for(self, words: int) -> Tensor:
        if self._scratch_words < words:  # grows, never shrinks: one allocation for many calls
            self._scratch_words = max(words, 2 * self._scratch_words)
            self._scratch = torch.empty(self._scratch_words, dtype=torch.int64, device=self.device)
            self._scratch_addr = self._scratch.data_ptr()
        return self._scratch

    def _set_free_list(self, pages: Tensor) -> None:
        """A new free list (int64, contiguous), from its start; the kernels' addresses follow."""
        self._free_list, self._head = pages, 0
        # what the direct launches pass for free_pages, page_free, status and report
        self._pool_addrs = (pages.data_ptr(), self._page_free.data_ptr(), self._status.data_ptr(),
                            self.ret_values.data_ptr())

    # --- the public API ---------------------------------------------------------------------

    def alloc_extend(self, prefix_lens: Tensor, seq_lens: Tensor, last_loc: Tensor, extend_num_tokens: int,
                     *, prefix_lens_cpu=None, seq_lens_cpu=None) -> Tensor:
        """Slots for ``seq - pre`` new tokens per request, requests concatenated (int64).

        ``prefix_lens_cpu`` / ``seq_lens_cpu``: host copies of the lengths (a CPU tensor,
        NumPy array or list); with them the call makes no device->host sync. Raises
        :class:`InvalidArgument` on broken rules and :class:`OutOfPages` when too few pages are
        free, with the allocator unchanged (see the module docstring for when); a refusal still
        pending from an earlier call is raised first.
        """
        try:  # (the host's judgement: its errors come after a refusal still pending)
            pre, seq, last = self._device_lengths(_EXTEND_NAMES, (prefix_lens, seq_lens, last_loc))
            bs, P, head = pre.numel(), self.page_size, self._head
            n_tokens = check_count("extend_num_tokens", extend_num_tokens)
            num_free = self._free_list.numel() - head
            host = None
            if prefix_lens_cpu is not None or seq_lens_cpu is not None:
                if prefix_lens_cpu is None or seq_lens_cpu is None:
                    raise InvalidArgument("prefix_lens_cpu/seq_lens_cpu", "give both or neither")
                host = extend_counts(prefix_lens_cpu, seq_lens_cpu, P, bs)  # (exact: no sum wraps)
                if host.tokens != n_tokens:
                    raise InvalidArgument("extend_num_tokens", "extend_num_tokens == sum(seq_lens - prefix_lens)",
                                          f"got {n_tokens}, the lengths sum to {host.tokens}")
                if host.pages > num_free:
                    raise OutOfPages(host.pages, num_free, "extend")  # before any launch
            if bs == 0:
                if n_tokens:
                    raise InvalidArgument("extend_num_tokens", "0 for an empty batch", f"got {n_tokens}")
                return torch.empty(0, dtype=torch.int64, device=self.device)
            if (host is None or n_tokens >= TOTAL_LIMIT) and not fits(n_tokens, num_free, bs, P):
                self._refuse_beyond_capacity(pre, seq, last, n_tokens, head, num_free)  # (no output yet)
            if self.impl == "teaching" and max(next_pow2(n_tokens), next_pow2(bs)) > _MAX_BLOCK:
                # the teaching kernel's tl.arange(0, next_power_of_2(n)) is one block: Triton caps it
                raise InvalidArgument("extend_num_tokens", f"next_power_of_2(extend_num_tokens) and "
                                      f"next_power_of_2(bs) <= {_MAX_BLOCK} for the teaching kernel",
                                      f"got {n_tokens} tokens, {bs} requests")
        except (InvalidArgument, OutOfPages):
            self._pending_first()
            raise
        out = self._status.new_empty(n_tokens)  # int64 on this device (no dtype/device to parse)
        self._calls += 1
        call = 2 * self._calls  # even: an extend (the kind of call rides in the lowest bit)
        host_checks = (host.pages, 1, host.sum_pre, host.sum_seq) if host else (-1, 0, 0, 0)
        try:  # (a launch that fails or is interrupted leaves no trace)
            if self.impl == "fast":
                direct, programs = self._direct, K.fill_programs(n_tokens)
                stream = launch_ready(direct.device) if direct and K.fused(bs, n_tokens) else None
                if stream is not None:  # the hot path: the fused kernel, with addresses (same arguments)
                    self._scratch_for(programs * 2 * bs)
                    direct.extend(programs, stream, (pre.data_ptr(), seq.data_ptr(), last.data_ptr(),
                                  *self._pool_addrs, self._scratch_addr, out.data_ptr(), bs, n_tokens, head,
                                  num_free, self.num_pages, *host_checks, call, 1, K.search_steps(bs), P,
                                  K.EXTEND_BLOCK, K.BATCH_BLOCK))
                else:
                    K.launch_extend(pre, seq, last, self._free_list, self._page_free, self._status,
                                    self.ret_values, self._scratch_for(K.extend_scratch_words(bs, n_tokens)),
                                    out, bs, n_tokens, head, num_free, self.num_pages, *host_checks, call, 1,
                                    P, self._extend_key)
                if host is None:
                    pages = self._settle(call)
                else:  # (the verdict stays on the device: the counters read it when asked)
                    pages, self._unverified = host.pages, True
            else:
                checks = (bs, n_tokens, head, num_free, self.num_pages) + host_checks + (call, 1)
                pages = self._extend_teaching(pre, seq, last, out, checks, call)
        except BaseException:
            self._undo_launch(call)
            raise
        self._head += pages
        if self.eager_errors and host is not None:
            self.check_device_errors(call)
        return out

    def alloc_decode(self, seq_lens: Tensor, last_loc: Tensor, *, seq_lens_cpu=None) -> Tensor:
        """One slot per request for one decode step; ``seq_lens`` are lengths AFTER the token.

        ``seq_lens_cpu``: a host copy of ``seq_lens``; with it the call makes no sync.
        """
        try:  # (as in alloc_extend: a pending refusal first)
            seq, last = self._device_lengths(_DECODE_NAMES, (seq_lens, last_loc))
            bs, P, head = seq.numel(), self.page_size, self._head
            num_free = self._free_list.numel() - head
            host = None
            if seq_lens_cpu is not None:
                host = decode_counts(seq_lens_cpu, P, bs)
                if host.pages > num_free:
                    raise OutOfPages(host.pages, num_free, "decode step")  # before any launch
            if self.impl == "teaching" and next_pow2(bs) > _MAX_BLOCK:
                raise InvalidArgument("seq_lens", f"next_power_of_2(bs) <= {_MAX_BLOCK} for the teaching kernel",
                                      f"got {bs} requests")
        except (InvalidArgument, OutOfPages):
            self._pending_first()
            raise
        out = self._status.new_empty(bs)
        if bs == 0:
            return out
        self._calls += 1
        call = 2 * self._calls + 1  # odd: a decode step
        checks = (bs, head, num_free, self.num_pages) + (
            (host.pages, 1, host.sum_seq) if host else (-1, 0, 0)) + (call, 1)
        try:
            if self.impl == "fast":
                direct = self._direct
                stream = launch_ready(direct.device) if direct else None
                if stream is not None:  # the hot path (see alloc_extend)
                    direct.decode(1, stream, (seq.data_ptr(), last.data_ptr(), *self._pool_addrs,
                                              out.data_ptr(), *checks, 1, P, K.BATCH_BLOCK))
                else:
                    K.launch_decode(seq, last, self._free_list, self._page_free, self._status, self.ret_values,
                                    out, *checks, 1, P, self._decode_key)
                if host is None:
                    pages = self._settle(call)
                else:  # (the verdict stays on the device: the counters read it when asked)
                    pages, self._unverified = host.pages, True
            else:
                K.launch_decode(seq, last, self._free_list, self._page_free, self._status, self.ret_values,
                                out, *checks, 0, P, self._decode_key)
                pages = self._settle(call)  # the teaching kernel reads free_pages unmasked: verdict first
                from .alloc_kernels import alloc_decode_kernel

                alloc_decode_kernel[(bs,)](seq, last, self._free_list[head:], out, self.ret_values,
                                           next_pow2(bs), P)
                self._mark_taken(pages)
        except BaseException:
            self._undo_launch(call)
            raise
        self._head += pages
        if self.eager_errors and host is not None:
            self.check_device_errors(call)
        return out

    def _refuse_beyond_capacity(self, pre, seq, last, n_tokens: int, head: int, num_free: int) -> None:
        """More tokens than the free pages could hold, whatever the lengths (an absurd count would
        fail the output's allocation): the kernels' check pass alone, which writes nothing, says
        why (the lengths sum to something else, or need that many pages: one sync); a count of
        2**50 or more is out of pages outright (as the kernels would say)."""
        bs, P = pre.numel(), self.page_size
        if n_tokens < TOTAL_LIMIT:  # (at or past it: out of pages, whatever the lengths)
            self._calls += 1
            call = 2 * self._calls
            K.launch_extend_check(pre, seq, last, self._page_free, self._status, self.ret_values,
                                  self._scratch_for(2 * bs + 1), bs, n_tokens, head, num_free,
                                  self.num_pages, -1, 0, 0, 0, call, 1, P)
            self._settle(call)  # raises: the check pass cannot accept such a count
        raise capacity_error(n_tokens, num_free, bs, P)

    def _extend_teaching(self, pre, seq, last, out, checks: tuple, call: int) -> int:
        """Chapter 03's kernel, after the fast check+scan and one read of its verdict."""
        from .alloc_kernels import alloc_extend_kernel

        bs, n_tokens = checks[0], checks[1]
        K.launch_extend_check(pre, seq, last, self._page_free, self._status, self.ret_values,
                              self._scratch_for(2 * bs + 1), *checks, self.page_size)
        pages = self._settle(call)
        if n_tokens > 0:  # (the kernel needs >= 1 lane of work)
            alloc_extend_kernel[(bs,)](pre, seq, last, self.free_pages, out, self.ret_values,
                                       next_pow2(bs), self.page_size, next_pow2(n_tokens))
        self._mark_taken(pages)
        return pages

    def _mark_taken(self, pages: int) -> None:
        """The teaching kernels do not keep page_free: mark their pages allocated here."""
        if pages:
            self._page_free.index_fill_(0, self._free_list[self._head:self._head + pages], 0)

    def free(self, indices: Tensor) -> None:
        """Free the pages the token slots ``indices`` lie on (``unique(indices // P)``).

        Refuses (InvalidArgument, nothing changes) a slot out of ``[0, num_pages * P)``, a slot
        given twice, or a page that is already free. Raises first any refusal a kernel recorded.
        """
        check_index_tensor("indices", indices)
        check_devices("the allocator", self.device, indices=indices)
        idx = indices.to(torch.int64)
        P, limit = self.page_size, self.num_pages * self.page_size
        if idx.numel() == 0:
            return self.check_device_errors()
        uniq, counts = torch.unique(idx, return_counts=True)
        pages = torch.unique(uniq.clamp(0, limit - 1) // P)
        outside = (idx < 0) | (idx >= limit)
        twice = counts > 1
        already = self._page_free[pages] != 0
        words = torch.cat([self._status, torch.stack([
            outside.any().long(), outside.long().argmax(), twice.any().long(), uniq[twice.long().argmax()],
            already.any().long(), pages[already.long().argmax()]])]).tolist()  # one sync for every rule
        rep = DeviceReport.from_words(words[:STATUS_WORDS])
        if rep.code:
            self._raise_refusal(rep, None)
        any_out, first_out, any_twice, dup, any_free, free_page = words[STATUS_WORDS:]
        if any_out:
            raise InvalidArgument(f"indices[{first_out}]", f"0 <= slot < num_pages * page_size = {limit}",
                                  f"got {int(idx[first_out])}")
        if any_twice:
            raise InvalidArgument("indices", "each slot at most once", f"slot {dup} is given twice")
        if any_free:
            raise InvalidArgument("indices", "free only pages that are allocated",
                                  f"page {free_page} (slots {free_page * P}..{(free_page + 1) * P - 1}) "
                                  "is already free")
        self._set_free_list(torch.cat([self.free_pages, pages]))
        self._page_free[pages] = 1
