"""The cache manager: free pages, the page table and the prefix cache, kept in step.

Built in chapter 06 (``notebooks/06_cache_req.ipynb``) after the radix cache of chapter 05.
It follows mini-sglang's ``CacheManager`` (page-granular, host-driven) and fixes the
hazards the course points out:

* ``cache_req(req, finished=False)`` frees the *duplicate* region (pages this request
  computed while another request cached the same tokens). The source design leaves the
  request's page-table row pointing at those freed pages; kvlab rewrites that part of the
  row to the cached slots. ``CacheManager(..., remap_duplicates=False)`` keeps the
  source's behaviour so chapter 06 can show the stale row (``check_integrity`` catches it).
* Running out of pages is decided *before* anything changes, and ``allocate_paged`` is all
  or nothing: if the page-table write fails after pages were taken (or cached pages
  evicted), the free list, the cache and the table are put back and the error propagates.
* Locks have owners: the manager locks a request's prefix with the request as owner, so an
  unlock by anyone else raises :class:`~kvlab.base.errors.CacheMisuse` and changes nothing.
* The manager tracks the running requests, so :meth:`check_integrity` can prove the
  conservation law: free pages + cached pages + pages held by running requests = all pages,
  each page in exactly one place.

It also speaks the serving loop's words once, for the simulator, the tiny engine, the scenes
and any model: ``pages_needed`` / ``available_pages`` (the page budget), and one step pair
with the model's forward pass in the middle::

    batch = manager.prefill(reqs)          # admit + map pages for [cached_len, device_len)
    ...forward pass: write KV at batch.out_loc(), sample one token per request...
    manager.complete_step(batch, tokens, done)   # record tokens; cache_req as the phase wants
    batch = manager.decode_step(reqs)      # map a page where a request crosses a boundary
    ...forward pass...
    manager.complete_step(batch, tokens, done)

Who owns which page of a running request's row (P = page size)::

    position  0 ......... handle.cached_len ........ cached_len ..... alloc_pages*P
    row       [ cached slots (prefix cache,   | the request's own pages (allocated  ]
              [ shared, locked by the request)| by allocate_paged, freed by it)     ]
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..base.args import check_int, check_page_size, div_ceil
from .rules import _Running
from .undo import CacheManagerUndo
from .cache_regions import CacheRegions, Region
from ..base.errors import CacheMisuse, InvalidArgument, OutOfPages
from ..alloc.paging import UNMAPPED, page_to_token, write_page_table, write_page_table_triton
from ..prefix.hash_cache import MAX_SLOTS, HashPrefixCache
from ..prefix.radix_cache import MatchResult, RadixCacheHandle, RadixPrefixCache
from .req import ForwardBatch, Req

__all__ = ["Req", "ForwardBatch", "CacheManager", "CacheRegions", "Region"]


class CacheManager(CacheManagerUndo):
    """Free pages + page table + prefix cache (chapter 06; mini-sglang's ``CacheManager``).

    ``free_slots`` holds the *page-start* token slot of every free page
    (``arange(num_pages) * page_size`` at first). ``page_table_writer`` picks how
    :meth:`allocate_paged` writes the page table: ``"triton"`` (one launch,
    :func:`kvlab.alloc.paging.write_page_table_triton`, the default) or ``"host"`` (host index
    tensors and one scatter, :func:`kvlab.alloc.paging.write_page_table`).

    ``prefix_cache``: ``"radix"`` (chapter 05's tree, the default), ``"hash"`` (chapter 11's
    hash-chained cache, :class:`~kvlab.prefix.hash_cache.HashPrefixCache`), or such a cache. A cache
    that keeps the free pages itself (``keeps_free_pages``: the hash cache, whose free queue is
    its eviction order) leaves ``free_slots`` empty: pages come from it and go back to it.
    """

    def __init__(self, num_pages: int, page_size: int, page_table: torch.Tensor,
                 prefix_cache: "str | RadixPrefixCache | HashPrefixCache" = "radix", *,
                 page_table_writer: str = "triton", remap_duplicates: bool = True):
        self.num_pages = check_int("num_pages", num_pages, minimum=1)
        self.page_size = check_page_size(page_size)
        if self.num_pages * self.page_size > MAX_SLOTS:
            raise InvalidArgument("num_pages", "num_pages * page_size slots fit in int32 (at most 2**31)",
                                  f"got {self.num_pages} * {self.page_size}")
        if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2:
            raise InvalidArgument("page_table", "must be a 2-D tensor (rows x positions)")
        if page_table.dtype not in (torch.int32, torch.int64):
            raise InvalidArgument("page_table", "must be int32 or int64", f"got {page_table.dtype}")
        if page_table_writer not in ("triton", "host"):
            raise InvalidArgument("page_table_writer", 'must be "triton" or "host"',
                                  f"got {page_table_writer!r}")
        if not isinstance(remap_duplicates, bool):
            raise InvalidArgument("remap_duplicates", "must be a bool", f"got {remap_duplicates!r}")
        if isinstance(prefix_cache, (RadixPrefixCache, HashPrefixCache)):
            if prefix_cache.page_size != self.page_size:
                raise InvalidArgument("prefix_cache", "must use the manager's page_size",
                                      f"{prefix_cache.page_size} != {self.page_size}")
            if getattr(prefix_cache, "num_pages", self.num_pages) != self.num_pages:
                raise InvalidArgument("prefix_cache", "must hold the manager's num_pages",
                                      f"{prefix_cache.num_pages} != {self.num_pages}")
        elif prefix_cache == "radix":
            prefix_cache = RadixPrefixCache(self.page_size, device=page_table.device)
        elif prefix_cache == "hash":
            prefix_cache = HashPrefixCache(self.num_pages, self.page_size, device=page_table.device)
        else:
            raise InvalidArgument("prefix_cache", 'must be "radix", "hash" or a prefix cache',
                                  f"got {prefix_cache!r}")
        self.device = page_table.device
        self.page_table = page_table
        self.page_table_writer = page_table_writer
        self.remap_duplicates = remap_duplicates
        self.prefix_cache = prefix_cache
        # |p0*P|p1*P|p2*P|...: one entry per free page, taken from the front (empty when the
        # cache keeps the free pages: then every page starts in its free queue)
        self.free_slots = torch.arange(num_pages, dtype=torch.int32, device=self.device) * page_size
        if self._cache_keeps_free_pages:
            self.free_slots = self.free_slots[:0]
        self._running: dict[int, _Running] = {}  # table_idx -> record
        self._last_allocation = None  # what the latest allocate_paged needs to be taken back

    # --- sizes: the page budget -------------------------------------------------------

    @property
    def _cache_keeps_free_pages(self) -> bool:
        return getattr(self.prefix_cache, "keeps_free_pages", False)

    @property
    def num_free_pages(self) -> int:
        """Free pages that hold no cached prefix (in the free list, or the cache's free queue)."""
        if self._cache_keeps_free_pages:
            return len(self.free_slots) + self.prefix_cache.num_free_uncached
        return len(self.free_slots)

    @property
    def available_pages(self) -> int:
        """Pages an allocation could get now: free pages plus evictable cached pages."""
        return self.num_free_pages + self.prefix_cache.size_info.evictable_size // self.page_size

    @property
    def available_size(self) -> int:
        """:attr:`available_pages` in tokens (mini-sglang's name)."""
        return self.available_pages * self.page_size

    def pages_needed(self, reqs: Sequence[Req], *, extra_tokens: int = 0) -> int:
        """Pages :meth:`allocate_paged` would take for ``reqs`` now: per request
        ``div_ceil(device_len + extra_tokens, P) - div_ceil(cached_len, P)`` (``extra_tokens``:
        room for that many more tokens each, e.g. the rest of a generation)."""
        extra = check_int("extra_tokens", extra_tokens, minimum=0)
        P = self.page_size
        for i, req in enumerate(self._check_reqs(reqs)):
            self._check_req(req, f"reqs[{i}]")
        return sum(max(0, div_ceil(r.device_len + extra, P) - div_ceil(r.cached_len, P)) for r in reqs)

    @property
    def running(self) -> list[Req]:
        """The requests the manager holds pages for, by row."""
        return [self._running[k].req for k in sorted(self._running)]

    def allocated_pages(self, req: Req) -> int:
        """How many pages of ``req``'s row are mapped (0 if it is not running)."""
        rec = self._running.get(getattr(req, "table_idx", None))
        return rec.alloc_pages if rec is not None and rec.req is req else 0

    # --- the prefix cache -------------------------------------------------------------

    def match_req(self, req: Req) -> MatchResult:
        """Match ``input_ids[:input_len - 1]``: at least one token is always computed, so the
        prefill has a position to produce the next token's logits from."""
        if not isinstance(req, Req):
            raise InvalidArgument("req", "must be a kvlab.Req", f"got {type(req).__name__}")
        if req.input_len < 1:
            raise InvalidArgument("req.input_ids", "must hold at least one token")
        return self.prefix_cache.match_prefix(req.input_ids[: req.input_len - 1])

    def lock(self, handle: RadixCacheHandle, owner=None) -> None:
        """Lock ``handle`` for ``owner`` (the manager's own calls pass the request)."""
        self.prefix_cache.lock_handle(handle, unlock=False, owner=owner)

    def unlock(self, handle: RadixCacheHandle, owner=None) -> None:
        """Take back a lock ``owner`` holds on ``handle``; anyone else: :class:`CacheMisuse`."""
        self.prefix_cache.lock_handle(handle, unlock=True, owner=owner)

    def admit(self, req: Req) -> MatchResult:
        """Start a request: match its prompt, lock the hit (owner: ``req``), map it into its row.

        Sets ``req.cache_handle`` and ``req.cached_len``; ``device_len`` stays the prompt
        length. The scheduler's part of mini-sglang's prefill, in one call.
        """
        self._check_req(req, "req")
        if req.table_idx in self._running:
            raise InvalidArgument("req.table_idx", "row is already used by a running request",
                                  f"row {req.table_idx}")
        cols = self.page_table.shape[1]
        if req.input_len > cols:
            raise InvalidArgument("req.input_ids", f"the prompt must fit the page table ({cols} positions)",
                                  f"got {req.input_len} tokens")
        match = self.match_req(req)
        handle = match.handle
        fields, held = self._fields(req), self.prefix_cache.locks_held(handle, req)
        try:  # all or nothing: a lock taken just before an interrupt is taken back too
            self.lock(handle, owner=req)
            req.finished = False
            req.cache_handle = handle
            req.cached_len = handle.cached_len
            req.device_len = max(req.device_len, req.cached_len)
            if handle.cached_len:
                self.page_table[req.table_idx, : handle.cached_len] = handle.get_matched_indices().to(
                    self.page_table.dtype)
            self._running[req.table_idx] = _Running(req, handle.cached_len // self.page_size)
            return match
        except BaseException:
            self._undo_admit(req, handle, held)
            self._put_fields(req, fields)
            raise

    # --- the serving steps: prefill / decode_step / mixed_step, then complete_step -----

    def prefill(self, reqs: Sequence[Req], *, reserve_tokens: int = 0) -> ForwardBatch:
        """Admit every request not running yet, then map pages for ``[cached_len, device_len)``
        of all of them in one :meth:`allocate_paged`; return the batch the forward pass computes.

        ``reserve_tokens``: also make sure that many more tokens per request will fit (e.g. the
        rest of a generation), counting evictable cached pages. All or nothing: if the batch
        does not fit (:class:`OutOfPages`) or anything else fails, the requests this call
        admitted are released again and the error propagates.
        """
        reserve = check_int("reserve_tokens", reserve_tokens, minimum=0)
        return self.mixed_step(reqs, (), reserve_tokens=reserve)

    def decode_step(self, reqs: Sequence[Req]) -> ForwardBatch:
        """Map the next position of every running request (a new page only where it crosses a
        page boundary) in one :meth:`allocate_paged`; return the batch to compute."""
        return self.mixed_step((), reqs)

    def mixed_step(self, prefill: Sequence[Req], decode: Sequence[Req], *,
                   reserve_tokens: int = 0) -> ForwardBatch:
        """One continuous-batching step: the prompts of ``prefill`` (admitted here unless they
        run already) and the next position of every running ``decode`` request, mapped in one
        :meth:`allocate_paged`; return the one batch the forward pass computes (prefill
        requests first). All or nothing, as :meth:`prefill`."""
        prefill, decode = self._check_reqs(prefill), self._check_reqs(decode)
        reserve = check_int("reserve_tokens", reserve_tokens, minimum=0)
        for i, req in enumerate(prefill):
            self._check_req(req, f"prefill[{i}]")
        for i, req in enumerate(decode):
            self._running_record(req, f"decode_step: reqs[{i}]")
        fields = [self._fields(r) for r in prefill]
        new = [r for r in prefill if not self._is_running(r)]
        self._last_allocation = None  # (allocate_paged keeps its record there: taken back below too)
        try:
            for req in new:
                self.admit(req)  # match + lock the hit + map it into the row
            if reserve:
                needed, available = self.pages_needed(prefill, extra_tokens=reserve), self.available_pages
                if needed > available:
                    raise OutOfPages(needed, available, f"prefill (with room for {reserve} more "
                                     "token(s) per request, after prefix hits)")
            batch = ForwardBatch.of(prefill, decode, self.page_table)  # (mapping moves no length)
            self.allocate_paged(list(prefill) + list(decode))
            return batch
        except BaseException:
            self._undo_step(self._last_allocation, new, list(zip(prefill, fields)))
            raise

    def complete_step(self, batch: ForwardBatch, next_tokens: Sequence[int] | None,
                      done: Sequence[bool] | None = None, *,
                      cache_prompt: bool = True) -> list[tuple[Req, CacheRegions]]:
        """After the forward pass of ``batch``: record each request's produced token
        (``append_token``; ``next_tokens=None`` records none) and ``complete_one``; then
        ``cache_req(finished=True)`` the ``done`` ones and, for the requests whose prompt this
        pass computed (``cache_prompt``), ``cache_req(finished=False)`` the others, so their
        prompt's whole pages can be shared at once. Returns ``(req, regions)`` of each
        ``cache_req``. Checks everything first: a refused call changes nothing.

        Chunked prefill: a request whose pass stopped before the end of its ``input_ids`` (a
        chunk of a longer prompt) produces no token: its entry of ``next_tokens`` is ``None``,
        and it is not cached until its last chunk -- mini-sglang's scheduler skips a
        ``ChunkedReq`` the same way (``scheduler/scheduler.py``, ``_process_last_data``).

        All or nothing: if any step fails or is interrupted (the second ``cache_req``, say),
        every step before it is taken back too -- the ``cache_req`` calls that ran, every
        recorded token, every length -- so the batch is exactly as before the call and the same
        call can simply be made again.
        """
        reqs, tokens, done = self._validate_complete_step(batch, next_tokens, done, cache_prompt)
        chunk = [end < req.input_len for req, end in zip(reqs, batch.end)]
        fields = [self._fields(req) for req in reqs]
        settled, undos = [], []
        try:
            for i, req in enumerate(reqs):
                if tokens is not None and not chunk[i]:
                    req.append_token(tokens[i])
                req.complete_one()  # cached_len = device_len; device_len += 1
            for req, prefilled, finished, chunked in zip(reqs, batch.prefilling, done, chunk):
                if finished or (prefilled and cache_prompt and not chunked):
                    rec = self._validate_cache_req(req, finished)
                    undos.append((req, self._settling(req, rec, inserting=True)))
                    settled.append((req, self._cache_req(req, finished, undos[-1][1])))
            return settled
        except BaseException:
            for req, undo in reversed(undos):  # (one that failed took itself back: a no-op then)
                self._undo_settling(req, undo)
            self._undo_step(None, (), list(zip(reqs, fields)))
            raise

    # --- allocation -------------------------------------------------------------------

    def allocate_paged(self, reqs: Sequence[Req]) -> None:
        """Map pages ``[div_ceil(cached_len, P), div_ceil(device_len, P))`` of every request.

        One ``_allocate`` for the whole batch, then one page-table write. Evicts from the
        prefix cache when free pages run short. Raises before changing anything on bad
        input or when even evicting every unlocked cached page would not be enough; and if
        anything fails after the first change, every change is rolled back (free list,
        evictions, page table; no request field is touched here) and the error propagates.
        """
        plan = self._validate_allocation(reqs)
        self._last_allocation = undo = self._allocation(*plan)  # (before any change; see mixed_step)
        try:
            self._map_pages(*plan, undo)
        except BaseException:
            self._undo_allocation(undo)
            raise

    def _map_pages(self, allocation_info, new_reqs, needed_pages: int, undo) -> None:
        """Take the pages (evicting if short), write the table, record how far each row is
        mapped; ``undo`` (:meth:`_allocation`) gets what eviction takes as it takes it."""
        P = self.page_size
        if needed_pages > 0:
            allocated = self._allocate(needed_pages, undo.evicted)
            # our own page starts: skip page_to_token's value check (a device sync)
            self._write_page_table(page_to_token(allocated, P, check_values=False), allocation_info)
        for req in new_reqs:
            self._running[req.table_idx] = _Running(req, div_ceil(req.cached_len, P))
        for row, _first, last in allocation_info:
            self._running[row].alloc_pages = last

    def _allocate(self, needed_pages: int, evicted: list) -> torch.Tensor:
        """Take ``needed_pages`` page starts from the front of the free list, evicting first
        if needed (what eviction takes goes into ``evicted``, for a rollback: the radix cache's
        nodes, the hash cache's pages, each with its slots in ``value``)."""
        if needed_pages > (free_pages := len(self.free_slots)):
            # each node (page) goes into `evicted` as it is evicted: an interrupt part-way loses none
            self.prefix_cache.evict_leaves((needed_pages - free_pages) * self.page_size, into=evicted)
            # evicted nodes hold token slots, the free list holds page starts: one per P slots
            freed = [n.value[:: self.page_size].to(torch.int32) for n in evicted]
            self.free_slots = torch.cat([self.free_slots, *freed])
        allocated = self.free_slots[:needed_pages]
        self.free_slots = self.free_slots[needed_pages:]
        return allocated

    def _write_page_table(self, allocated: torch.Tensor, allocation_info) -> None:
        writer = write_page_table_triton if self.page_table_writer == "triton" else write_page_table
        writer(self.page_table, allocated, allocation_info, self.page_size)

    def _free(self, slots: torch.Tensor) -> torch.Tensor:
        """Return the pages of ``slots`` (page-aligned runs of token slots) to the free list."""
        pages = slots[:: self.page_size].to(device=self.device, dtype=torch.int32)
        if pages.numel() and self._cache_keeps_free_pages:
            self.prefix_cache.free((pages // self.page_size).tolist())  # back to its free queue
        elif pages.numel():
            self.free_slots = torch.cat([self.free_slots, pages])
        return pages

    # --- caching a request ------------------------------------------------------------

    def cache_req(self, req: Req, *, finished: bool) -> CacheRegions:
        """Insert the request's computed whole pages into the prefix cache and settle the
        four regions of ``[0, req.cached_len)`` (see :mod:`kvlab.manager.cache_regions`).

        ``finished=True``: the tail (and any page mapped past ``cached_len``) is freed and
        the request stops running. ``finished=False``: the tail stays, the new handle is
        locked (owner: ``req``), and the duplicate part of the row is rewritten to the cached
        slots (unless ``remap_duplicates=False``, the source design's behaviour). All or
        nothing: if a step fails (or is interrupted), every step before it is undone.
        """
        rec = self._validate_cache_req(req, finished)
        return self._cache_req(req, finished, self._settling(req, rec, inserting=True))

    def _cache_req(self, req: Req, finished: bool, undo) -> CacheRegions:
        P = self.page_size
        row, rec = self.page_table[req.table_idx], undo.rec
        old_handle, old_len, row_before = undo.old_handle, self._handle_len(req), undo.row_before
        page_indices = row_before[: req.cached_len]
        try:
            # ============ [0, req.cached_len): hit | duplicate | newly inserted | tail ============
            already_len, new_handle = self.prefix_cache.insert_prefix(   # our own whole pages
                req.input_ids[: req.cached_len], page_indices, check_pages=False)
            undo.new_handle, new_len = new_handle, new_handle.cached_len
            # duplicate [old_len, already_len): computed here, but cached meanwhile by another request
            duplicate = page_indices[old_len:already_len]
            freed = [self._free(duplicate)]
            remapped = False
            if finished:
                # tail [new_len, cached_len) and any page mapped past it: every page from new_len on
                freed.append(self._free(row_before[new_len:]))
            elif self.remap_duplicates and already_len > old_len:
                cached = new_handle.get_matched_indices()[old_len:already_len]
                row[old_len:already_len] = cached.to(row.dtype)  # never point at a freed page
                remapped = True
            # the locks last, the new one first: the old handle is used up to here
            if not finished:
                self.lock(new_handle, owner=req)
            if old_handle is not None:
                self.unlock(old_handle, owner=req)
            if finished:
                row[: rec.alloc_pages * P] = UNMAPPED  # the row no longer maps anything
                del self._running[req.table_idx]
                req.finished = True
            else:
                req.cache_handle = new_handle
            return CacheRegions(
                table_idx=req.table_idx, finished=finished, old_cached_len=old_len,
                already_cached_len=already_len, new_cached_len=new_len,
                req_cached_len=req.cached_len, page_size=P, row_before=page_indices,
                row_after=row[: req.cached_len].clone(), duplicate_slots=duplicate,
                tail_slots=page_indices[new_len:], freed_pages=torch.cat(freed), remapped=remapped)
        except BaseException:
            self._undo_settling(req, undo)
            raise

    def release_req(self, req: Req) -> torch.Tensor:
        """Abort a running request: free its own pages, unlock its handle, cache nothing.

        Returns the freed page starts. Its row is cleared to ``UNMAPPED``.
        """
        rec = self._running_record(req, "release_req")
        if not self._holds_its_prefix(req):
            raise CacheMisuse("release_req: the request's cache_handle is not locked by the request")
        row = self.page_table[req.table_idx]
        handle, mapped = req.cache_handle, rec.alloc_pages * self.page_size
        undo = self._settling(req, rec, inserting=False)
        try:  # all or nothing, as cache_req
            freed = self._free(undo.row_before[self._handle_len(req):])
            if handle is not None:
                self.unlock(handle, owner=req)
            row[:mapped] = UNMAPPED
            del self._running[req.table_idx]
            req.finished = True
            return freed
        except BaseException:
            self._undo_settling(req, undo)
            raise
