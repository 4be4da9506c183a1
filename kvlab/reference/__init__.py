"""Plain-Python oracles: the slow, obviously-right versions of every kernel and data structure.

Tests, exercise checkers and notebooks all compare against these. They use Python lists
and loops on purpose: nothing clever, so that a reader can check them by eye. They import
nothing of kvlab but its errors, and keep their own copies of small helpers: an oracle that
shared a helper with the code it checks would share that helper's bugs.
"""
from .paging import page_to_token_ref, write_page_table_ref  # noqa: F401,E402
from .alloc import DecodePlan, ExtendPlan, alloc_decode_ref, alloc_extend_ref  # noqa: E402,F401  (chapters 03-04)
from .attention import paged_decode_attention_reference  # noqa: E402,F401  (chapter 08)
from .attention import (merge_splits_reference, split_partials_reference,  # noqa: E402,F401  (chapter 09)
                        split_ranges_reference)
from .radix import PrefixStoreRef, RegionsRef, cache_req_regions_ref, match_len_ref, page_aligned_len  # noqa: E402,F401  (chapters 05-06)
from .hashchain import AllocationRef, PagePoolRef  # noqa: E402,F401  (chapter 11)
