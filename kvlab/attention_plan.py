"""The public fast decode-attention call at the cost of its launches (chapter 09).

:func:`kvlab.attention.fast_paged_decode_attention` is a public call: anything may be passed
to it, and a wrong argument must be refused with an error that names it. Chapter 08's wrapper
checks the obvious way, and pays for it on every call: reading a device tensor's values on
the host (``if bad.any():``, ``int(seq_lens[b])``) waits for the GPU, several times per call.
This module keeps the checks and moves them to where they cost nothing, as the allocator
does (:mod:`kvlab.token_allocator`):

* **rules on the arguments' kinds** (types, shapes, dtypes, devices, strides, ``scale``,
  ``num_splits``, ``config``, ``out_dtype``, ``max_context``) are judged once per combination
  and remembered: a :class:`Plan` keyed by everything they read (shapes, strides, dtypes,
  devices, the options *and their types*: ``True == 1`` and ``np.int64(2) == 2`` in Python, so
  the value alone would let a bool ride on a cached int). A call whose key is known goes
  straight to the launch;
* **rules on values only the device holds** (each row exists, ``1 <= seq_len <= columns``,
  every slot read is in the pool) run inside the split kernel
  (:mod:`kvlab.kernels.fast_attention`, ``CHECK``): a refused request reads nothing outside
  the pool and its output is NaN; the first refusal is written to a status word. In the
  interpreter (CPU tensors: reading them is free) the call raises it at once. On a GPU the
  word lives in pinned host memory that the kernel writes directly, and the host reads it
  without waiting: the refusal is raised by the next checked call on that device, or by
  :func:`check_attention_errors` (which waits for the GPU);
* **the split count** comes from the multiprocessor count, asked once per device;
* **the launch**: after a plan's first call the compiled kernels are kept and launched through
  their C launchers with addresses (:mod:`kvlab.kernels.launch`), not through Triton's
  per-call bookkeeping (binding, specialisation, cache key: tens of microseconds per launch).

Every int a kernel takes comes from the plan's shapes and strides, so a kept kernel was
compiled for exactly these values; its pointers were 16-byte aligned (what Triton specialises
on), and a later call with an unaligned pointer takes Triton's own launch.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import torch

from . import runtime
from .args import check_int, div_ceil, next_pow2
from .errors import InvalidArgument
from .kernels.launch import Launcher, launch_ready

__all__ = ["FastConfig", "choose_num_splits", "streaming_multiprocessors", "Plan", "plan_for",
           "attend", "check_attention_errors", "MAX_NUM_SPLITS", "POOL_DTYPES", "OUT_DTYPES"]


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
#: what the pools may hold (``tl.dot`` takes these) and what the output may be
POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: plans remembered (each a few hundred bytes); past it the oldest half is dropped
MAX_PLANS = 1024


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


# --- the refusals the kernel records ------------------------------------------------------------


class _Status(NamedTuple):
    tensor: torch.Tensor   # int64 [1]: the kernel's word (see kernels.fast_attention.STATUS_BASE)
    host: object           # the same word as the host reads it (a NumPy view of pinned memory), or None
    address: int


_STATUS: dict[torch.device, _Status] = {}


def _status_for(device: torch.device) -> _Status:
    status = _STATUS.get(device)
    if status is None:
        if device.type == "cuda":   # pinned host memory: the kernel writes it, the host reads it in place
            tensor = torch.zeros(1, dtype=torch.int64, pin_memory=True)
            status = _Status(tensor, tensor.numpy(), tensor.data_ptr())
        else:
            tensor = torch.zeros(1, dtype=torch.int64, device=device)
            status = _Status(tensor, None, tensor.data_ptr())
        _STATUS[device] = status
    return status


def _refusal(word: int, tensors: tuple | None) -> InvalidArgument:
    """The error of a status word; ``tensors`` (``table_idx, seq_lens, page_table, num_slots``)
    name the values when the refused call itself raises it (None: an earlier call's refusal)."""
    from .kernels.fast_attention import MAX_COLUMNS, REFUSED_LENGTH, REFUSED_ROW, STATUS_BASE

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


def _raise_pending(status: _Status) -> None:
    word = int(status.host[0])
    if word:
        status.tensor.zero_()
        raise _refusal(word, None)


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
        _raise_pending(status)
    else:
        word = int(status.tensor[0])
        if word:
            status.tensor.zero_()
            raise _refusal(word, None)


# --- the plan: every host rule, judged once per key ------------------------------------------


class Plan:
    """What a call with these kinds of arguments launches, judged valid (see the module
    docstring). Built by :func:`plan_for`; the kept kernels' entries are filled in by the first
    call that launches them."""

    __slots__ = ("batch", "heads", "kv_heads", "head_dim", "num_splits", "scale", "out_dtype",
                 "device", "check", "store", "config", "split_ints", "merge_ints", "split_consts",
                 "merge_consts", "scratch_words", "status", "copy_q", "copy_pools", "copy_table",
                 "split_entry", "merge_entry", "launch_key", "low_precision", "lse_offset")

    def __init__(self, **fields):
        for name in self.__slots__:
            setattr(self, name, fields.get(name))


_PLANS: dict = {}


def _kind(t) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device)


def plan_key(q, k_pool, v_pool, page_table, table_idx, seq_lens, new_k, new_v, scale, num_splits,
             config, out_dtype, max_context, check) -> tuple:
    """Everything the host rules read (raises AttributeError / TypeError for a non-tensor)."""
    new = None if new_k is None else (_kind(new_k), _kind(new_v))
    return (_kind(q), _kind(k_pool), _kind(v_pool), _kind(page_table), _kind(table_idx),
            _kind(seq_lens), new, type(scale), scale, type(num_splits), num_splits,
            config if config is None else (config, tuple(map(type, config))), type(out_dtype),
            out_dtype, type(max_context), max_context, type(check), check)


def _tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(name, "must be a torch.Tensor", f"got {type(t).__name__}")
    return t


def _check_config(config, head_dim: int, dtype: torch.dtype) -> FastConfig:
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


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise InvalidArgument("scale", "None or a finite number > 0 (an int or a float)",
                              f"got {type(scale).__name__} {scale!r}")
    return float(scale)


def _check_kinds(q, k_pool, v_pool, page_table, table_idx, seq_lens) -> None:
    """Chapter 08's shape rules (:func:`kvlab.attention.check_paged_attention_inputs`) and the
    rules on dtypes, devices and layouts the fast kernels add; nothing here reads a value."""
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool), ("page_table", page_table),
                    ("table_idx", table_idx), ("seq_lens", seq_lens)):
        _tensor(name, t)
    if q.dim() != 3 or not q.dtype.is_floating_point:
        raise InvalidArgument("q", "a floating tensor [batch, heads, head_dim]", f"got {q.dtype} {list(q.shape)}")
    batch, heads, head_dim = q.shape
    if k_pool.dim() != 3 or k_pool.shape[2] != head_dim:
        raise InvalidArgument("k_pool", f"shape [num_slots, kv_heads, {head_dim}] (head_dim of q)",
                              f"got {list(k_pool.shape)}")
    kv_heads = k_pool.shape[1]
    if kv_heads == 0 or heads % kv_heads:
        raise InvalidArgument("k_pool", f"kv_heads must divide the {heads} query heads "
                              "(grouped-query attention)", f"got {kv_heads} K/V heads")
    if v_pool.shape != k_pool.shape:
        raise InvalidArgument("v_pool", "same shape as k_pool", f"{list(v_pool.shape)} vs {list(k_pool.shape)}")
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool)):
        if t.dtype not in POOL_DTYPES or t.dtype != k_pool.dtype:
            raise InvalidArgument(name, f"one dtype of {[str(d) for d in POOL_DTYPES]} for both pools",
                                  f"got {k_pool.dtype} and {v_pool.dtype}")
    if page_table.dim() != 2 or page_table.dtype not in (torch.int32, torch.int64):
        raise InvalidArgument("page_table", "a 2-D int32/int64 tensor [rows, cols]",
                              f"got {page_table.dtype} {list(page_table.shape)}")
    from .kernels.fast_attention import MAX_COLUMNS, MAX_REQUESTS

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


def _check_new(new_k, new_v, batch: int, k_pool) -> None:
    want = (batch, k_pool.shape[1], k_pool.shape[2])
    for name, t in (("k", new_k), ("v", new_v)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or not t.dtype.is_floating_point \
                or t.device != k_pool.device or t.stride(2) != 1:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidArgument(name, f"a floating tensor [batch, kv_heads, head_dim] = {list(want)} "
                                  "on the pools' device, head_dim contiguous", f"got {got}")


def _lse_offset(batch: int, heads: int, num_splits: int, head_dim: int) -> int:
    """Where the log-sum-exps start in the scratch, after the partial outputs: a multiple of
    four floats, so that both pointers are 16-byte aligned (what a kept kernel assumes)."""
    return -(-batch * heads * num_splits * head_dim // 4) * 4


def make_plan(q, k_pool, v_pool, page_table, table_idx, seq_lens, new_k, new_v, scale, num_splits,
              config, out_dtype, max_context, check) -> Plan:
    """Judge every host rule (raising :class:`InvalidArgument` for the first broken one) and
    work out the launches."""
    if not isinstance(check, bool):
        raise InvalidArgument("check", "True or False", f"got {check!r}")
    if check:
        _check_kinds(q, k_pool, v_pool, page_table, table_idx, seq_lens)
    batch, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    if new_k is not None:
        _check_new(new_k, new_v, batch, k_pool)
    config = _check_config(config, head_dim, k_pool.dtype)
    scale = _check_scale(scale, head_dim)
    if not (isinstance(out_dtype, torch.dtype) and out_dtype in OUT_DTYPES):
        raise InvalidArgument("out_dtype", f"a torch.dtype, one of {[str(d) for d in OUT_DTYPES]}",
                              f"got {type(out_dtype).__name__} {out_dtype!r}")
    if max_context is not None:
        max_context = check_int("max_context", max_context, minimum=1)
    if num_splits is None:
        context = page_table.shape[1] if max_context is None else max_context
        num_splits = choose_num_splits(batch, kv_heads, context, streaming_multiprocessors(q.device),
                                       config.block_n)
    else:
        num_splits = check_int("num_splits", num_splits, minimum=1)
        if num_splits > MAX_NUM_SPLITS:
            raise InvalidArgument("num_splits", f"1 <= num_splits <= {MAX_NUM_SPLITS}", f"got {num_splits}")
    group = heads // kv_heads
    low = k_pool.dtype in (torch.float16, torch.bfloat16) and q.device.type == "cuda"
    direct = num_splits == 1
    block_d = max(16, next_pow2(head_dim))
    o_strides = (heads * head_dim, head_dim, 0) if direct else (heads * num_splits * head_dim,
                                                                num_splits * head_dim, head_dim)
    l_strides = (0, 0) if direct else (heads * num_splits, num_splits)
    new_strides = (0, 0, 0, 0) if new_k is None else (*new_k.stride()[:2], *new_v.stride()[:2])
    pt_stride = page_table.shape[1] if page_table.stride(1) != 1 else page_table.stride(0)
    kv_strides = (k_pool.stride(0), k_pool.stride(1)) if k_pool.stride(2) == 1 and v_pool.stride() == k_pool.stride() \
        else (kv_heads * head_dim, head_dim)
    q_strides = (q.stride(0), q.stride(1)) if q.stride(2) == 1 else (heads * head_dim, head_dim)
    rows, cols = page_table.shape
    split_ints = (*q_strides, *kv_strides, pt_stride, *new_strides, *o_strides, *l_strides, head_dim,
                  rows, cols, k_pool.shape[0])
    split_consts = (group, max(16 if config.use_dot else 1, next_pow2(group)), config.block_n, block_d,
                    config.use_dot, low, direct, check, new_k is not None)
    merge_ints = (*o_strides, *l_strides, heads * head_dim, head_dim, head_dim, rows, cols)
    merge_consts = (config.block_n, block_d, check)
    return Plan(batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, num_splits=num_splits,
                scale=scale, out_dtype=out_dtype, device=q.device, check=check, store=new_k is not None,
                config=config, split_ints=split_ints, merge_ints=merge_ints, split_consts=split_consts,
                merge_consts=merge_consts, low_precision=low,
                lse_offset=_lse_offset(batch, heads, num_splits, head_dim),
                scratch_words=0 if direct else _lse_offset(batch, heads, num_splits, head_dim)
                + batch * heads * num_splits,
                status=_status_for(q.device), copy_q=q.stride(2) != 1,
                copy_pools=not (k_pool.stride(2) == 1 and v_pool.stride() == k_pool.stride()),
                copy_table=page_table.stride(1) != 1)


def plan_for(q, k_pool, v_pool, page_table, table_idx, seq_lens, new_k=None, new_v=None, scale=None,
             num_splits=None, config=None, out_dtype=torch.float32, max_context=None, check=True) -> Plan:
    """The plan of a call with these arguments: remembered by :func:`plan_key`, else judged."""
    try:
        key = plan_key(q, k_pool, v_pool, page_table, table_idx, seq_lens, new_k, new_v, scale, num_splits,
                       config, out_dtype, max_context, check)
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):   # not tensors, or an unhashable option: judged below
        key, plan = None, None
    if plan is None:
        plan = make_plan(q, k_pool, v_pool, page_table, table_idx, seq_lens, new_k, new_v, scale,
                         num_splits, config, out_dtype, max_context, check)
        if key is not None:
            if len(_PLANS) >= MAX_PLANS:
                for old in list(_PLANS)[: MAX_PLANS // 2]:
                    del _PLANS[old]
            plan.launch_key = key
            _PLANS[key] = plan
    return plan


# --- the launches ---------------------------------------------------------------------------------


_SPLIT: Launcher | None = None
_MERGE: Launcher | None = None


def _launchers() -> tuple[Launcher, Launcher]:
    global _SPLIT, _MERGE
    if _SPLIT is None:
        from .kernels.fast_attention import merge_splits_kernel, split_decode_kernel

        _SPLIT, _MERGE = Launcher(split_decode_kernel), Launcher(merge_splits_kernel)
    return _SPLIT, _MERGE


def as_index_vector(name: str, t, device: torch.device) -> torch.Tensor:
    """``table_idx`` / ``seq_lens`` as the kernels read them: a contiguous 1-D integer tensor on
    ``device`` (a list, a NumPy array, a tensor elsewhere or of another shape is converted; a
    tensor already so is returned as it is)."""
    if isinstance(t, torch.Tensor) and t.dim() == 1 and t.device == device and t.stride(0) == 1 \
            and not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        return t
    try:
        t = torch.as_tensor(t)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise InvalidArgument(name, "a 1-D integer tensor, or a list of ints",
                              f"got {type(t).__name__}: {e}") from None
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise InvalidArgument(name, "integers", f"got {t.dtype}")
    return t.to(device=device, dtype=torch.int64).flatten().contiguous()


def attend(q, k_pool, v_pool, page_table, table_idx, seq_lens, *, new_k=None, new_v=None, scale=None,
           num_splits=None, config=None, out_dtype=torch.float32, max_context=None,
           check=True) -> torch.Tensor:
    """:func:`kvlab.attention.fast_paged_decode_attention` (its contract), and with
    ``new_k``/``new_v`` the decode step's store first (``check=False`` only: see
    :mod:`kvlab.kernels.fast_attention`)."""
    device = getattr(q, "device", None)
    if device is not None and not (type(table_idx) is torch.Tensor and type(seq_lens) is torch.Tensor
                                   and table_idx.device == device and seq_lens.device == device):
        table_idx, seq_lens = as_index_vector("table_idx", table_idx, device), as_index_vector("seq_lens", seq_lens, device)
    plan = plan_for(q, k_pool, v_pool, page_table, table_idx, seq_lens, new_k, new_v, scale, num_splits,
                    config, out_dtype, max_context, check)
    status = plan.status
    if plan.check and status.host is not None and status.host[0]:
        _raise_pending(status)       # an earlier call's refusal, found without waiting
    if table_idx.dim() != 1 or table_idx.stride(0) != 1:
        table_idx = table_idx.flatten().contiguous()
    if seq_lens.dim() != 1 or seq_lens.stride(0) != 1:
        seq_lens = seq_lens.flatten().contiguous()
    out = torch.empty((plan.batch, plan.heads, plan.head_dim), dtype=plan.out_dtype, device=plan.device)
    if plan.batch == 0:
        return out
    if plan.copy_q:
        q = q.contiguous()
    if plan.copy_pools:
        if plan.store:
            raise InvalidArgument("k_pool", "a pool whose rows are contiguous (the step stores into it)",
                                  f"got strides {k_pool.stride()} and {v_pool.stride()}")
        k_pool, v_pool = k_pool.contiguous(), v_pool.contiguous()
    if plan.copy_table:
        page_table = page_table.contiguous()
    direct = plan.num_splits == 1
    if direct:
        o = lse = out
    else:
        scratch = torch.empty(plan.scratch_words, dtype=torch.float32, device=plan.device)
        o = scratch
        lse = scratch[plan.lse_offset:]
    new_k = q if new_k is None else new_k
    new_v = q if new_v is None else new_v
    _launch(plan, q, k_pool, v_pool, page_table, table_idx, seq_lens, new_k, new_v, o, lse, out)
    if plan.check and status.host is None and int(status.tensor[0]):   # the interpreter: at once
        word = int(status.tensor[0])
        status.tensor.zero_()
        raise _refusal(word, (table_idx, seq_lens, page_table, k_pool.shape[0]))
    return out


def _launch(plan: Plan, q, k_pool, v_pool, page_table, table_idx, seq_lens, new_k, new_v, o, lse, out) -> None:
    split_entry, merge_entry = plan.split_entry, plan.merge_entry
    direct = plan.num_splits == 1
    if split_entry is not None:
        ptrs = (q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), page_table.data_ptr(), table_idx.data_ptr(),
                seq_lens.data_ptr(), new_k.data_ptr(), new_v.data_ptr(), o.data_ptr(), lse.data_ptr())
        aligned = not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4] | ptrs[5] | ptrs[6] | ptrs[7]
                       | ptrs[8] | ptrs[9]) & 15
        stream = launch_ready(plan.device.index) if aligned else None
        if stream is not None and (direct or merge_entry is not None):
            split_entry(plan.batch, plan.kv_heads, plan.num_splits, stream,
                        (*ptrs, plan.status.address, plan.scale, plan.num_splits, *plan.split_ints,
                         *plan.split_consts))
            if not direct:
                merge_entry(plan.batch, plan.heads, 1, stream,
                            (ptrs[8], ptrs[9], ptrs[4], ptrs[5], out.data_ptr(), plan.num_splits,
                             *plan.merge_ints, *plan.merge_consts))
            return
    # Triton's own launch: the first call of a plan (which keeps the compiled kernels when
    # it can), an unaligned pointer, a launch hook, or the interpreter
    split, merge = _launchers()
    options = dict(num_warps=plan.config.num_warps, num_stages=plan.config.num_stages)
    split_args = (q, k_pool, v_pool, page_table, table_idx, seq_lens, new_k, new_v, o, lse, plan.status.tensor,
                  plan.scale, plan.num_splits, *plan.split_ints, *plan.split_consts)
    merge_args = (o, lse, table_idx, seq_lens, out, plan.num_splits, *plan.merge_ints, *plan.merge_consts)
    tensors = split_args[:10] + (out,)
    keep = (split.direct and plan.launch_key is not None and plan.split_entry is None
            and not any(t.data_ptr() & 15 for t in tensors))
    grid = (plan.batch, plan.kv_heads, plan.num_splits)
    if keep:
        split.launch_and_keep(grid, split_args, plan.launch_key, options)
        if not direct:
            merge.launch_and_keep((plan.batch, plan.heads), merge_args, plan.launch_key, {})
        device = plan.device.index
        plan.merge_entry = None if direct else merge.grid_entry_for(device, plan.launch_key)
        plan.split_entry = split.grid_entry_for(device, plan.launch_key)
        return
    split.kernel[grid](*split_args, **options)
    if not direct:
        merge.kernel[(plan.batch, plan.heads)](*merge_args)
