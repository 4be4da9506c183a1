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
  (:mod:`kvlab.attention.split_kernels`, ``CHECK``): a refused request reads nothing outside
  the pool and its output is NaN; the first refusal is recorded (:mod:`kvlab.attention.attention_rules`:
  a word in device memory, and a flag in pinned host memory that the host reads where it
  lies). In the interpreter (CPU tensors: reading them is free) the call raises it at once. On
  a GPU the host never waits for it: the next checked call on that device sees the flag and
  raises the refusal, or :func:`~kvlab.attention.attention_rules.check_attention_errors` does (it waits);
* **the split count** comes from the multiprocessor count, asked once per device;
* **the launch**: after a plan's first call the compiled kernels are kept and launched through
  their C launchers with addresses (:mod:`kvlab.base.launch`), not through Triton's
  per-call bookkeeping (binding, specialisation, cache key: tens of microseconds per launch).

Every int a kernel takes comes from the plan's shapes and strides, so a kept kernel was
compiled for exactly these values; its pointers were 16-byte aligned (what Triton specialises
on), and a later call with an unaligned pointer takes Triton's own launch.
"""
from __future__ import annotations

import torch

from ..base.args import check_int, next_pow2
from .attention_options import MAX_NUM_SPLITS, choose_num_splits, streaming_multiprocessors
from .attention_rules import (OUT_DTYPES, check_config, check_kinds, check_new, check_scale_value, raise_pending,
                              refusal, status_for, take_refusal)
from ..base.errors import InvalidArgument
from ..base.launch import Launcher, launch_ready

__all__ = ["Plan", "plan_key", "make_plan", "plan_for", "attend", "as_index_vector"]

#: plans remembered (each a few hundred bytes); past it the oldest half is dropped
MAX_PLANS = 1024

# --- the plan: every host rule, judged once per key ------------------------------------------


class Plan:
    """What a call with these kinds of arguments launches, judged valid (see the module
    docstring). Built by :func:`plan_for`; the kept kernels' entries are filled in by the first
    call that launches them."""

    __slots__ = ("batch", "heads", "kv_heads", "head_dim", "num_splits", "scale", "out_dtype",
                 "device", "check", "store", "config", "split_ints", "merge_ints", "split_consts",
                 "merge_consts", "scratch_words", "status", "copy_q", "copy_pools", "copy_table",
                 "split_entry", "merge_entry", "launch_key", "low_precision", "lse_offset", "kept")

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
        check_kinds(q, k_pool, v_pool, page_table, table_idx, seq_lens)
    batch, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    if new_k is not None:
        check_new(new_k, new_v, batch, k_pool)
    config = check_config(config, head_dim, k_pool.dtype)
    scale = check_scale_value(scale, head_dim)
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
                status=status_for(q.device), copy_q=q.stride(2) != 1,
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
        from .split_kernels import merge_splits_kernel, split_decode_kernel

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
    :mod:`kvlab.attention.split_kernels`)."""
    device = getattr(q, "device", None)
    if device is not None and not (type(table_idx) is torch.Tensor and type(seq_lens) is torch.Tensor
                                   and table_idx.device == device and seq_lens.device == device):
        table_idx, seq_lens = as_index_vector("table_idx", table_idx, device), as_index_vector("seq_lens", seq_lens, device)
    plan = plan_for(q, k_pool, v_pool, page_table, table_idx, seq_lens, new_k, new_v, scale, num_splits,
                    config, out_dtype, max_context, check)
    status = plan.status
    if plan.check and status.host is not None and status.host[0]:
        raise_pending(status)       # an earlier call's refusal, its flag read without waiting
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
    if plan.check and status.host is None:                 # the interpreter: at once
        word = take_refusal(status)
        if word:
            raise refusal(word, (table_idx, seq_lens, page_table, k_pool.shape[0]))
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
                        (*ptrs, *plan.status.addresses, plan.scale, plan.num_splits, *plan.split_ints,
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
    split_args = (q, k_pool, v_pool, page_table, table_idx, seq_lens, new_k, new_v, o, lse, plan.status.word,
                  plan.status.flag, plan.scale, plan.num_splits, *plan.split_ints, *plan.split_consts)
    merge_args = (o, lse, table_idx, seq_lens, out, plan.num_splits, *plan.merge_ints, *plan.merge_consts)
    tensors = split_args[:10] + (out,)
    keep = (split.direct and plan.launch_key is not None and not plan.kept
            and not any(t.data_ptr() & 15 for t in tensors))
    grid = (plan.batch, plan.kv_heads, plan.num_splits)
    if keep:
        split.launch_and_keep(grid, split_args, plan.launch_key, options)
        if not direct:
            merge.launch_and_keep((plan.batch, plan.heads), merge_args, plan.launch_key, {})
        device = plan.device.index
        plan.merge_entry = None if direct else merge.grid_entry_for(device, plan.launch_key)
        plan.split_entry = split.grid_entry_for(device, plan.launch_key)
        plan.kept = True          # (once: a kernel Triton cannot launch from its C entry stays on its path)
        return
    split.kernel[grid](*split_args, **options)
    if not direct:
        merge.kernel[(plan.batch, plan.heads)](*merge_args)
