"""The fast decode attention's launch options (chapter 09): block size, warps, stages, and how
many programs share a request's positions.

:class:`FastConfig` holds what a compiled variant of the split kernel is made of;
:func:`default_config` picks its block size from the head's bytes; :func:`choose_num_splits`
the number of splits from the batch, the K/V heads, the longest context and the GPU's
multiprocessors (asked once per device, :func:`streaming_multiprocessors`).
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch

from ..base.args import div_ceil

__all__ = ["FastConfig", "default_config", "choose_num_splits", "streaming_multiprocessors",
           "PROGRAMS_PER_SM", "MIN_SPLIT_TOKENS", "MAX_SPLITS", "MAX_NUM_SPLITS", "DEFAULT_BLOCK_BYTES"]


class FastConfig(NamedTuple):
    """How :func:`kvlab.attention.fast_paged_decode_attention` launches its split kernel
    (compile-time choices).

    The default is the variant that measured fastest on an H200 at batch 64, where the floor
    is tightest, among blocks of 32, 64 and 128 positions, 2-8 warps and 2-3 pipeline stages
    (bfloat16, 32 query heads on 8 K/V heads of 64)."""

    block_n: int = 128         # positions per block (a power of two >= 16)
    use_dot: bool = True       # scores with tl.dot (the group's heads padded to 16 rows)
    num_warps: int = 4
    num_stages: int = 2


#: bytes of one block's K rows the default block size aims for (``block_n * head_dim * elem``):
#: 128 positions of 64 bfloat16 values, the shape FastConfig's defaults were measured on; a
#: larger head gets fewer positions per block, so that the blocks a program keeps in flight
#: (``num_stages`` of K and V) leave room for more than one program per multiprocessor
DEFAULT_BLOCK_BYTES = 16384


def default_config(head_dim: int, dtype: torch.dtype) -> FastConfig:
    """:class:`FastConfig`'s defaults with the block size for this head size and pool dtype
    (:data:`DEFAULT_BLOCK_BYTES`, between 16 and 128 positions)."""
    per_row = max(1, head_dim * dtype.itemsize)
    block_n = 16
    while block_n < 128 and (2 * block_n) * per_row <= DEFAULT_BLOCK_BYTES:
        block_n *= 2
    return FastConfig(block_n=block_n)


#: programs per streaming multiprocessor the split aims for (on an H200, 2 measured faster than
#: 4 and 8 at batch 64, where fewer splits mean no merge to launch)
PROGRAMS_PER_SM = 2
#: a split holds at least this many positions: shorter ones cost more to merge than they save
MIN_SPLIT_TOKENS = 256
#: at most this many splits chosen (the partial results grow with it)
MAX_SPLITS = 64
#: at most this many splits asked for (``num_splits=``): the partial results are
#: ``batch x heads x splits x (head_dim + 1)`` floats
MAX_NUM_SPLITS = 1024
#: streaming multiprocessors assumed in the interpreter (few: every program runs on the CPU)
INTERPRETER_SMS = 2


@lru_cache(maxsize=None)
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def streaming_multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors (asked once per device), or :data:`INTERPRETER_SMS`."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _sms(device)


def choose_num_splits(batch: int, kv_heads: int, context: int, sms: int, block_n: int = 64) -> int:
    """How many programs share one request's positions, per K/V head.

    Enough ``batch * kv_heads * splits`` programs to keep ``PROGRAMS_PER_SM`` on each of the
    ``sms`` multiprocessors, but no split shorter than ``MIN_SPLIT_TOKENS`` positions of the
    longest ``context``, and at most ``MAX_SPLITS``. A batch that fills the GPU by itself
    gets one split (no merge)::

        batch 1,   8 K/V heads, context 32768, 132 SMs:  ceil(264 / 8) = 33 splits
        batch 1,   8 K/V heads, context 512:             512 / 256 = 2 splits
        batch 64,  8 K/V heads, context 4096:            ceil(264 / 512) = 1 split
    """
    programs = max(1, batch * kv_heads)
    want = div_ceil(PROGRAMS_PER_SM * sms, programs)
    by_context = div_ceil(max(1, context), max(MIN_SPLIT_TOKENS, block_n))
    return int(max(1, min(want, by_context, MAX_SPLITS)))
