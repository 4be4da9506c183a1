"""Benchmarks: the teaching path vs the fast path, side by side (chapter 09).

``python -m kvlab.bench`` runs :func:`kvlab.bench.suite.run`; :mod:`kvlab.bench.paths` holds
the paths it compares, :mod:`kvlab.bench.cases` the seeded batches, :mod:`kvlab.bench.plots`
the pictures (drawn from a saved result, so they read the same on a laptop).
"""
from __future__ import annotations

from .cases import (DECODE_BATCHES, EXTEND_CASES, PAGE_SIZES, make_decode_batch,  # noqa: F401
                    make_extend_batch)
from .paths import alloc_extend_torch  # noqa: F401
