"""What one ``cache_req`` did, region by region (chapter 06): plain data for tests and drawings.

Region accounting in :meth:`CacheManager.cache_req <kvlab.manager.cache_manager.CacheManager.cache_req>`
over a request's ``[0, req.cached_len)``::

    0        old.cached_len      cached_len       new.cached_len      req.cached_len
    | hit     | duplicate (freed) | newly inserted  | tail (freed if finished) |

* **hit**: in the cache before the prefill; the request's handle covers it;
* **duplicate**: computed by this request, but meanwhile cached by another: freed;
* **newly inserted**: the request's pages now belong to the cache;
* **tail**: less than a page, not cacheable: freed when the request finished, kept otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["Region", "CacheRegions"]


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
