"""The rules of the fast decode-attention call (chapter 09): those the host judges, and the
refusals the kernel records for the rules only the device can judge.

* :func:`check_kinds` and its neighbours: chapter 08's shape rules and what the fast kernels
  add (dtypes, devices, the options), all on attributes the host has: nothing here reads a
  tensor's values, so nothing here waits for the GPU;
* the kernel's refusals (rows, lengths, slots: :mod:`kvlab.attention.split_kernels`) land in a
  status word per device, in pinned host memory on a GPU (:func:`status_for`); :func:`refusal`
  turns a word into the :class:`~kvlab.errors.InvalidArgument` chapter 08's checks would raise,
  and :func:`check_attention_errors` waits for the GPU and raises the pending one.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..base import runtime
from .attention_options import FastConfig, default_config
from ..base.errors import InvalidArgument

__all__ = ["POOL_DTYPES", "OUT_DTYPES", "check_kinds", "check_new", "check_config", "check_scale_value",
           "Status", "status_for", "take_refusal", "refusal", "raise_pending", "check_attention_errors"]

#: what the pools may hold (``tl.dot`` takes these) and what the output may be
POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def tensor_arg(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(name, "must be a torch.Tensor", f"got {type(t).__name__}")
    return t


def check_config(config, head_dim: int, dtype: torch.dtype) -> FastConfig:
    if config is None:
        return default_config(head_dim, dtype)
    if not isinstance(config, FastConfig):
        raise InvalidArgument("config", "None or a kvlab.attention.FastConfig", f"got {type(config).__name__}")
    block_n, use_dot, num_warps, num_stages = config
    if type(block_n) is not int or block_n < 16 or block_n > 1024 or block_n & (block_n - 1):
        raise InvalidArgument("config.block_n", "a power of two, 16 <= block_n <= 1024", f"got {block_n!r}")
    if not isinstance(use_dot, bool):
        raise InvalidArgument("config.use_dot", "True or False", f"got {use_dot!r}")
    if type(num_warps) is not int or num_warps not in (1, 2, 4, 8, 16):
        raise InvalidArgument("config.num_warps", "one of 1, 2, 4, 8, 16", f"got {num_warps!r}")
    if type(num_stages) is not int or not 1 <= num_stages <= 8:
        raise InvalidArgument("config.num_stages", "an int, 1 <= num_stages <= 8", f"got {num_stages!r}")
    return config


def check_scale_value(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise InvalidArgument("scale", "None or a finite number > 0 (an int or a float)",
                              f"got {type(scale).__name__} {scale!r}")
    return float(scale)


def check_pool_shapes(heads: int, head_dim: int, k_pool, v_pool) -> None:
    """The pools' shape rules shared by chapter 08's checks and the fast call's:
    ``[num_slots, kv_heads, head_dim]`` with ``kv_heads`` dividing the query heads, both alike."""
    if k_pool.dim() != 3 or k_pool.shape[2] != head_dim:
        raise InvalidArgument("k_pool", f"shape [num_slots, kv_heads, {head_dim}] (head_dim of q)",
                              f"got {list(k_pool.shape)}")
    kv_heads = k_pool.shape[1]
    if kv_heads == 0 or heads % kv_heads:
        raise InvalidArgument("k_pool", f"kv_heads must divide the {heads} query heads "
                              "(grouped-query attention)", f"got {kv_heads} K/V heads")
    if v_pool.shape != k_pool.shape:
        raise InvalidArgument("v_pool", "same shape as k_pool", f"{list(v_pool.shape)} vs {list(k_pool.shape)}")


def check_kinds(q, k_pool, v_pool, page_table, table_idx, seq_lens) -> None:
    """Chapter 08's shape rules (:func:`kvlab.attention.check_paged_attention_inputs`) and the
    rules on dtypes, devices and layouts the fast kernels add; nothing here reads a value."""
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool), ("page_table", page_table),
                    ("table_idx", table_idx), ("seq_lens", seq_lens)):
        tensor_arg(name, t)
    if q.dim() != 3 or not q.dtype.is_floating_point:
        raise InvalidArgument("q", "a floating tensor [batch, heads, head_dim]", f"got {q.dtype} {list(q.shape)}")
    batch, heads, head_dim = q.shape
    check_pool_shapes(heads, head_dim, k_pool, v_pool)
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool)):
        if t.dtype not in POOL_DTYPES or t.dtype != k_pool.dtype:
            raise InvalidArgument(name, f"one dtype of {[str(d) for d in POOL_DTYPES]} for both pools",
                                  f"got {k_pool.dtype} and {v_pool.dtype}")
    if page_table.dim() != 2 or page_table.dtype not in (torch.int32, torch.int64):
        raise InvalidArgument("page_table", "a 2-D int32/int64 tensor [rows, cols]",
                              f"got {page_table.dtype} {list(page_table.shape)}")
    from .split_kernels import MAX_COLUMNS, MAX_REQUESTS

    if page_table.shape[1] >= MAX_COLUMNS or batch >= MAX_REQUESTS:
        raise InvalidArgument("page_table" if batch < MAX_REQUESTS else "q",
                              f"fewer than {MAX_COLUMNS} columns and requests", f"got {list(page_table.shape)}, "
                              f"batch {batch}")
    for name, t in (("table_idx", table_idx), ("seq_lens", seq_lens)):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise InvalidArgument(name, "integers", f"got {t.dtype}")
        if t.numel() != batch:
            raise InvalidArgument(name, f"one entry per query (batch {batch})", f"got {t.numel()}")
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool), ("page_table", page_table),
                    ("table_idx", table_idx), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise InvalidArgument(name, f"on q's device ({q.device})", f"got {t.device}")
    if q.device.type != ("cpu" if runtime.INTERPRET else "cuda"):
        raise InvalidArgument("q", f"on a {'CPU' if runtime.INTERPRET else 'CUDA'} device "
                              f"({'the interpreter' if runtime.INTERPRET else 'compiled kernels'})",
                              f"got {q.device}")


def check_new(new_k, new_v, batch: int, k_pool) -> None:
    want = (batch, k_pool.shape[1], k_pool.shape[2])
    for name, t in (("k", new_k), ("v", new_v)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or not t.dtype.is_floating_point \
                or t.device != k_pool.device or t.stride(2) != 1:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidArgument(name, f"a floating tensor [batch, kv_heads, head_dim] = {list(want)} "
                                  "on the pools' device, head_dim contiguous", f"got {got}")


# --- the refusals the kernel records ------------------------------------------------------------

class Status(NamedTuple):
    """Where the kernels of one device record refusals."""

    word: torch.Tensor     # int64 [1] on the device: the first refusal (split_kernels.STATUS_BASE)
    flag: torch.Tensor     # int64 [1]: 1 once a kernel refused; pinned host memory on a GPU
    host: object           # the flag as the host reads it in place (a NumPy view), or None (a CPU)
    addresses: tuple[int, int]   # (word, flag): what a direct launch passes


_STATUS: dict[torch.device, Status] = {}


def status_for(device: torch.device) -> Status:
    status = _STATUS.get(device)
    if status is None:
        word = torch.zeros(1, dtype=torch.int64, device=device)
        if device.type == "cuda":   # pinned: the kernel stores into it, the host reads it where it lies
            flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
            host = flag.numpy()
        else:
            flag, host = torch.zeros(1, dtype=torch.int64, device=device), None
        status = Status(word, flag, host, (word.data_ptr(), flag.data_ptr()))
        _STATUS[device] = status
    return status


def take_refusal(status: Status) -> int:
    """The recorded refusal's word (0: none), and the status cleared. Reads the device word:
    on a GPU a sync, paid only when the flag said there is something to read."""
    if not int(status.flag[0]):
        return 0
    word = int(status.word.item())
    status.word.zero_()
    status.flag.zero_()
    return word


def refusal(word: int, tensors: tuple | None) -> InvalidArgument:
    """The error of a status word; ``tensors`` (``table_idx, seq_lens, page_table, num_slots``)
    name the values when the refused call itself raises it (None: an earlier call's refusal)."""
    from .split_kernels import MAX_COLUMNS, REFUSED_LENGTH, REFUSED_ROW, STATUS_BASE

    order = STATUS_BASE - word
    kind, b, t = order >> 56, (order >> 28) % MAX_COLUMNS, order % MAX_COLUMNS
    if tensors is None:
        earlier = "found by the kernel of an earlier call, whose output for that request is NaN"
        if kind == REFUSED_ROW:
            return InvalidArgument(f"table_idx[{b}]", "0 <= row < the page table's rows", earlier)
        if kind == REFUSED_LENGTH:
            return InvalidArgument(f"seq_lens[{b}]", "1 <= seq_len <= the page table's columns", earlier)
        return InvalidArgument(f"page_table[table_idx[{b}], {t}]",
                               "a mapped slot in [0, num_slots) for every position < seq_len", earlier)
    table_idx, seq_lens, page_table, num_slots = tensors
    rows, cols = page_table.shape
    if kind == REFUSED_ROW:
        return InvalidArgument(f"table_idx[{b}]", f"0 <= row < {rows} (page_table rows)",
                               f"got {int(table_idx[b])}")
    if kind == REFUSED_LENGTH:
        return InvalidArgument(f"seq_lens[{b}]", f"1 <= seq_len <= {cols} (page_table columns)",
                               f"got {int(seq_lens[b])}")
    row = int(table_idx[b])
    return InvalidArgument(f"page_table[{row}, {t}]",
                           f"a mapped slot in [0, {num_slots}) for every position < seq_len",
                           f"request {b} has seq_len {int(seq_lens[b])} but position {t} holds "
                           f"{int(page_table[row, t])}")


def raise_pending(status: Status) -> None:
    """Raise an earlier call's refusal, if the flag says there is one (read without waiting)."""
    if status.host[0]:
        word = take_refusal(status)
        if word:
            raise refusal(word, None)


def check_attention_errors(device=None) -> None:
    """Wait for ``device``'s queued work (default: the runtime's), then raise the first refusal
    the fast attention kernels recorded there since the last one was raised (if any)."""
    device = runtime.default_device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    status = _STATUS.get(device)
    if status is None:
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    word = take_refusal(status)
    if word:
        raise refusal(word, None)
