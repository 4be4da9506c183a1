"""Triton kernels, one module per chapter topic.

Teaching versions mirror the source designs; fast versions sit beside them. Importing
this package imports :mod:`kvlab` first, so the runtime (compiled vs interpreter) is
decided before any ``@triton.jit`` runs.
"""
from __future__ import annotations

from .. import runtime  # noqa: F401  (must come before any kernel is defined)
from .paging import page_to_token_kernel, write_page_table_kernel  # noqa: F401
from .attention import paged_decode_attention_kernel  # noqa: F401,E402  (chapter 08)
from .alloc import alloc_decode_kernel, alloc_extend_kernel  # noqa: F401,E402  (chapters 03-04)
from .fast_alloc import (decode_fast_kernel, extend_fill_kernel, extend_fused_kernel,  # noqa: F401,E402
                         extend_scan_kernel)  # (chapter 09)
from .fast_attention import merge_splits_kernel, split_decode_kernel  # noqa: F401,E402  (chapter 09)
