"""Allocation: pages, the page table and the token allocator (chapters 01-04, fast in 09).

    paging             pages -> token slots, the page table (01-02)      paging_kernels
    token_allocator    PagedTokenAllocator: alloc_extend (03), alloc_decode (04)   alloc_kernels
    fast_alloc         chapter 09's bare fast calls                       fast_alloc_kernels
    host_checks        the host side's rules and exact counts             kernel_checks (in-kernel)
    verdict            the kernels' verdict read on the host
    native_counts      the host counts in one C call (NumPy where there is no compiler)

Each ``*_kernels`` module holds the ``@triton.jit`` code of the module beside it, and thin launchers.
"""
from __future__ import annotations

from ..base.lazy import lazy_exports

_EXPORTS = {
    "div_ceil": "paging", "page_to_token": "paging", "page_to_token_triton": "paging",
    "write_page_table": "paging", "write_page_table_triton": "paging", "new_page_table": "paging",
    "UNMAPPED": "paging",
    "page_to_token_kernel": "paging_kernels", "write_page_table_kernel": "paging_kernels",
    "PagedTokenAllocator": "token_allocator",
    "alloc_extend_kernel": "alloc_kernels", "alloc_decode_kernel": "alloc_kernels",
    "alloc_extend_fast": "fast_alloc", "alloc_decode_fast": "fast_alloc",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, (
    "paging", "paging_kernels", "token_allocator", "alloc_kernels", "fast_alloc", "fast_alloc_kernels",
    "host_checks", "kernel_checks", "verdict", "native_counts"))
