"""The cache manager: free pages, the page table and the prefix cache, kept in step.

Built in chapter 06 (``notebooks/06_cache_req.ipynb``) after the radix cache of chapter 05.
It follows mini-sglang's ``CacheManager`` (page-granular, host-driven) and fixes the
hazards the course points out:

* ``cache_req(req, finished=False)`` frees the *duplicate* region (pages this request
  computed while another request cached the same tokens). The source design leaves the
  request's page-table row pointing at those freed pages; kvlab rewrites that part of the
  row to the cached slots. ``CacheManager(..., remap_duplicates=False)`` keeps the
  source's behaviour so chapter 06 can show the stale row (``check_integrity`` catches it).
* Running out of pages is decided *before* anything changes: if the free pages plus every
  evictable cached page cannot cover an allocation, :class:`~kvlab.errors.OutOfPages` is
  raised and the free list, the cache and the page table are exactly as they were.
* The manager tracks the running requests, so :meth:`check_integrity` can prove the
  conservation law: free pages + cached pages + pages held by running requests = all pages,
  each page in exactly one place.

Who owns which page of a running request's row (P = page size)::

    position  0 ......... handle.cached_len ........ cached_len ..... alloc_pages*P
    row       [ cached slots (prefix cache,   | the request's own pages (allocated  ]
              [ shared, locked by handle)     | by allocate_paged, freed by it)     ]

Region accounting in ``cache_req`` (over ``[0, req.cached_len)``)::

    0        old.cached_len      cached_len       new.cached_len      req.cached_len
    | hit     | duplicate (freed) | newly inserted  | tail (freed if finished) |
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

from .errors import CacheMisuse, IntegrityError, InvalidArgument, OutOfPages
from .paging import (UNMAPPED, check_triton_page_table, div_ceil, page_to_token, write_page_table,
                     write_page_table_triton)
from .radix_cache import MatchResult, RadixCacheHandle, RadixPrefixCache, as_token_list

__all__ = ["Req", "CacheManager", "CacheRegions", "Region"]


@dataclass(eq=False)
class Req:
    """A request as the cache manager sees it (mini-sglang's meanings).

    * ``input_ids``: prompt plus generated tokens so far (kept as a list of ints).
    * ``table_idx``: its row in the page table.
    * ``cached_len``: tokens whose KV is computed and mapped in the row (valid to read).
    * ``device_len``: tokens that will be on the device after the coming step.
    * ``cache_handle``: the locked prefix-cache handle covering ``[0, handle.cached_len)``.
    """

    input_ids: list
    table_idx: int
    cached_len: int = 0
    device_len: int = -1  # -1: len(input_ids)
    cache_handle: RadixCacheHandle | None = None
    rid: int = -1
    max_new_tokens: int = 0
    finished: bool = False
    prompt_len: int = field(default=-1)

    def __post_init__(self):
        self.input_ids = as_token_list(self.input_ids, "req.input_ids")
        if self.device_len < 0:
            self.device_len = len(self.input_ids)
        if self.prompt_len < 0:
            self.prompt_len = len(self.input_ids)

    @property
    def input_len(self) -> int:
        return len(self.input_ids)

    @property
    def output_len(self) -> int:
        """Tokens generated so far."""
        return len(self.input_ids) - self.prompt_len

    def complete_one(self) -> None:
        """After a forward step: what was on the device is now cached; one more token comes."""
        self.cached_len = self.device_len
        self.device_len += 1

    def append_token(self, token: int) -> None:
        """Record a sampled token (its KV is computed by the next step)."""
        self.input_ids.append(int(token))


class Region(NamedTuple):
    """Positions ``[start, end)`` of a request's row; compares equal to ``(start, end)``."""

    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class CacheRegions:
    """What one ``cache_req`` did, region by region (for tests and for drawing)."""

    table_idx: int
    finished: bool
    old_cached_len: int  # the request's handle before: a cache hit
    already_cached_len: int  # insert_prefix's answer: cached before this insert
    new_cached_len: int  # the inserted handle: page-aligned req.cached_len
    req_cached_len: int
    page_size: int
    row_before: torch.Tensor  # the row over [0, req.cached_len) before cache_req
    row_after: torch.Tensor  # the same positions afterwards
    duplicate_slots: torch.Tensor  # token slots of the duplicate region (freed)
    tail_slots: torch.Tensor  # token slots of the tail
    freed_pages: torch.Tensor  # page starts returned to the free list
    remapped: bool  # whether the duplicate part of the row now points at cached slots

    @property
    def hit(self) -> Region:
        return Region(0, self.old_cached_len)

    @property
    def duplicate(self) -> Region:
        return Region(self.old_cached_len, self.already_cached_len)

    @property
    def inserted(self) -> Region:
        return Region(self.already_cached_len, self.new_cached_len)

    @property
    def tail(self) -> Region:
        return Region(self.new_cached_len, self.req_cached_len)

    @property
    def tail_freed(self) -> bool:
        return self.finished

    def regions(self) -> dict[str, Region]:
        """The four regions in order: hit, duplicate, inserted, tail."""
        return {"hit": self.hit, "duplicate": self.duplicate, "inserted": self.inserted,
                "tail": self.tail}

    def __str__(self) -> str:
        parts = ", ".join(f"{name} [{r.start}, {r.end})" for name, r in self.regions().items())
        tail = "freed" if self.finished else "kept"
        return f"CacheRegions(row {self.table_idx}: {parts}; tail {tail})"


@dataclass
class _Running:
    """The manager's record of a running request: which row, how far its pages reach."""

    req: Req
    alloc_pages: int  # pages [0, alloc_pages) of the row are mapped


class CacheManager:
    """Free pages + page table + prefix cache (chapter 06; mini-sglang's ``CacheManager``).

    ``free_slots`` holds the *page-start* token slot of every free page
    (``arange(num_pages) * page_size`` at first). ``page_table_writer`` picks how
    :meth:`allocate_paged` writes the page table: ``"triton"`` (one launch,
    :func:`kvlab.paging.write_page_table_triton`, the default) or ``"host"`` (host index
    tensors and one scatter, :func:`kvlab.paging.write_page_table`).
    """

    def __init__(self, num_pages: int, page_size: int, page_table: torch.Tensor,
                 prefix_cache: "str | RadixPrefixCache" = "radix", *,
                 page_table_writer: str = "triton", remap_duplicates: bool = True):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise InvalidArgument("num_pages", "must be an int >= 1", f"got {num_pages!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise InvalidArgument("page_size", "must be an int >= 1", f"got {page_size!r}")
        if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2:
            raise InvalidArgument("page_table", "must be a 2-D tensor (rows x positions)")
        if page_table.dtype not in (torch.int32, torch.int64):
            raise InvalidArgument("page_table", "must be int32 or int64", f"got {page_table.dtype}")
        if page_table_writer not in ("triton", "host"):
            raise InvalidArgument("page_table_writer", 'must be "triton" or "host"',
                                  f"got {page_table_writer!r}")
        self.device = page_table.device
        self.num_pages = num_pages
        self.page_size = page_size
        self.page_table = page_table
        self.page_table_writer = page_table_writer
        self.remap_duplicates = remap_duplicates
        if isinstance(prefix_cache, RadixPrefixCache):
            if prefix_cache.page_size != page_size:
                raise InvalidArgument("prefix_cache", "must use the manager's page_size",
                                      f"{prefix_cache.page_size} != {page_size}")
            self.prefix_cache = prefix_cache
        elif prefix_cache == "radix":
            self.prefix_cache = RadixPrefixCache(page_size, device=self.device)
        else:
            raise InvalidArgument("prefix_cache", 'must be "radix" or a RadixPrefixCache',
                                  f"got {prefix_cache!r}")
        # |p0*P|p1*P|p2*P|...: one entry per free page, taken from the front
        self.free_slots = torch.arange(num_pages, dtype=torch.int32, device=self.device) * page_size
        self._running: dict[int, _Running] = {}  # table_idx -> record

    # --- sizes ------------------------------------------------------------------------

    @property
    def available_size(self) -> int:
        """Tokens that could be allocated now: free pages plus evictable cached pages."""
        return len(self.free_slots) * self.page_size + self.prefix_cache.size_info.evictable_size

    @property
    def num_free_pages(self) -> int:
        return len(self.free_slots)

    @property
    def running(self) -> list[Req]:
        """The requests the manager holds pages for, by row."""
        return [self._running[k].req for k in sorted(self._running)]

    def allocated_pages(self, req: Req) -> int:
        """How many pages of ``req``'s row are mapped (0 if it is not running)."""
        rec = self._running.get(req.table_idx)
        return rec.alloc_pages if rec is not None and rec.req is req else 0

    # --- the prefix cache -------------------------------------------------------------

    def match_req(self, req: Req) -> MatchResult:
        """Match ``input_ids[:input_len - 1]``: at least one token is always computed, so the
        prefill has a position to produce the next token's logits from."""
        if req.input_len < 1:
            raise InvalidArgument("req.input_ids", "must hold at least one token")
        return self.prefix_cache.match_prefix(req.input_ids[: req.input_len - 1])

    def lock(self, handle: RadixCacheHandle) -> None:
        self.prefix_cache.lock_handle(handle, unlock=False)

    def unlock(self, handle: RadixCacheHandle) -> None:
        self.prefix_cache.lock_handle(handle, unlock=True)

    def admit(self, req: Req) -> MatchResult:
        """Start a request: match its prompt, lock the hit, map the hit into its row.

        Sets ``req.cache_handle`` and ``req.cached_len``; ``device_len`` stays the prompt
        length. The scheduler's part of mini-sglang's prefill, in one call.
        """
        self._check_row(req, "req")
        if req.table_idx in self._running:
            raise InvalidArgument("req.table_idx", "row is already used by a running request",
                                  f"row {req.table_idx}")
        cols = self.page_table.shape[1]
        if req.input_len > cols:
            raise InvalidArgument("req.input_ids", f"the prompt must fit the page table ({cols} positions)",
                                  f"got {req.input_len} tokens")
        match = self.match_req(req)
        handle = match.handle
        self.lock(handle)
        req.finished = False
        req.cache_handle = handle
        req.cached_len = handle.cached_len
        req.device_len = max(req.device_len, req.cached_len)
        if handle.cached_len:
            self.page_table[req.table_idx, : handle.cached_len] = handle.get_matched_indices().to(
                self.page_table.dtype)
        self._running[req.table_idx] = _Running(req, handle.cached_len // self.page_size)
        return match

    # --- allocation -------------------------------------------------------------------

    def _check_row(self, req, name: str) -> None:
        if not isinstance(req, Req):
            raise InvalidArgument(name, "must be a kvlab.Req", f"got {type(req).__name__}")
        rows = self.page_table.shape[0]
        if not isinstance(req.table_idx, int) or not 0 <= req.table_idx < rows:
            raise InvalidArgument(f"{name}.table_idx", f"must be in [0, {rows}) (page_table rows)",
                                  f"got {req.table_idx!r}")

    def _handle_len(self, req: Req) -> int:
        return req.cache_handle.cached_len if req.cache_handle is not None else 0

    def _handle_locked(self, handle: RadixCacheHandle | None) -> bool:
        if handle is None or handle.cached_len == 0:
            return True  # the root: nothing to lock
        return not handle.node.detached and all(
            n.ref_count > 0 for n in handle.node.path_to_root())

    def allocate_paged(self, reqs: Sequence[Req]) -> None:
        """Map pages ``[div_ceil(cached_len, P), div_ceil(device_len, P))`` of every request.

        One ``_allocate`` for the whole batch, then one page-table write. Evicts from the
        prefix cache when free pages run short. Raises before changing anything on bad
        input or when even evicting every unlocked cached page would not be enough.
        """
        P = self.page_size
        cols = self.page_table.shape[1]
        allocation_info: list[tuple[int, int, int]] = []
        new_records: dict[int, Req] = {}
        needed_pages = 0
        seen_rows: set[int] = set()
        for i, req in enumerate(reqs):
            name = f"reqs[{i}]"
            self._check_row(req, name)
            if req.table_idx in seen_rows:
                raise InvalidArgument(f"{name}.table_idx", "each request of a batch has its own row",
                                      f"row {req.table_idx} appears twice")
            seen_rows.add(req.table_idx)
            if not 0 <= req.cached_len <= req.device_len:
                raise InvalidArgument(f"{name}.cached_len", "0 <= cached_len <= device_len",
                                      f"got cached_len={req.cached_len}, device_len={req.device_len}")
            first_page = div_ceil(req.cached_len, P)
            last_page = div_ceil(req.device_len, P)
            if last_page * P > cols:
                raise InvalidArgument(f"{name}.device_len",
                                      f"must fit the page table: div_ceil(device_len, P) * P <= {cols}",
                                      f"got device_len={req.device_len}")
            rec = self._running.get(req.table_idx)
            if rec is not None and rec.req is not req:
                raise InvalidArgument(f"{name}.table_idx", "row is already used by another running request",
                                      f"row {req.table_idx}")
            if rec is None:
                if not self._handle_locked(req.cache_handle):
                    raise InvalidArgument(f"{name}.cache_handle",
                                          "must be locked (CacheManager.lock) before its request allocates")
                if req.cached_len != self._handle_len(req):
                    raise InvalidArgument(
                        f"{name}.cached_len", "a new request starts at its matched prefix: "
                        "cached_len == cache_handle.cached_len (use CacheManager.admit)",
                        f"got cached_len={req.cached_len}, handle covers {self._handle_len(req)}")
                new_records[req.table_idx] = req
                mapped = first_page
            else:
                mapped = rec.alloc_pages
            if last_page <= first_page:
                continue
            if first_page != mapped:
                raise InvalidArgument(
                    f"{name}.cached_len", "new pages must start where the row's pages end: "
                    "div_ceil(cached_len, P) == pages already mapped",
                    f"div_ceil({req.cached_len}, {P}) = {first_page}, but {mapped} pages are mapped")
            needed_pages += last_page - first_page
            allocation_info.append((req.table_idx, first_page, last_page))

        if needed_pages > 0:
            if self.page_table_writer == "triton":
                check_triton_page_table(self.page_table)  # the writer's rules, before pages are taken
            # the page starts come from our own free list: skip the value check (a device sync)
            allocated = page_to_token(self._allocate(needed_pages), P, check_values=False)
            writer = write_page_table_triton if self.page_table_writer == "triton" else write_page_table
            writer(self.page_table, allocated, allocation_info, P)
        for row, req in new_records.items():
            self._running[row] = _Running(req, div_ceil(req.cached_len, P))
        for row, _first, last in allocation_info:
            self._running[row].alloc_pages = last

    def _allocate(self, needed_pages: int) -> torch.Tensor:
        """Take ``needed_pages`` page starts from the front of the free list, evicting first
        if needed. Decides up front, so a failure changes nothing."""
        free_pages = len(self.free_slots)
        if needed_pages > free_pages:
            evictable_pages = self.prefix_cache.size_info.evictable_size // self.page_size
            if needed_pages > free_pages + evictable_pages:
                raise OutOfPages(needed_pages, free_pages + evictable_pages,
                                 "allocation (counting every evictable cached page as free)")
            evicted = self.prefix_cache.evict((needed_pages - free_pages) * self.page_size)
            # evict returns token slots, the free list holds page starts: one per P slots
            self.free_slots = torch.cat([self.free_slots, evicted[:: self.page_size].to(torch.int32)])
        allocated = self.free_slots[:needed_pages]
        self.free_slots = self.free_slots[needed_pages:]
        return allocated

    def _free(self, slots: torch.Tensor) -> torch.Tensor:
        """Return the pages of ``slots`` (page-aligned runs of token slots) to the free list."""
        pages = slots[:: self.page_size].to(device=self.device, dtype=torch.int32)
        if pages.numel():
            self.free_slots = torch.cat([self.free_slots, pages])
        return pages

    # --- caching a request ------------------------------------------------------------

    def _running_record(self, req: Req, what: str) -> _Running:
        self._check_row(req, "req")
        rec = self._running.get(req.table_idx)
        if rec is None or rec.req is not req:
            raise CacheMisuse(f"{what}: this request (row {req.table_idx}) is not running: it was "
                              "never allocated, or it already finished or was aborted. Each "
                              "request is cached with finished=True (or aborted) exactly once.")
        return rec

    def cache_req(self, req: Req, *, finished: bool) -> CacheRegions:
        """Insert the request's computed whole pages into the prefix cache and settle the
        four regions of ``[0, req.cached_len)`` (see the module docstring).

        ``finished=True``: the tail (and any page mapped past ``cached_len``) is freed and
        the request stops running. ``finished=False``: the tail stays, the new handle is
        locked, and the duplicate part of the row is rewritten to the cached slots
        (unless ``remap_duplicates=False``, the source design's behaviour).
        """
        rec = self._running_record(req, "cache_req")
        P = self.page_size
        old_handle = req.cache_handle
        old_len = self._handle_len(req)
        if not req.cached_len >= old_len:
            raise InvalidArgument("req.cached_len", "must be >= its cache handle's cached_len",
                                  f"{req.cached_len} < {old_len}")
        if req.cached_len > req.device_len:
            raise InvalidArgument("req.cached_len", "cached_len <= device_len",
                                  f"got cached_len={req.cached_len}, device_len={req.device_len}")
        if req.cached_len > rec.alloc_pages * P:
            raise InvalidArgument("req.cached_len", "positions [0, cached_len) must be mapped "
                                  "(allocate_paged first)",
                                  f"cached_len={req.cached_len}, {rec.alloc_pages * P} mapped")
        if req.cached_len > req.input_len:
            raise InvalidArgument("req.input_ids", "must hold the cached_len tokens being cached",
                                  f"{req.input_len} ids < cached_len={req.cached_len}")
        if not self._handle_locked(old_handle):
            raise CacheMisuse("cache_req: the request's cache_handle is not locked")

        row = self.page_table[req.table_idx]
        page_indices = row[: req.cached_len].clone()
        already_len, new_handle = self.prefix_cache.insert_prefix(
            req.input_ids[: req.cached_len], page_indices)
        new_len = new_handle.cached_len
        if old_handle is not None and old_len > 0:
            self.unlock(old_handle)  # only after every use of the old handle
        # [old_len, already_len): computed here, but cached meanwhile by another request
        duplicate = page_indices[old_len:already_len]
        freed = [self._free(duplicate)]
        remapped = False
        if finished:
            # tail [new_len, cached_len) and any page mapped past it: every page from new_len on
            freed.append(self._free(row[new_len: rec.alloc_pages * P].clone()))
            row[: rec.alloc_pages * P] = UNMAPPED  # the row no longer maps anything
            del self._running[req.table_idx]
            req.finished = True
        else:
            if self.remap_duplicates and already_len > old_len:
                cached = new_handle.get_matched_indices()[old_len:already_len]
                row[old_len:already_len] = cached.to(row.dtype)  # never point at a freed page
                remapped = True
            self.lock(new_handle)
            req.cache_handle = new_handle
        return CacheRegions(
            table_idx=req.table_idx, finished=finished, old_cached_len=old_len,
            already_cached_len=already_len, new_cached_len=new_len,
            req_cached_len=req.cached_len, page_size=P, row_before=page_indices,
            row_after=row[: req.cached_len].clone(), duplicate_slots=duplicate,
            tail_slots=page_indices[new_len:], freed_pages=torch.cat(freed), remapped=remapped)

    def release_req(self, req: Req) -> torch.Tensor:
        """Abort a running request: free its own pages, unlock its handle, cache nothing.

        Returns the freed page starts. Its row is cleared to ``UNMAPPED``.
        """
        rec = self._running_record(req, "release_req")
        P = self.page_size
        handle_len = self._handle_len(req)
        row = self.page_table[req.table_idx]
        freed = self._free(row[handle_len: rec.alloc_pages * P].clone())
        if req.cache_handle is not None and handle_len > 0:
            self.unlock(req.cache_handle)
        row[: rec.alloc_pages * P] = UNMAPPED
        del self._running[req.table_idx]
        req.finished = True
        return freed

    abort = release_req

    # --- the conservation law ---------------------------------------------------------

    def page_owners(self) -> dict[int, list[str]]:
        """page id -> where it is: ``"free"``, ``"cache node N"``, ``"row R"`` (for checks and
        drawings). A healthy manager lists every page exactly once."""
        P = self.page_size
        owners: dict[int, list[str]] = {p: [] for p in range(self.num_pages)}

        def put(page_start: int, who: str) -> None:
            if page_start % P or not 0 <= page_start < self.num_pages * P:
                raise IntegrityError(f"{who} holds slot {page_start}, which is not the start of "
                                     f"one of the {self.num_pages} pages of size {P}")
            owners[page_start // P].append(who)

        for s in self.free_slots.tolist():
            put(int(s), "free")
        for node in self.prefix_cache.nodes():
            for s in node.value[::P].tolist():
                put(int(s), f"cache node {node.uid}")
        for row_idx, rec in self._running.items():
            handle_len = self._handle_len(rec.req)
            for s in self.page_table[row_idx, handle_len: rec.alloc_pages * P: P].tolist():
                put(int(s), f"row {row_idx}")
        return owners

    def check_integrity(self) -> None:
        """Raise :class:`~kvlab.errors.IntegrityError` naming what is wrong, unless
        free pages + cached pages + pages of running requests = all pages, each once, and
        every running row maps exactly its cached prefix and whole own pages."""
        P = self.page_size
        self.prefix_cache.check_integrity()
        for row_idx, rec in self._running.items():
            req = rec.req
            if not self._handle_locked(req.cache_handle):
                raise IntegrityError(f"row {row_idx}: the request's cache handle is not locked")
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
                        f"{bad.numel()} of {handle_len} cached positions differ)")
            own = self.page_table[row_idx, handle_len: rec.alloc_pages * P].to(torch.int64)
            if own.numel():
                pages = own.view(-1, P)
                if not bool((pages == pages[:, :1] + torch.arange(P, device=own.device)).all()):
                    raise IntegrityError(f"row {row_idx}: positions [{handle_len}, "
                                         f"{rec.alloc_pages * P}) do not map whole pages")
        owners = self.page_owners()
        lost = [p for p, who in owners.items() if not who]
        twice = {p: who for p, who in owners.items() if len(who) > 1}
        if twice:
            p, who = next(iter(twice.items()))
            raise IntegrityError(f"page {p} (slots {p * P}..{p * P + P - 1}) is in "
                                 f"{len(who)} places: {', '.join(who)}"
                                 f" ({len(twice)} page(s) owned twice)")
        if lost:
            raise IntegrityError(f"page {lost[0]} is lost: not free, not cached, not held by a "
                                 f"running request ({len(lost)} page(s) lost: {lost[:8]})")
