"""The host's checks of an allocation call (chapters 03, 04, 09): tensor arguments and host
lengths (vectorised); the kernels' verdict is read in :mod:`kvlab.alloc.verdict`.

Where each rule is checked, and what it costs::

    rule                                      where                         cost
    tensors: type, 1-D, int dtype, device     host, attributes only         ~1 us
    host lengths: pre >= 0, seq >= pre, ...   host: int64 CPU tensors in    one C call (~2 us);
                                                one C loop (native_counts);   a few Python builtins;
                                                else Python ints up to        else about nine NumPy
                                                SMALL_BATCH requests, else    calls (~1 us each)
                                                NumPy over the whole batch
    the caller's counts match the lengths     host (from host lengths)      (in the above)
    no total wraps int64 (lengths near 2**63) host: counts exact (the C     (in the above: a bit
                                                loop's bit 63, the NumPy      in the C loop, the OR
                                                path's OR, else Python ints)  pass of NumPy)
    enough free pages                         host (from host lengths)      one comparison
    a token count the free pages can hold     host (without host lengths)   one comparison
    last_loc on an allocated page, host       inside the kernel's pass,     no extra launch,
      copies == device tensors, totals        before it writes anything    no sync
      below 2**50 (clamped, saturating), ...

A refusal found in the kernel comes back as words of ``status``
(:data:`kvlab.alloc.kernel_checks.STATUS_FIELDS`); :func:`kvlab.alloc.verdict.refusal_error`
turns them into the :class:`~kvlab.base.errors.InvalidArgument` or :class:`~kvlab.base.errors.OutOfPages`
that the host would have raised, naming the argument, the request and the rule.
"""
from __future__ import annotations

from operator import gt, mul
from typing import NamedTuple

import numpy as np
import torch

from . import native_counts
from ..base.args import check_int
from ..base.errors import InvalidArgument, OutOfPages
from .kernel_checks import MIX, TOTAL_LIMIT

#: the dtypes the kernels read lengths, last_loc and free pages in
INDEX_DTYPES = (torch.int32, torch.int64)


# --- tensor arguments -------------------------------------------------------------------------


def check_index_tensor(name: str, t, bs: int | None = None) -> None:
    """``t`` must be a 1-D int32/int64 tensor (of ``bs`` entries, when given)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(name, "must be a torch.Tensor", f"got {type(t).__name__}")
    if t.dim() != 1:
        raise InvalidArgument(name, "must be 1-D", f"got shape {tuple(t.shape)}")
    if t.dtype not in INDEX_DTYPES:
        raise InvalidArgument(name, "dtype must be torch.int32 or torch.int64", f"got {t.dtype}")
    if bs is not None and t.numel() != bs:
        raise InvalidArgument(name, "one entry per request", f"got {t.numel()}, expected {bs}")


def same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are the same device when the current one is 0."""
    return a == b or (a.type == b.type and (a.index is None or b.index is None))


def check_devices(owner: str, device: torch.device, **tensors: torch.Tensor) -> None:
    """Name the first of ``tensors`` that is not on ``device``."""
    for name, t in tensors.items():
        if not same_device(t.device, device):
            raise InvalidArgument(name, f"must be on the same device as {owner}",
                                  f"got {t.device} and {device}")


def check_count(name: str, value) -> int:
    """A count the caller gives: an int >= 0 (not a bool)."""
    if type(value) is int and value >= 0:
        return value
    return check_int(name, value, minimum=0)


def fits(num_tokens: int, num_free: int, bs: int, page_size: int) -> bool:
    """Whether ``num_free`` pages could hold ``num_tokens`` new tokens of ``bs`` requests, whatever
    their lengths: at most ``num_free * P`` on new pages and ``P - 1`` each on its last old page
    (and fewer than the kernels' :data:`~kvlab.alloc.kernel_checks.TOTAL_LIMIT`). Without host
    lengths this is all the host can say before it allocates the output for the tokens."""
    return num_tokens <= num_free * page_size + bs * (page_size - 1) and num_tokens < TOTAL_LIMIT


def capacity_error(num_tokens: int, num_free: int, bs: int, page_size: int) -> OutOfPages:
    """The :class:`OutOfPages` of a token count that does not :func:`fit`: the fewest pages such
    an extend could need."""
    at_least = -(-(num_tokens - bs * (page_size - 1)) // page_size)
    return OutOfPages(at_least, num_free, f"extend of {num_tokens} tokens")


# --- host lengths -----------------------------------------------------------------------------


def host_lengths(name: str, values, bs: int | None = None) -> np.ndarray:
    """A host copy of lengths as a 1-D int64 NumPy array (no copy for an int64 CPU tensor).

    Accepted: a CPU tensor or NumPy array of integers, or a flat list / tuple of ints. Refused,
    naming ``name``: device tensors (reading them is the sync this argument avoids), floats,
    bools (also inside a list: NumPy would take them as 0 and 1), nested or ragged lists,
    integers outside int64, anything not 1-D, and a length other than ``bs``. A Python list is
    converted element by element (about 30 ns each); a CPU tensor costs a microsecond at any size.
    """
    if type(values) is torch.Tensor and values.dtype is torch.int64 and values.is_cpu \
            and values.dim() == 1 and (bs is None or values.numel() == bs):
        return values.numpy()  # what a scheduler passes: judged in one line, no copy
    if isinstance(values, torch.Tensor):
        if not values.is_cpu:
            raise InvalidArgument(name, "must be on the host (a CPU tensor, NumPy array or list)",
                                  f"got a tensor on {values.device}")
        values = values.numpy()
    elif not isinstance(values, np.ndarray):
        values = _list_lengths(name, values)
    if values.ndim != 1:
        raise InvalidArgument(name, "must be 1-D", f"got shape {values.shape}")
    if values.dtype.kind not in "iu" or values.dtype.kind == "u" and values.size and values.max() > _INT64_MAX:
        raise InvalidArgument(name, "must hold int64 integers (not bools, floats or larger ints)",
                              f"got dtype {values.dtype}")
    if bs is not None and len(values) != bs:
        raise InvalidArgument(name, "one entry per request", f"got {len(values)}, expected {bs}")
    return values.astype(np.int64, copy=False)


def _list_lengths(name: str, values) -> np.ndarray:
    """A list or tuple of ints as a NumPy array; bools and ragged lists are refused by name."""
    if not isinstance(values, (list, tuple)):
        raise InvalidArgument(name, "must be a list of ints, a CPU tensor or a NumPy array",
                              f"got {type(values).__name__}")
    if not values:
        return np.zeros(0, dtype=np.int64)
    kinds = set(map(type, values))
    if bool in kinds or np.bool_ in kinds:
        i = next(i for i, x in enumerate(values) if type(x) in (bool, np.bool_))
        raise InvalidArgument(f"{name}[{i}]", "must be an int (not a bool)", f"got {values[i]!r}")
    try:
        return np.array(values)
    except (ValueError, TypeError, OverflowError):  # (a ragged list: NumPy's "inhomogeneous shape")
        raise InvalidArgument(name, "must be a flat list of ints, one per request",
                              f"got {str(values)[:80]}") from None


#: the checksum weights and their address (what the C helper reads), replaced together
_WEIGHTS_AT: tuple[np.ndarray, int] = (np.zeros(0, dtype=np.int64), 0)


def checksum_weights(n: int) -> np.ndarray:
    """``w[i] = h ^ (h >> 29)`` with ``h = (i + 1) * MIX`` in wrapping int64: the weights the
    kernels use to compare host copies with device tensors (``sum(x * w)``, wrapping)."""
    return _weights_at(n)[0][:n]


def _weights_at(n: int) -> tuple[np.ndarray, int]:
    """At least ``n`` checksum weights and their address (the caller keeps the array while it
    uses the address: a concurrent call may replace the module's copy)."""
    global _WEIGHTS_AT
    kept = _WEIGHTS_AT
    if len(kept[0]) < n:
        h = np.arange(1, max(n, 2 * len(kept[0])) + 1, dtype=np.int64) * np.int64(MIX)
        weights = h ^ (h >> 29)
        kept = _WEIGHTS_AT = (weights, weights.ctypes.data)
    return kept


def _native_extend(pre, seq, page_size: int, bs: int | None) -> HostCounts | None:
    """:func:`extend_counts` in C, for what the helper reads: contiguous 1-D int64 CPU tensors
    (of ``bs``), P a power of two, every rule kept; else None (the NumPy code judges)."""
    if not (type(pre) is type(seq) is torch.Tensor and pre.dtype is seq.dtype is torch.int64
            and pre.is_cpu and seq.is_cpu and pre.dim() == 1 and pre.shape == seq.shape
            and pre.is_contiguous() and seq.is_contiguous() and page_size & (page_size - 1) == 0):
        return None
    n = pre.shape[0]
    if bs is not None and n != bs:
        return None
    weights, at = _weights_at(n)  # (``weights`` held: the address stays valid during the call)
    counts = native_counts.extend(pre.data_ptr(), seq.data_ptr(), at, n, page_size.bit_length() - 1)
    return None if counts is None else HostCounts(*counts)


def _native_decode(seq, page_size: int, bs: int | None) -> HostCounts | None:
    """:func:`decode_counts` in C (see :func:`_native_extend`), else None."""
    if not (type(seq) is torch.Tensor and seq.dtype is torch.int64 and seq.is_cpu and seq.dim() == 1
            and seq.is_contiguous() and page_size & (page_size - 1) == 0):
        return None
    n = seq.shape[0]
    if bs is not None and n != bs:
        return None
    weights, at = _weights_at(n)
    counts = native_counts.decode(seq.data_ptr(), at, n, page_size.bit_length() - 1)
    return None if counts is None else HostCounts(n, counts[0], 0, counts[1])


class HostCounts(NamedTuple):
    """What an allocation needs, from host lengths, and the checksums the kernel compares."""

    tokens: int
    pages: int
    sum_pre: int
    sum_seq: int


_EMPTY = HostCounts(0, 0, 0, 0)
# (``a.min()`` goes through a Python wrapper; the ufuncs' reduce does not)
_min, _or, _sum = np.minimum.reduce, np.bitwise_or.reduce, np.add.reduce

#: Host lengths of at most this many requests are counted in plain Python: a NumPy call
#: costs about a microsecond whatever the size, a Python step about 30-60 ns per request.
SMALL_BATCH: int = 32
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_SMALL_WEIGHTS: list[int] = []


def _wrap64(x: int) -> int:
    """``x`` as a wrapping int64 would hold it (what NumPy's int64 sums give)."""
    return ((x + (1 << 63)) & ((1 << 64) - 1)) - (1 << 63)


def _int64_lengths(values, bs: int | None):
    """The common case judged in one line: an int64 CPU tensor or NumPy array, 1-D, of ``bs``
    entries (when given) comes back as a list of ints (at most :data:`SMALL_BATCH` entries)
    or a NumPy array (no copy); a short list or tuple of int64-sized ints as itself; anything
    else as ``None`` (:func:`host_lengths` judges it, and names what is wrong)."""
    kind = type(values)
    if kind is torch.Tensor:
        if not (values.dtype is torch.int64 and values.is_cpu and values.dim() == 1):
            return None
        n = values.numel()
    elif kind is np.ndarray:
        if not (values.dtype == np.int64 and values.ndim == 1):
            return None
        n = values.shape[0]
    elif kind is list or kind is tuple:
        n = len(values)
        if n > SMALL_BATCH or (bs is not None and n != bs) or not all(type(x) is int for x in values):
            return None  # (long lists, bools, floats, NumPy scalars: the NumPy path)
        return values if not values or _INT64_MIN <= min(values) and max(values) <= _INT64_MAX else None
    else:
        return None
    if bs is not None and n != bs:
        return None
    if n <= SMALL_BATCH:
        return values.tolist()
    return values.numpy() if kind is torch.Tensor else values


def _small_weights() -> list[int]:
    global _SMALL_WEIGHTS
    if not _SMALL_WEIGHTS:
        _SMALL_WEIGHTS = checksum_weights(SMALL_BATCH).tolist()
    return _SMALL_WEIGHTS


def _extend_counts_small(pre: list, seq: list, page_size: int) -> HostCounts | None:
    """:func:`extend_counts` of a small batch, in Python ints (exact at any size); ``None`` if a
    rule is broken (the NumPy path then names the request)."""
    if not pre:
        return _EMPTY
    if min(pre) < 0 or any(map(gt, pre, seq)):
        return None
    total = sum(seq)
    m = page_size - 1
    if page_size & m == 0:
        s = page_size.bit_length() - 1
        pages = sum([((b + m) >> s) - ((a + m) >> s) for a, b in zip(pre, seq)])
    else:
        pages = sum([(b + m) // page_size - (a + m) // page_size for a, b in zip(pre, seq)])
    w = _small_weights()  # (map stops at the shorter list)
    return HostCounts(total - sum(pre), pages, _wrap64(sum(map(mul, pre, w))), _wrap64(sum(map(mul, seq, w))))


def extend_counts(prefix_lens_cpu, seq_lens_cpu, page_size: int, bs: int | None = None) -> HostCounts:
    """Tokens, new pages and checksums of an extend, checking ``0 <= pre <= seq`` per request.

    Contiguous int64 CPU tensors (what a scheduler passes): one call of the C helper
    (:mod:`kvlab.alloc.native_counts`), when it is built and every rule holds. Otherwise, up to
    :data:`SMALL_BATCH` requests given as int64 tensors, arrays or lists of ints: a
    few Python builtins over the lists. Otherwise five NumPy passes over one ``[pre | seq | extend]``
    block (an OR for the signs and sizes, checksums, ceil, sums); the request that breaks a rule
    is looked for only once a rule is known to be broken. The counts are exact on every path:
    where an int64 sum could wrap (lengths near 2**63), they are Python integers, so that the
    caller's comparisons (its own counts, the free pages) refuse the batch.
    """
    counts = _native_extend(prefix_lens_cpu, seq_lens_cpu, page_size, bs)  # CPU tensors, in C
    if counts is not None:
        return counts
    pre = _int64_lengths(prefix_lens_cpu, bs)
    seq = None if pre is None else _int64_lengths(seq_lens_cpu, len(pre))
    if type(seq) is list or type(seq) is tuple:  # (then so is pre: same length)
        counts = _extend_counts_small(pre, seq, page_size)
        if counts is not None:
            return counts
    if type(seq) is not np.ndarray:  # other containers, bad input, a broken rule: judged here
        pre = host_lengths("prefix_lens_cpu", prefix_lens_cpu, bs)
        seq = host_lengths("seq_lens_cpu", seq_lens_cpu, len(pre))
    n = len(pre)
    if not n:
        return _EMPTY
    extend = seq - pre
    rows = np.array((pre, seq, extend))  # one block: each pass below is one NumPy call
    # One pass for two rules: a negative length sets the sign bit of the OR (seq >= 0 as well:
    # then seq - pre cannot wrap), and every length is below 2**k iff the OR is. With n lengths
    # below 2**(62 - bits(n)) no sum and no ``x + P - 1`` below can wrap int64.
    bits = _or(rows, None)
    if bits < 0:
        r = int(np.argmax((pre < 0) | (extend < 0) | (seq < 0)))  # rare: the first offender
        if pre[r] < 0:
            raise InvalidArgument(f"prefix_lens_cpu[{r}]", "prefix_lens >= 0", f"got {int(pre[r])}")
        raise InvalidArgument(f"seq_lens_cpu[{r}]", "seq_lens >= prefix_lens",
                              f"got seq {int(seq[r])} < pre {int(pre[r])}")
    lens = rows[:2]
    sum_pre, sum_seq = np.dot(lens, checksum_weights(n)).tolist()  # (wrapping, as the kernels')
    if bits >> (62 - n.bit_length()):
        return _exact_counts(pre.tolist(), seq.tolist(), page_size, sum_pre, sum_seq)  # rare: huge
    lens += page_size - 1  # lens becomes ceil(pre / P), ceil(seq / P): a shift for a power of two
    if page_size & (page_size - 1) == 0:
        lens >>= page_size.bit_length() - 1
    else:
        lens //= page_size
    pages_pre, pages_seq, tokens = _sum(rows, 1).tolist()
    return HostCounts(tokens, pages_seq - pages_pre, sum_pre, sum_seq)


def _exact_counts(pre: list, seq: list, page_size: int, sum_pre: int, sum_seq: int) -> HostCounts:
    """Counts of lengths so large that an int64 sum could wrap, in Python integers (exact at any
    size: the caller compares them with its counts and the free pages, and refuses)."""
    ceil = lambda x: -(-x // page_size)  # noqa: E731
    pages = sum(ceil(b) - ceil(a) for a, b in zip(pre, seq))
    return HostCounts(sum(seq) - sum(pre), pages, sum_pre, sum_seq)


def _decode_pages_small(seq: list, page_size: int) -> int:
    if page_size == 1:
        return len(seq)
    if page_size & (page_size - 1) == 0:
        m = page_size - 1
        return [x & m for x in seq].count(1)
    return [x % page_size for x in seq].count(1)


def decode_counts(seq_lens_cpu, page_size: int, bs: int | None = None) -> HostCounts:
    """New pages and checksum of a decode step (``seq >= 1``): ``#{r : (seq_r - 1) % P == 0}``."""
    counts = _native_decode(seq_lens_cpu, page_size, bs)  # a CPU tensor, in C
    if counts is not None:
        return counts
    seq = _int64_lengths(seq_lens_cpu, bs)
    if (type(seq) is list or type(seq) is tuple) and (not seq or min(seq) >= 1):
        return HostCounts(len(seq), _decode_pages_small(seq, page_size), 0,
                          _wrap64(sum(map(mul, seq, _small_weights()))))
    if type(seq) is not np.ndarray:
        seq = host_lengths("seq_lens_cpu", seq_lens_cpu, bs)
    n = len(seq)
    if not n:
        return _EMPTY
    if _min(seq, None) < 1:
        r = int(np.argmax(seq < 1))
        raise InvalidArgument(f"seq_lens_cpu[{r}]", "seq_lens >= 1 (the length after the new token)",
                              f"got {int(seq[r])}")
    if page_size == 1:
        pages = n
    elif page_size & (page_size - 1) == 0:  # (seq - 1) % P == 0  <=>  seq % P == 1, for P > 1
        pages = int(np.count_nonzero((seq & (page_size - 1)) == 1))
    else:
        pages = int(np.count_nonzero(seq % page_size == 1))
    return HostCounts(n, pages, 0, int(np.dot(seq, checksum_weights(n))))
