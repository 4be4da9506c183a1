"""Plain-Python oracles: the slow, obviously-right versions of every kernel and data structure.

Tests, exercise checkers and notebooks all compare against these. They use Python lists
and loops on purpose: nothing clever, so that a reader can check them by eye. They import
nothing of kvlab but its errors, and keep their own copies of small helpers: an oracle that
shared a helper with the code it checks would share that helper's bugs.

    paging_ref       page_to_token, write_page_table                       (chapters 01-02)
    alloc_ref        alloc_extend, alloc_decode, their plans and page reads  (03-04)
    radix_ref        the prefix store and the regions of cache_req          (05-06)
    attention_ref    paged decode attention, its splits and their merge     (08-09)
    hash_chain_ref   the hash-chained page pool                             (11)
"""
from .paging_ref import page_to_token_ref, write_page_table_ref  # noqa: F401,E402
from .alloc_ref import DecodePlan, ExtendPlan, alloc_decode_ref, alloc_extend_ref  # noqa: E402,F401  (chapters 03-04)
from .attention_ref import paged_decode_attention_reference  # noqa: E402,F401  (chapter 08)
from .attention_ref import (merge_splits_reference, split_partials_reference,  # noqa: E402,F401  (chapter 09)
                        split_ranges_reference)
from .radix_ref import PrefixStoreRef, RegionsRef, cache_req_regions_ref, match_len_ref, page_aligned_len  # noqa: E402,F401  (chapters 05-06)
from .hash_chain_ref import AllocationRef, PagePoolRef  # noqa: E402,F401  (chapter 11)
