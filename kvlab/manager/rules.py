"""The rules the cache manager's doors enforce, and the conservation law it proves (chapter 06).

:class:`~kvlab.manager.cache_manager.CacheManager` inherits these, so that each of its public
methods reads like the algorithm it teaches: ``self._validate_<method>(...)`` first (every rule
checked before anything changes, :class:`~kvlab.base.errors.InvalidArgument` or
:class:`~kvlab.base.errors.CacheMisuse` naming the argument and the rule), then the algorithm.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..base.args import check_int, div_ceil
from ..base.errors import CacheMisuse, IntegrityError, InvalidArgument, OutOfPages
from ..alloc.paging import check_triton_page_table
from .req import ForwardBatch, Req

if TYPE_CHECKING:  # the manager's fields these checks read
    from ..prefix.radix_cache import RadixPrefixCache

__all__ = ["CacheManagerChecks"]


class _Running:
    """The manager's record of a running request: which row, how far its pages reach."""

    __slots__ = ("req", "alloc_pages")

    def __init__(self, req: Req, alloc_pages: int):
        self.req = req
        self.alloc_pages = alloc_pages  # pages [0, alloc_pages) of the row are mapped


class CacheManagerChecks:
    """Argument checks and integrity checks of :class:`~kvlab.manager.cache_manager.CacheManager`."""

    page_size: int
    num_pages: int
    page_table: torch.Tensor
    free_slots: torch.Tensor
    prefix_cache: "RadixPrefixCache"
    page_table_writer: str
    _running: dict

    # --- checks shared by the doors ---------------------------------------------------

    @staticmethod
    def _check_reqs(reqs) -> list:
        if isinstance(reqs, (str, bytes, Req)) or not isinstance(reqs, (list, tuple)):
            raise InvalidArgument("reqs", "must be a list or tuple of kvlab.Req",
                                  f"got {type(reqs).__name__}")
        return list(reqs)

    def _check_req(self, req, name: str) -> None:
        """A Req whose row exists and whose lengths are ints (fields may be changed by hand)."""
        if not isinstance(req, Req):
            raise InvalidArgument(name, "must be a kvlab.Req", f"got {type(req).__name__}")
        rows = self.page_table.shape[0]
        table_idx = check_int(f"{name}.table_idx", req.table_idx)
        if not 0 <= table_idx < rows:
            raise InvalidArgument(f"{name}.table_idx", f"must be in [0, {rows}) (page_table rows)",
                                  f"got {req.table_idx!r}")
        check_int(f"{name}.cached_len", req.cached_len, minimum=0)
        check_int(f"{name}.device_len", req.device_len, minimum=0)

    def _is_running(self, req: Req) -> bool:
        rec = self._running.get(req.table_idx)
        return rec is not None and rec.req is req

    def _running_record(self, req: Req, what: str) -> _Running:
        self._check_req(req, "req")
        if not self._is_running(req):
            raise CacheMisuse(f"{what}: this request (row {req.table_idx}) is not running: it was "
                              "never allocated, or it already finished or was released. Each "
                              "request is cached with finished=True (or released) exactly once.")
        return self._running[req.table_idx]

    @staticmethod
    def _handle_len(req: Req) -> int:
        return req.cache_handle.cached_len if req.cache_handle is not None else 0

    def _holds_its_prefix(self, req: Req) -> bool:
        return req.cache_handle is None or self.prefix_cache.is_locked_by(req.cache_handle, req)

    def _validate_allocation(self, reqs) -> tuple[list[tuple[int, int, int]], list[Req], int]:
        """Every rule of :meth:`allocate_paged`, checked before anything changes. Returns the
        page-table writes ``(row, first_page, last_page)``, the requests not yet running, and
        how many pages to take."""
        P = self.page_size
        cols = self.page_table.shape[1]
        allocation_info: list[tuple[int, int, int]] = []
        new_reqs: list[Req] = []
        seen_rows: set[int] = set()
        for i, req in enumerate(self._check_reqs(reqs)):
            name = f"reqs[{i}]"
            self._check_req(req, name)
            if req.table_idx in seen_rows:
                raise InvalidArgument(f"{name}.table_idx", "each request of a batch has its own row",
                                      f"row {req.table_idx} appears twice")
            seen_rows.add(req.table_idx)
            if not 0 <= req.cached_len <= req.device_len:
                raise InvalidArgument(f"{name}.cached_len", "0 <= cached_len <= device_len",
                                      f"got cached_len={req.cached_len}, device_len={req.device_len}")
            first_page, last_page = div_ceil(req.cached_len, P), div_ceil(req.device_len, P)
            if last_page * P > cols:
                raise InvalidArgument(f"{name}.device_len",
                                      f"must fit the page table: div_ceil(device_len, P) * P <= {cols}",
                                      f"got device_len={req.device_len}")
            rec = self._running.get(req.table_idx)
            if rec is not None and rec.req is not req:
                raise InvalidArgument(f"{name}.table_idx", "row is already used by another running request",
                                      f"row {req.table_idx}")
            if rec is None:  # a request that skipped admit: its prefix must be locked by it
                if req.cache_handle is not None and not self.prefix_cache.is_locked_by(req.cache_handle, req):
                    raise InvalidArgument(f"{name}.cache_handle", "must be locked by its request "
                                          "(CacheManager.lock(handle, owner=req), or use admit)")
                if req.cached_len != self._handle_len(req):
                    raise InvalidArgument(
                        f"{name}.cached_len", "a new request starts at its matched prefix: "
                        "cached_len == cache_handle.cached_len (use CacheManager.admit)",
                        f"got cached_len={req.cached_len}, handle covers {self._handle_len(req)}")
                new_reqs.append(req)
            mapped = first_page if rec is None else rec.alloc_pages
            if last_page <= first_page:
                continue
            if first_page != mapped:
                raise InvalidArgument(
                    f"{name}.cached_len", "new pages must start where the row's pages end: "
                    "div_ceil(cached_len, P) == pages already mapped",
                    f"div_ceil({req.cached_len}, {P}) = {first_page}, but {mapped} pages are mapped")
            allocation_info.append((req.table_idx, first_page, last_page))
        needed_pages = sum(last - first for _, first, last in allocation_info)
        if needed_pages and self.page_table_writer == "triton":
            check_triton_page_table(self.page_table)  # the writer's rules, before pages are taken
        if needed_pages > self.available_pages:  # decided before anything is evicted
            raise OutOfPages(needed_pages, self.available_pages,
                             "allocation (counting every evictable cached page as free)")
        return allocation_info, new_reqs, needed_pages

    def _validate_cache_req(self, req: Req, finished) -> _Running:
        """Every rule of :meth:`cache_req`, checked before anything changes."""
        if not isinstance(finished, bool):
            raise InvalidArgument("finished", "must be a bool", f"got {finished!r}")
        rec = self._running_record(req, "cache_req")
        old_len = self._handle_len(req)
        if not req.cached_len >= old_len:
            raise InvalidArgument("req.cached_len", "must be >= its cache handle's cached_len",
                                  f"{req.cached_len} < {old_len}")
        if req.cached_len > req.device_len:
            raise InvalidArgument("req.cached_len", "cached_len <= device_len",
                                  f"got cached_len={req.cached_len}, device_len={req.device_len}")
        if req.cached_len > rec.alloc_pages * self.page_size:
            raise InvalidArgument("req.cached_len", "positions [0, cached_len) must be mapped "
                                  "(allocate_paged first)",
                                  f"cached_len={req.cached_len}, {rec.alloc_pages * self.page_size} mapped")
        if req.cached_len > req.input_len:
            raise InvalidArgument("req.input_ids", "must hold the cached_len tokens being cached",
                                  f"{req.input_len} ids < cached_len={req.cached_len}")
        if not self._holds_its_prefix(req):
            raise CacheMisuse("cache_req: the request's cache_handle is not locked by the request")
        return rec

    def _validate_complete_step(self, batch, next_tokens, done, cache_prompt):
        """Every rule of :meth:`complete_step`; returns the requests, tokens and done flags."""
        if not isinstance(batch, ForwardBatch) or batch.page_table is not self.page_table:
            raise InvalidArgument("batch", "must be a ForwardBatch from this manager's prefill or "
                                  "decode_step", f"got {type(batch).__name__}")
        if not isinstance(cache_prompt, bool):
            raise InvalidArgument("cache_prompt", "must be a bool", f"got {cache_prompt!r}")
        n = len(batch)
        for i, req in enumerate(batch.reqs):
            self._running_record(req, f"complete_step: batch.reqs[{i}]")
            if (req.cached_len, req.device_len) != (batch.start[i], batch.end[i]):
                raise CacheMisuse(f"complete_step: the request in row {req.table_idx} moved since "
                                  "the batch was made (this step was completed already?)")
            if req.input_len < batch.end[i]:
                raise InvalidArgument(f"batch.reqs[{i}].input_ids", "must hold a token for every "
                                      "position the step computed",
                                      f"{req.input_len} tokens < device_len={batch.end[i]}")
            if not self._holds_its_prefix(req):
                raise CacheMisuse(f"complete_step: the cache_handle of the request in row "
                                  f"{req.table_idx} is not locked by the request")
        done = [False] * n if done is None else self._check_seq("done", done, n)
        for i, d in enumerate(done):
            if not isinstance(d, bool):
                raise InvalidArgument(f"done[{i}]", "must be a bool", f"got {d!r}")
        tokens = None
        if next_tokens is not None:
            tokens = self._check_seq("next_tokens", next_tokens, n)
            for i, (t, req, end) in enumerate(zip(tokens, batch.reqs, batch.end)):
                if end < req.input_len:   # a chunk of a longer prompt: no token yet
                    if t is not None or done[i]:
                        raise InvalidArgument(
                            f"next_tokens[{i}]", "None, and done False, for a chunk of a prompt "
                            "(the pass stopped before the last of its input_ids)",
                            f"got token {t!r}, done {done[i]} at position {end} of {req.input_len}")
                else:
                    check_int(f"next_tokens[{i}]", t)
        return batch.reqs, tokens, done

    @staticmethod
    def _check_seq(name: str, value, n: int) -> list:
        try:
            items = None if isinstance(value, (str, bytes, dict)) else list(value)
        except TypeError:  # (not iterable, or a 0-d tensor)
            items = None
        if items is None or len(items) != n:
            raise InvalidArgument(name, f"one entry per request of the batch ({n})",
                                  f"got {value!r}"[:120])
        return items

    # --- the conservation law ---------------------------------------------------------

    def page_owners(self) -> dict[int, list[str]]:
        """page id -> where it is: ``"free"``, ``"cache node N"``, ``"row R"`` (for checks and
        drawings). A healthy manager lists every page exactly once."""
        P = self.page_size
        owners: dict[int, list[str]] = {p: [] for p in range(self.num_pages)}

        def put(page_start: int, who: str, row: int | None = None) -> None:
            if page_start % P or not 0 <= page_start < self.num_pages * P:
                raise IntegrityError(f"{who} holds slot {page_start}, which is not the start of "
                                     f"one of the {self.num_pages} pages of size {P}", row=row)
            owners[page_start // P].append(who)

        for s in self.free_slots.tolist():
            put(int(s), "free")
        for node in self.prefix_cache.nodes():
            for s in node.value[::P].tolist():
                put(int(s), f"cache node {node.uid}")
        for row_idx, rec in self._running.items():
            handle_len = self._handle_len(rec.req)
            for s in self.page_table[row_idx, handle_len: rec.alloc_pages * P: P].tolist():
                put(int(s), f"row {row_idx}", row_idx)
        return owners

    def check_integrity(self) -> None:
        """Raise :class:`~kvlab.base.errors.IntegrityError` (with ``.row`` when one row is to blame)
        unless free pages + cached pages + pages of running requests = all pages, each once,
        and every running row maps exactly its locked cached prefix and whole own pages."""
        P = self.page_size
        self.prefix_cache.check_integrity()
        for row_idx, rec in self._running.items():
            req = rec.req
            if not self._holds_its_prefix(req):
                raise IntegrityError(f"row {row_idx}: the request's cache handle is not locked by "
                                     "the request", row=row_idx)
            handle_len = self._handle_len(req)
            if handle_len:
                expect = req.cache_handle.get_matched_indices().to(torch.int64)
                got = self.page_table[row_idx, :handle_len].to(torch.int64).to(expect.device)
                bad = (got != expect).nonzero().flatten()
                if bad.numel():
                    i = int(bad[0])
                    raise IntegrityError(
                        f"row {row_idx}: position {i} maps slot {int(got[i])} but the cached prefix "
                        f"holds slot {int(expect[i])} there (a stale page-table row: "
                        f"{bad.numel()} of {handle_len} cached positions differ)", row=row_idx)
            own = self.page_table[row_idx, handle_len: rec.alloc_pages * P].to(torch.int64)
            if own.numel():
                pages = own.view(-1, P)
                if not bool((pages == pages[:, :1] + torch.arange(P, device=own.device)).all()):
                    raise IntegrityError(f"row {row_idx}: positions [{handle_len}, "
                                         f"{rec.alloc_pages * P}) do not map whole pages", row=row_idx)
        owners = self.page_owners()
        twice = {p: who for p, who in owners.items() if len(who) > 1}
        if twice:
            p, who = next(iter(twice.items()))
            rows = [int(w.split()[1]) for w in who if w.startswith("row ")]
            raise IntegrityError(f"page {p} (slots {p * P}..{p * P + P - 1}) is in "
                                 f"{len(who)} places: {', '.join(who)}"
                                 f" ({len(twice)} page(s) owned twice)",
                                 row=rows[0] if len(rows) == 1 else None)
        lost = [p for p, who in owners.items() if not who]
        if lost:
            raise IntegrityError(f"page {lost[0]} is lost: not free, not cached, not held by a "
                                 f"running request ({len(lost)} page(s) lost: {lost[:8]})")
