"""Plain-Python oracles for token-slot allocation in pages (chapters 03 and 04).

These follow SGLang's ``PagedTokenToKVPoolAllocator`` design, one request at a time, with
lists and loops so the logic can be checked by eye:

* :func:`alloc_extend_ref` — what ``alloc_extend_kernel`` computes for a batch of prefills
  (chapter 03): for each request the three parts

      part 1: the rest of the request's last, partly used page   last_loc + 1, last_loc + 2, ...
      part 2: whole new pages                                     page * P + 0 .. P - 1
      part 3: the partly filled new last page                     page * P + 0 .. (seq % P) - 1

* :func:`alloc_decode_ref` — what ``alloc_decode_kernel`` computes for one decode step
  (chapter 04): one slot per request, on a fresh page exactly when ``(seq - 1) % P == 0``.

Terms (all per request): ``prefix_lens`` tokens already in the KV cache before this batch;
``seq_lens`` tokens wanted after it; ``last_loc`` the physical slot of the last prefix token
(``-1`` by convention when the prefix is empty). The rule tying them together is
``(last_loc + 1) % P == prefix_len % P``: the next slot sits at the right offset in its page.

New pages are taken from the front of ``free_pages`` in request order: request 0 takes the
first ``n_0`` pages, request 1 the next ``n_1``, and so on. When there are fewer free pages
than needed the oracles raise :class:`kvlab.OutOfPages` (the kernels must never be launched
in that case: they would read past the end of ``free_pages``).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from ...base.errors import InvalidArgument, OutOfPages

#: part numbers used in the labels below
PART_OLD_PAGE, PART_WHOLE_PAGES, PART_NEW_LAST_PAGE = 1, 2, 3


class PartSpan(NamedTuple):
    """Positions ``[start, end)`` of ``out_indices`` that hold request ``req``'s part ``part``."""

    req: int
    part: int
    start: int
    end: int

    @property
    def label(self) -> str:
        return f"request {self.req}, part {self.part}"


class ExtendPlan(NamedTuple):
    """The result of one batched extend, with enough labels to explain every slot."""

    out_indices: list[int]          # one physical slot per new token, requests concatenated
    num_new_pages: int              # pages taken from the front of free_pages, all requests
    parts: list[tuple[int, int]]    # parts[i] = (request, part 1/2/3) of out_indices[i]
    spans: list[PartSpan]           # the same, as non-empty ranges in output order
    new_pages: list[list[int]]      # page ids each request took, in order
    page_reads: list[list[int]]     # positions in free_pages each request reads (the kernel's loads)
    output_starts: list[int]        # where each request's slots begin in out_indices
    num_extend_tokens: int          # sum(seq - pre) == len(out_indices)

    @property
    def ret_value(self) -> int:
        """What the kernel packs into ``ret_values``: ``(pages << 32) | tokens``."""
        return pack_ret_value(self.num_new_pages, self.num_extend_tokens)


class DecodePlan(NamedTuple):
    """The result of one decode step: one slot per request."""

    out_indices: list[int]          # out_indices[r] = the slot of request r's new token
    num_new_pages: int              # pages taken from the front of free_pages
    takes_new_page: list[bool]      # did request r cross into a new page?
    new_pages: list[int | None]     # the page request r took, or None
    page_reads: list[int | None]    # the position in free_pages request r reads, or None


# --- small arithmetic everyone shares ------------------------------------------------------


def div_ceil(a: int, b: int) -> int:
    return -(-a // b)


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages a request of ``num_tokens`` tokens occupies (the last one maybe partly)."""
    return div_ceil(num_tokens, page_size)


def part_lengths(pre: int, seq: int, page_size: int) -> tuple[int, int, int]:
    """``(num_part1, num_part2, num_part3)`` for one request growing from ``pre`` to ``seq``.

    Written the way the source design writes them::

        num_part1 = min(seq, ceil(pre/P)*P) - pre
        num_part2 = floor(seq/P)*P - ceil(pre/P)*P      (only if the request gets that far)
        num_part3 = seq - floor(seq/P)*P                (only if the request gets that far)
    """
    P = page_size
    pre_page_end = div_ceil(pre, P) * P  # first slot offset past the prefix's last page
    part1 = min(seq, pre_page_end) - pre
    if pre + part1 == seq:  # the request fits in its old page: no new pages
        return part1, 0, 0
    part2 = seq // P * P - pre_page_end
    part3 = seq - seq // P * P
    return part1, part2, part3


def pack_ret_value(num_new_pages: int, num_extend_tokens: int) -> int:
    """``ret_values`` packs two counts in one int64: pages in the high 32 bits, tokens in the low."""
    return (num_new_pages << 32) | num_extend_tokens


def unpack_ret_value(value: int) -> tuple[int, int]:
    """Inverse of :func:`pack_ret_value`: ``(num_new_pages, num_extend_tokens)``."""
    return value >> 32, value & 0xFFFF_FFFF


# --- rules --------------------------------------------------------------------------------


def check_extend_args(prefix_lens: Sequence[int], seq_lens: Sequence[int],
                      last_loc: Sequence[int], page_size: int) -> None:
    """Raise :class:`InvalidArgument` when the batch breaks one of the extend rules."""
    if page_size < 1:
        raise InvalidArgument("page_size", "page_size >= 1", f"got {page_size}")
    n = len(prefix_lens)
    if len(seq_lens) != n or len(last_loc) != n:
        raise InvalidArgument("seq_lens/last_loc", "same length as prefix_lens",
                              f"got {n}, {len(seq_lens)}, {len(last_loc)}")
    for r, (pre, seq, last) in enumerate(zip(prefix_lens, seq_lens, last_loc)):
        if pre < 0:
            raise InvalidArgument(f"prefix_lens[{r}]", "prefix_lens >= 0", f"got {pre}")
        if seq < pre:
            raise InvalidArgument(f"seq_lens[{r}]", "seq_lens >= prefix_lens",
                                  f"got seq {seq} < pre {pre}")
        if (last + 1) % page_size != pre % page_size:
            raise InvalidArgument(f"last_loc[{r}]", "(last_loc + 1) % page_size == prefix_lens % page_size",
                                  f"got last_loc {last}, prefix {pre}, page_size {page_size}")


# --- the oracles ----------------------------------------------------------------------------


def pages_needed_extend(prefix_lens: Sequence[int], seq_lens: Sequence[int], page_size: int) -> int:
    """New pages a batched extend takes: ``sum(ceil(seq/P) - ceil(pre/P))``."""
    return sum(pages_for(s, page_size) - pages_for(p, page_size)
               for p, s in zip(prefix_lens, seq_lens))


def alloc_extend_ref(prefix_lens: Sequence[int], seq_lens: Sequence[int], last_loc: Sequence[int],
                     free_pages: Sequence[int], page_size: int) -> ExtendPlan:
    """The slots a batched extend hands out, request by request, part by part (chapter 03).

    Worked example (P = 64): A grows 70 -> 190 and B 128 -> 260; free pages [7, 3, 9, 5]::

        A part 1: last_loc+1 ..  58 slots (fills A's old page)
        A part 3: page 7 * 64 + 0..61           (A's new page: 1 page)
        B part 2: pages 3, 9 -> 128 slots       (two whole pages)
        B part 3: page 5 * 64 + 0..3            (B's new last page)
        out_indices = [A 58 | A 62 | B 128 | B 4],  num_new_pages = 4
    """
    check_extend_args(prefix_lens, seq_lens, last_loc, page_size)
    P = page_size
    needed = pages_needed_extend(prefix_lens, seq_lens, P)
    if needed > len(free_pages):
        raise OutOfPages(needed, len(free_pages), "extend")

    out: list[int] = []
    parts: list[tuple[int, int]] = []
    spans: list[PartSpan] = []
    new_pages: list[list[int]] = []
    page_reads: list[list[int]] = []
    output_starts: list[int] = []
    next_free = 0  # position in free_pages of the next page to hand out

    def emit(req: int, part: int, slots: list[int]) -> None:
        if slots:
            spans.append(PartSpan(req, part, len(out), len(out) + len(slots)))
            out.extend(slots)
            parts.extend([(req, part)] * len(slots))

    for r, (pre, seq, last) in enumerate(zip(prefix_lens, seq_lens, last_loc)):
        output_starts.append(len(out))
        n_new = pages_for(seq, P) - pages_for(pre, P)
        reads = list(range(next_free, next_free + n_new))
        mine = [int(free_pages[i]) for i in reads]
        page_reads.append(reads)
        new_pages.append(mine)
        next_free += n_new

        n1, n2, n3 = part_lengths(pre, seq, P)
        emit(r, PART_OLD_PAGE, [last + 1 + k for k in range(n1)])
        emit(r, PART_WHOLE_PAGES, [mine[k // P] * P + k % P for k in range(n2)])
        # part 3 lives on the request's last new page
        emit(r, PART_NEW_LAST_PAGE, [mine[-1] * P + k for k in range(n3)] if n3 else [])

    return ExtendPlan(out, needed, parts, spans, new_pages, page_reads, output_starts, len(out))


def pages_needed_decode(seq_lens: Sequence[int], page_size: int) -> int:
    """New pages one decode step takes: one per request whose new token starts a page."""
    return sum(1 for s in seq_lens if (s - 1) % page_size == 0)


def check_decode_args(seq_lens: Sequence[int], last_loc: Sequence[int], page_size: int) -> None:
    """Raise :class:`InvalidArgument` when a decode batch breaks one of the rules."""
    if page_size < 1:
        raise InvalidArgument("page_size", "page_size >= 1", f"got {page_size}")
    if len(last_loc) != len(seq_lens):
        raise InvalidArgument("last_loc", "same length as seq_lens",
                              f"got {len(last_loc)} and {len(seq_lens)}")
    for r, (seq, last) in enumerate(zip(seq_lens, last_loc)):
        if seq < 1:
            raise InvalidArgument(f"seq_lens[{r}]", "seq_lens >= 1 (the length after the new token)",
                                  f"got {seq}")
        if (last + 1) % page_size != (seq - 1) % page_size:
            raise InvalidArgument(f"last_loc[{r}]", "(last_loc + 1) % page_size == (seq_lens - 1) % page_size",
                                  f"got last_loc {last}, seq {seq}, page_size {page_size}")


def alloc_decode_ref(seq_lens: Sequence[int], last_loc: Sequence[int], free_pages: Sequence[int],
                     page_size: int) -> DecodePlan:
    """One slot per request for one decode step (chapter 04).

    ``seq_lens`` are the lengths AFTER the new token (``seq = pre + 1``, as in SGLang). The new
    token is token number ``seq - 1`` (0-based); it starts a page exactly when
    ``(seq - 1) % P == 0``, and then takes the next free page; otherwise it goes right after
    the last token, at ``last_loc + 1``.
    """
    check_decode_args(seq_lens, last_loc, page_size)
    P = page_size
    needed = pages_needed_decode(seq_lens, P)
    if needed > len(free_pages):
        raise OutOfPages(needed, len(free_pages), "decode step")
    out: list[int] = []
    takes: list[bool] = []
    pages: list[int | None] = []
    reads: list[int | None] = []
    next_free = 0
    for seq, last in zip(seq_lens, last_loc):
        if (seq - 1) % P == 0:
            page = int(free_pages[next_free])
            out.append(page * P)
            takes.append(True)
            pages.append(page)
            reads.append(next_free)
            next_free += 1
        else:
            out.append(last + 1)
            takes.append(False)
            pages.append(None)
            reads.append(None)
    return DecodePlan(out, needed, takes, pages, reads)


def kernel_page_reads_extend(prefix_lens: Sequence[int], seq_lens: Sequence[int],
                             page_size: int) -> list[list[int]]:
    """Positions of ``free_pages`` the extend kernel loads, per request, *whatever its length*.

    Used to show the out-of-memory hazard safely: with ``len(free_pages) == F`` every position
    ``>= F`` in this list is a read past the end of the tensor, which is what the original
    order (launch first, check the page count afterwards) does when pages run short.
    """
    reads, nxt = [], 0
    for pre, seq in zip(prefix_lens, seq_lens):
        n = pages_for(seq, page_size) - pages_for(pre, page_size)
        reads.append(list(range(nxt, nxt + n)))
        nxt += n
    return reads
