"""Pages, token slots and the page table (chapters 00-02).

Chapter 01 builds :func:`page_to_token` (mini-sglang's ``_page_to_token``) and its Triton
twin :func:`page_to_token_triton`; chapter 02 builds :func:`write_page_table` (the
pinned-host-index + one-scatter path of mini-sglang's ``_write_page_table``) and
:func:`write_page_table_triton` (one launch over per-request metadata).

Vocabulary
----------
* A *slot* is one token's place in the KV pool. Page ``k`` owns slots
  ``k*P .. k*P + P - 1`` (``P`` = page_size); its *page start* is ``k*P``.
* The *page table* maps (request slot, logical token position) -> physical slot::

                   logical position (column) ->
                   0    1    2    3  | 4    5    6    7  | 8 ...   (P = 4)
      row 0 (req) [ 12   13   14   15 |  4    5    6    7 | -1 ... ]
      row 1 (req) [  0    1    2   -1 | -1   -1   -1   -1 | -1 ... ]
      ...
      row R (dummy request that pads CUDA-graph batches)

  kvlab fills unmapped entries with :data:`UNMAPPED` (-1): slot 0 is a real slot, so a
  zero-initialised table (as in mini-sglang) cannot show which entries were never written.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple, Sequence

import numpy as np
import torch

from ..base import runtime  # first: decides compiled Triton vs the interpreter
import triton  # noqa: E402,I001
from ..base.args import check_int, check_int_vector, check_page_size, div_ceil
from ..base.errors import InvalidArgument

#: The value of a page-table entry that maps to no slot.
UNMAPPED: int = -1

_TABLE_DTYPES = (torch.int32, torch.int64)
_KERNEL_DTYPES = (torch.int32, torch.int64)
_PAGE_TO_TOKEN_BLOCK = 256
_WRITE_BLOCK = 128


def _check_kernel_device(name: str, tensor: torch.Tensor) -> None:
    """Compiled Triton kernels need CUDA tensors; the interpreter runs on CPU tensors."""
    if not runtime.INTERPRET and tensor.device.type != "cuda":
        raise InvalidArgument(name, "must be a CUDA tensor for the compiled Triton kernel",
                              f"got a tensor on {tensor.device}; use the torch version for CPU tensors")


def new_page_table(max_running_req: int, max_seq_len: int, page_size: int,
                   device: "torch.device | str | None" = None) -> torch.Tensor:
    """An empty page table: ``(max_running_req + 1, aligned_max_seq_len)`` int32 of ``UNMAPPED``.

    The extra last row is the dummy request that pads CUDA-graph batches; columns are
    rounded up to a whole number of pages so that a full last page always fits (chapter 02).
    """
    page_size = check_page_size(page_size)
    max_running_req = check_int("max_running_req", max_running_req, minimum=1)
    max_seq_len = check_int("max_seq_len", max_seq_len, minimum=1)
    aligned = div_ceil(max_seq_len, page_size) * page_size
    return torch.full((max_running_req + 1, aligned), UNMAPPED, dtype=torch.int32,
                      device=runtime.default_device(device))


# --- chapter 01: page starts -> token slots ---------------------------------------------


def check_page_starts(page_starts, page_size, *, check_values: bool = True) -> int:
    """Validate ``page_to_token``'s input; returns ``page_size`` as an int.

    Rules: 1-D integer tensor; ``page_size >= 1``; every start a non-negative multiple of
    ``page_size``. The last rule reads the values (one device->host sync on a GPU); callers
    whose starts come straight from a free list they own may skip it with ``check_values=False``.
    """
    page_size = check_page_size(page_size)
    check_int_vector("page_starts", page_starts)
    if check_values and page_starts.numel():
        bad = ((page_starts < 0) | (page_starts % page_size != 0)).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise InvalidArgument(
                f"page_starts[{i}]", f"must be a non-negative multiple of page_size={page_size}",
                f"got {int(page_starts[i])}; pass page ids times page_size")
    return page_size


def page_to_token(page_starts: torch.Tensor, page_size: int, *, check_values: bool = True) -> torch.Tensor:
    """Every token slot of the pages that start at ``page_starts``, in order (chapter 01).

    ``page_to_token(tensor([4, 8]), 4) -> tensor([4, 5, 6, 7, 8, 9, 10, 11])``. Same dtype
    and device as the input; the input itself when ``page_size == 1``.
    ``check_values=False`` skips the (syncing) check that starts are multiples of page_size.
    """
    page_size = check_page_starts(page_starts, page_size, check_values=check_values)
    if page_size == 1:
        return page_starts  # a page is one slot: nothing to expand
    # [num_pages, 1] + [page_size] broadcasts to [num_pages, page_size]; rows are pages.
    offsets = torch.arange(page_size, dtype=page_starts.dtype, device=page_starts.device)
    return (page_starts.unsqueeze(1) + offsets).flatten()


def page_to_token_triton(page_starts: torch.Tensor, page_size: int, *,
                         check_values: bool = True) -> torch.Tensor:
    """:func:`page_to_token` as one Triton launch (chapter 01). int32 or int64 input."""
    from .paging_kernels import page_to_token_kernel

    page_size = check_page_starts(page_starts, page_size, check_values=check_values)
    if page_starts.dtype not in _KERNEL_DTYPES:
        raise InvalidArgument("page_starts", "must be int32 or int64 for the Triton kernel",
                              f"got {page_starts.dtype}")
    _check_kernel_device("page_starts", page_starts)
    if page_size == 1:
        return page_starts
    page_starts = page_starts.contiguous()
    num_tokens = page_starts.numel() * page_size
    out = torch.empty(num_tokens, dtype=page_starts.dtype, device=page_starts.device)
    if num_tokens == 0:
        return out
    grid = (triton.cdiv(num_tokens, _PAGE_TO_TOKEN_BLOCK),)
    page_to_token_kernel[grid](page_starts, out, num_tokens, page_size, BLOCK=_PAGE_TO_TOKEN_BLOCK)
    return out


# --- chapter 02: writing the page table -------------------------------------------------


class PageRun(NamedTuple):
    """One validated ``allocation_info`` entry and where its slots sit in ``allocated``."""

    table_idx: int
    first_page: int
    last_page: int
    offset: int  # index in ``allocated`` of this entry's first slot

    def length(self, page_size: int) -> int:
        return (self.last_page - self.first_page) * page_size


def check_write_page_table(page_table, allocated, allocation_info, page_size) -> list[PageRun]:
    """Validate a page-table write before anything is touched; return the entries as runs.

    Shared by :func:`write_page_table` and :func:`write_page_table_triton`. Raises
    :class:`~kvlab.base.errors.InvalidArgument` naming the argument and the rule.
    """
    meta = _validated_entries(page_table, allocated, allocation_info, page_size)
    return [PageRun(*entry) for entry in zip(*meta.tolist())]


def _validated_entries(page_table, allocated, allocation_info, page_size) -> torch.Tensor:
    """All rules of a page-table write; returns a ``[4, n]`` int64 CPU tensor whose rows are
    ``table_idx``, ``first_page``, ``last_page`` and ``offset`` (the kernel's metadata layout).

    Valid input (the common case) is judged in bulk, with a few C-speed builtins over whole
    columns; anything suspicious goes to the entry-by-entry check, which raises with the
    name of the first bad entry.
    """
    meta = _bulk_checked_entries(page_table, allocated, allocation_info, page_size)
    if meta is None:
        runs = _check_write_entry_by_entry(page_table, allocated, allocation_info, page_size)
        meta = torch.tensor([tuple(r) for r in runs], dtype=torch.int64).reshape(-1, 4).T
    return meta


def _bulk_checked_entries(page_table, allocated, allocation_info, page_size) -> torch.Tensor | None:
    """The rules of :func:`_check_write_entry_by_entry`, vectorised; ``None`` if any fails.

    ``allocation_info`` as a list of ``(table_idx, first_page, last_page)`` tuples (what the
    cache manager builds) is turned into one ``[3, n]`` int64 array with two C-speed passes
    (a type test and the conversion); an ``[n, 3]`` integer array or CPU tensor is used as
    it is. Every rule is then a NumPy operation over a whole column::

        rows    [ r0  r1  r2 ... ]   0 <= row < page_table rows, each run in one row
        firsts  [ f0  f1  f2 ... ]   0 <= first <= last, last * P <= page_table columns
        lasts   [ l0  l1  l2 ... ]   sum((last - first) * P) == len(allocated)
        offsets [ 0   c0  c0+c1 ...] * P   (the kernel's fourth row: where each run starts)
    """
    if not (isinstance(page_table, torch.Tensor) and page_table.dim() == 2
            and page_table.dtype in _TABLE_DTYPES and isinstance(allocated, torch.Tensor)
            and allocated.dim() == 1 and allocated.device == page_table.device
            and not (allocated.dtype.is_floating_point or allocated.dtype.is_complex
                     or allocated.dtype == torch.bool)
            and type(page_size) is int and page_size >= 1):
        return None
    runs = _as_runs(allocation_info)
    if runs is None:
        return None
    rows, firsts, lasts = runs
    n_rows, n_cols = page_table.shape
    counts = lasts - firsts
    if not (min(rows.min(), firsts.min(), counts.min()) >= 0 and rows.max() < n_rows
            and lasts.max() * page_size <= n_cols):
        return None
    ends = np.cumsum(counts)
    if int(ends[-1]) * page_size != allocated.numel():
        return None
    # Overlap needs two runs in one row (the usual batch has one run per row): sort the
    # non-empty runs by (row, first_page); none may start before the previous one ends.
    if np.bincount(rows, minlength=1).max() > 1:
        keep = counts > 0
        r, f, last = rows[keep], firsts[keep], lasts[keep]
        order = np.lexsort((f, r))
        r, f, last = r[order], f[order], last[order]
        if ((r[1:] == r[:-1]) & (f[1:] < last[:-1])).any():
            return None
    meta = np.empty((4, len(rows)), dtype=np.int64)
    meta[0], meta[1], meta[2] = rows, firsts, lasts
    np.multiply(ends - counts, page_size, out=meta[3])
    return torch.from_numpy(meta)


def _as_runs(allocation_info) -> np.ndarray | None:
    """``allocation_info`` as a ``[3, n]`` int64 array (rows, first pages, last pages), or None
    for anything the entry-by-entry check should judge (and name)."""
    if isinstance(allocation_info, (np.ndarray, torch.Tensor)):
        info = allocation_info.numpy() if isinstance(allocation_info, torch.Tensor) and \
            allocation_info.device.type == "cpu" else allocation_info
        if isinstance(info, np.ndarray) and info.ndim == 2 and info.shape[1] == 3 and len(info) \
                and info.dtype.kind in "iu":
            return info.T.astype(np.int64)
        return None
    if not isinstance(allocation_info, (list, tuple)) or not allocation_info:
        return None  # generators and empty lists: the exact checks are cheap enough
    try:
        if set(map(len, allocation_info)) != {3}:
            return None
        flat = list(itertools.chain.from_iterable(allocation_info))
    except TypeError:
        return None
    if set(map(type, flat)) != {int}:
        return None  # bools, floats, numpy ints...: let the exact check judge them
    return np.array(flat, dtype=np.int64).reshape(-1, 3).T


def _check_write_entry_by_entry(page_table, allocated, allocation_info, page_size) -> list[PageRun]:
    """The rules of a page-table write, checked entry by entry in Python.

    Slow but precise: it names the first entry that breaks a rule. :func:`check_write_page_table`
    runs it only when the bulk check above finds a problem (or cannot judge the input).
    """
    page_size = check_page_size(page_size)
    if not isinstance(page_table, torch.Tensor):
        raise InvalidArgument("page_table", "must be a torch.Tensor", f"got {type(page_table).__name__}")
    if page_table.dim() != 2:
        raise InvalidArgument("page_table", "must be 2-D (request slots x positions)",
                              f"got shape {tuple(page_table.shape)}")
    if page_table.dtype not in _TABLE_DTYPES:
        raise InvalidArgument("page_table", "must be int32 or int64", f"got {page_table.dtype}")
    check_int_vector("allocated", allocated)
    if allocated.device != page_table.device:
        raise InvalidArgument("allocated", "must be on the page table's device",
                              f"allocated on {allocated.device}, page_table on {page_table.device}")
    try:
        entries = list(allocation_info)
    except TypeError:
        raise InvalidArgument("allocation_info", "must be a list of (table_idx, first_page, last_page)",
                              f"got {type(allocation_info).__name__}") from None

    rows, cols = page_table.shape
    runs: list[PageRun] = []
    offset = 0
    for i, entry in enumerate(entries):
        name = f"allocation_info[{i}]"
        try:
            table_idx, first_page, last_page = (int(v) for v in entry)
            if any(isinstance(v, (bool, float)) for v in entry):
                raise TypeError
        except (TypeError, ValueError):
            raise InvalidArgument(name, "must be three ints (table_idx, first_page, last_page)",
                                  f"got {entry!r}") from None
        if not 0 <= table_idx < rows:
            raise InvalidArgument(name, f"table_idx must be in [0, {rows}) (page_table rows)",
                                  f"got {table_idx}")
        if first_page < 0:
            raise InvalidArgument(name, "first_page must be >= 0", f"got {first_page}")
        if first_page > last_page:
            raise InvalidArgument(name, "first_page <= last_page", f"got {first_page} > {last_page}")
        if last_page * page_size > cols:
            raise InvalidArgument(
                name, f"last_page * page_size must be <= {cols} (page_table columns)",
                f"got {last_page} * {page_size} = {last_page * page_size}")
        runs.append(PageRun(table_idx, first_page, last_page, offset))
        offset += (last_page - first_page) * page_size

    # Two entries for the same row must not write the same page (the later would win).
    by_row: dict[int, list[tuple[int, int, int]]] = {}
    for i, run in enumerate(runs):
        if run.first_page < run.last_page:
            by_row.setdefault(run.table_idx, []).append((run.first_page, run.last_page, i))
    for row, ranges in by_row.items():
        ranges.sort()
        for (f0, l0, i0), (f1, l1, i1) in zip(ranges, ranges[1:]):
            if f1 < l0:
                a, b = sorted((i0, i1))
                raise InvalidArgument(
                    f"allocation_info[{b}]", f"must not overlap allocation_info[{a}] (same row {row})",
                    f"pages [{f0}, {l0}) and [{f1}, {l1}) intersect")

    if allocated.numel() != offset:
        raise InvalidArgument(
            "allocated", "length must equal the sum of (last_page - first_page) * page_size",
            f"allocated has {allocated.numel()} slots, allocation_info needs {offset}")
    return runs


def write_page_table(page_table: torch.Tensor, allocated: torch.Tensor,
                     allocation_info: Sequence[tuple[int, int, int]], page_size: int) -> None:
    """Write ``allocated`` into the page table, entry by entry, with one scatter (chapter 02).

    For each ``(table_idx, first_page, last_page)`` the next ``(last_page - first_page) * P``
    slots of ``allocated`` go to ``page_table[table_idx, first_page*P : last_page*P]``.
    As in mini-sglang: fill host tensors of rows and columns (pinned when a CUDA driver is
    present, so the copy can run asynchronously), copy them non-blocking, scatter once.
    """
    runs = check_write_page_table(page_table, allocated, allocation_info, page_size)
    needed_tokens = allocated.numel()
    if needed_tokens == 0:
        return
    pin = runtime.can_pin_memory()
    rows_host = torch.empty(needed_tokens, dtype=torch.int64, pin_memory=pin)
    cols_host = torch.empty(needed_tokens, dtype=torch.int64, pin_memory=pin)
    # rows_host: | r0 r0 r0 r0 | r1 r1 ... |   cols_host: | f0*P .. l0*P-1 | f1*P .. |
    for run in runs:
        length = run.length(page_size)
        if length == 0:
            continue
        rows_host[run.offset: run.offset + length].fill_(run.table_idx)
        torch.arange(run.first_page * page_size, run.last_page * page_size,
                     out=cols_host[run.offset: run.offset + length])
    rows = rows_host.to(page_table.device, non_blocking=True)
    cols = cols_host.to(page_table.device, non_blocking=True)
    page_table[rows, cols] = allocated.to(page_table.dtype)


def _check_rows_contiguous(page_table: torch.Tensor) -> None:
    if page_table.stride(1) != 1:
        raise InvalidArgument("page_table", "rows must be contiguous (stride(1) == 1)",
                              f"got strides {page_table.stride()}")


def check_triton_page_table(page_table: torch.Tensor) -> None:
    """The rules :func:`write_page_table_triton` sets for a non-empty write to the table itself
    (on the kernel's device, rows contiguous), for callers that must check before they act."""
    _check_kernel_device("page_table", page_table)
    _check_rows_contiguous(page_table)


def write_page_table_triton(page_table: torch.Tensor, allocated: torch.Tensor,
                            allocation_info: Sequence[tuple[int, int, int]], page_size: int) -> None:
    """:func:`write_page_table` as one Triton launch over per-request metadata (chapter 02).

    The host builds a ``[4, num_requests]`` int64 array (row, first_page, last_page,
    offset): work per request, none per token. One small copy to the device, one launch.
    """
    from .paging_kernels import write_page_table_kernel

    meta = _validated_entries(page_table, allocated, allocation_info, page_size)
    if allocated.dtype not in _KERNEL_DTYPES:
        raise InvalidArgument("allocated", "must be int32 or int64 for the Triton kernel",
                              f"got {allocated.dtype}")
    _check_kernel_device("page_table", page_table)
    num_runs = meta.shape[1]
    if allocated.numel() == 0:
        return
    _check_rows_contiguous(page_table)
    # [4, R]: rows, first pages, last pages, offsets (an empty entry's program loops zero
    # times). From pinned memory the copy is asynchronous: a copy from pageable memory would
    # make the host wait for the GPU (a sync) on every write.
    if page_table.device.type == "cuda":
        meta = meta.pin_memory().to(page_table.device, non_blocking=True)
    else:
        meta = meta.to(page_table.device)
    write_page_table_kernel[(num_runs,)](
        page_table, page_table.stride(0), allocated.contiguous(), meta, num_runs,
        int(page_size), BLOCK=_WRITE_BLOCK)

