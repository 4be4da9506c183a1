"""The kernels' verdict, read on the host (chapter 09): their report, the error a refusal
stands for, and what an allocator does about refusals it has not read yet.

The allocation kernels judge every batch before they write anything and record a refusal in
``status`` (:data:`kvlab.alloc.kernel_checks.STATUS_FIELDS`). A call without host lengths
waits for the verdict (:meth:`Verdicts._settle`); a call with host lengths does not, so its
refusal stays pending until the host next reads ``status``. Meanwhile the allocator's own
head has moved as if the call stood: :meth:`Verdicts._standing_head` is the head of the calls
that stand, what its counters report. :class:`Verdicts` holds these steps for
:class:`~kvlab.alloc.token_allocator.PagedTokenAllocator`, whose methods then read like the algorithm.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from ..base.errors import InvalidArgument, OutOfPages
from .kernel_checks import STATUS_FIELDS, TOTAL_LIMIT, Refusal
from ..base.launch import raw_stream

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["DeviceReport", "refusal_error", "Verdicts"]


class DeviceReport(NamedTuple):
    """The words of ``status`` by name (see :data:`kvlab.alloc.kernel_checks.STATUS_FIELDS`)."""

    code: int
    index: int
    prefix_len: int
    seq_len: int
    last_loc: int
    device_tokens: int
    device_pages: int
    host_tokens: int
    host_pages: int
    num_free: int
    call_id: int
    free_head: int
    last_tokens: int
    last_pages: int

    @classmethod
    def from_words(cls, words: list[int]) -> "DeviceReport":
        return cls(*words[: len(STATUS_FIELDS)])


def refusal_error(rep: DeviceReport, page_size: int, what: str, decode: bool = False,
                  note: str = "") -> Exception:
    """The error a refusal stands for, naming the argument, the request and the rule
    (``note`` is added to the detail: when the refusal was found, if not by its own call)."""
    code, r, P = Refusal(rep.code), rep.index, page_size
    pre_name = "(seq_lens - 1)" if decode else "prefix_lens"

    def bad(argument: str, rule: str, detail: str) -> InvalidArgument:
        return InvalidArgument(argument, rule, detail + note)

    def count(n: int) -> str:  # (the kernels' totals stop at the limit: past it, not exact)
        return str(n) if n < TOTAL_LIMIT else "2**50 or more"

    if code == Refusal.OUT_OF_PAGES:
        if max(rep.device_pages, rep.device_tokens) >= TOTAL_LIMIT:
            what += " of 2**50 or more tokens or pages (more than any pool holds)"
        return OutOfPages(rep.device_pages, rep.num_free, what + note)
    if code == Refusal.PREFIX_NEGATIVE:
        return bad(f"prefix_lens[{r}]", "prefix_lens >= 0", f"got {rep.prefix_len}")
    if code == Refusal.SEQ_BELOW_PREFIX:
        return bad(f"seq_lens[{r}]", "seq_lens >= prefix_lens", f"got seq {rep.seq_len} < pre {rep.prefix_len}")
    if code == Refusal.SEQ_BELOW_ONE:
        return bad(f"seq_lens[{r}]", "seq_lens >= 1 (the length after the new token)", f"got {rep.seq_len}")
    if code == Refusal.LAST_LOC_OFFSET:
        return bad(f"last_loc[{r}]", f"(last_loc + 1) % page_size == {pre_name} % page_size",
                   f"got last_loc {rep.last_loc}, {pre_name} {rep.prefix_len}, page_size {P}")
    if code == Refusal.LAST_LOC_OUTSIDE:
        return bad(f"last_loc[{r}]", "0 <= last_loc < num_pages * page_size when the prefix is not empty",
                   f"got {rep.last_loc}")
    if code == Refusal.LAST_LOC_ON_FREE_PAGE:
        return bad(f"last_loc[{r}]", "last_loc lies on an allocated page (not in free_pages)",
                   f"got {rep.last_loc}, on page {rep.last_loc // P}, which is free")
    if code == Refusal.TOKENS_MISMATCH:
        return bad("extend_num_tokens", "extend_num_tokens == sum(seq_lens - prefix_lens)",
                   f"got {rep.host_tokens}, the lengths sum to {count(rep.device_tokens)}")
    if code == Refusal.PAGES_MISMATCH:
        return bad("num_new_pages", "num_new_pages == the new pages the lengths need",
                   f"got {rep.host_pages}, the lengths need {count(rep.device_pages)}")
    copies, tensors = ("seq_lens_cpu", "seq_lens") if decode else ("prefix_lens_cpu/seq_lens_cpu",
                                                                   "prefix_lens/seq_lens")
    device, host = (rep.device_tokens, rep.device_pages), (rep.host_tokens, rep.host_pages)
    detail = (f"the device tensors need {count(device[0])} tokens and {count(device[1])} pages, the host copies "
              f"{host[0]} and {host[1]}" if device != host else
              f"both need {host[0]} tokens and {host[1]} pages, but the values differ (a checksum "
              "over the requests in order)")
    return bad(copies, f"must hold the same values as {tensors} (the device tensors)", detail)


class Verdicts:
    """The device's verdict on an allocator's calls, and refusals the host has not raised yet."""

    page_size: int
    device: torch.device
    ret_values: "Tensor"
    _status: "Tensor"          # [STATUS_WORDS] int64: the kernels' record of a refusal
    _free_list: "Tensor"       # free pages: _free_list[_head:]
    _page_free: "Tensor"       # [num_pages] int8, 1 = free
    _head: int
    _unverified: bool          # a call with host lengths launched since the host last read status
    _report_host: object
    _stream: object
    _stream_handle: object

    def _standing_head(self) -> int:
        """The free list's head after the calls that stand. A call with host lengths moved it
        before its kernel judged the batch: if the kernel refused it (or an earlier call), the
        head is where it was before the refused call (one read of the device to know)."""
        if self._unverified:
            words = self._status.tolist()
            if words[0]:  # a refusal the host has not raised yet: it stays pending
                return words[11]
            self._unverified = False
        return self._head

    def _read_status(self) -> DeviceReport:
        return DeviceReport.from_words(self._status.tolist())  # a device -> host sync

    def _raise_refusal(self, rep: DeviceReport, call_id: int | None) -> None:
        """Undo the refused call and every later one (the kernels refused them too), clear
        the record, and raise the refusal's error."""
        self._head = rep.free_head
        self._status.zero_()
        self._unverified = False
        decode = bool(rep.call_id & 1)
        what = "decode step" if decode else "extend"
        note = "" if rep.call_id == call_id else (
            f"; raised now for an earlier {'alloc_decode' if decode else 'alloc_extend'} call (call "
            f"{rep.call_id // 2} of this allocator, counting those that reached the kernel), which the "
            "kernel refused: it and every allocation since returned -1 slots and took no pages")
        raise refusal_error(rep, self.page_size, what, decode=decode, note=note) from None

    def check_device_errors(self, call_id: int | None = None) -> None:
        """Raise a refusal a kernel recorded since the host last looked (one sync). ``call_id``:
        the call that reads it, when the refusal may be its own (its error then says so)."""
        words = self._status.tolist()  # a device -> host sync
        if words[0]:  # the refusal code
            self._raise_refusal(DeviceReport.from_words(words), call_id)
        self._unverified = False

    def _pending_first(self) -> None:
        """Before the host raises its own error for a call: a refusal still pending from an
        earlier call, if one may be (the allocator is then rolled back before it)."""
        if self._unverified:
            self.check_device_errors()

    def _undo_launch(self, call: int) -> None:
        """A launch that failed or was interrupted (its kernel may have run, in part or whole):
        every page of the free list is free again, and a refusal it recorded is dropped (the
        caller hears of the failure instead). The head has not moved: nothing else changed."""
        self._page_free[self._free_list[self._head:]] = 1
        words = self._status.tolist()
        if words[0] and words[10] == call:
            self._status.zero_()

    def _settle(self, call_id: int) -> int:
        """The verdict of the call just launched: one word, one sync. The kernels write
        ``ret_values`` = ``(pages << 32) | tokens`` (decode: ``pages``), or -1 if refused."""
        if self._report_host is None:
            word = self.ret_values.item()
        else:  # pinned host memory the kernel wrote: wait for the stream, then read it in place
            handle = raw_stream(self.device.index)
            if handle != self._stream_handle:  # (a Stream object per stream, not per call)
                self._stream, self._stream_handle = torch.cuda.current_stream(self.device), handle
            self._stream.synchronize()  # the one sync (torch's sync debug mode counts it)
            word = int(self._report_host[0])
        if word < 0:
            self._raise_refusal(self._read_status(), call_id)
        self._unverified = False  # (accepted: so was every earlier call, refusals being sticky)
        return word if call_id & 1 else word >> 32
