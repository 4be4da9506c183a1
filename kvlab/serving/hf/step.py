"""One forward step of the serving loop, as every layer's attention call reads it (chapter 10).

A step is one forward pass over the new tokens of several requests, packed into one row::

    packed tokens   [ A: prompt chunk, positions 0..7 | B: positions 16..20 | C: 41 | D: 7 ]
                      prefill (several tokens each)                         decode (one each)

:func:`build_step` turns the cache manager's :class:`~kvlab.manager.req.ForwardBatch` into what the
model and the attention function need -- token ids, positions, each token's K/V slot, which
tokens are prompts and which decode -- with **one** host-to-device copy from pinned memory,
so building a step never makes the host wait for the GPU (a copy from ordinary pageable
memory does). :class:`StepBatch` is what the attention function (:mod:`kvlab.serving.hf.plugin`)
receives as ``kvlab_step``; a decode-only step of the CUDA graphs (:mod:`kvlab.serving.hf.graphs`)
is a :class:`StepBatch` too, with every token a decode token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

from torch.nn.attention import SDPBackend, sdpa_kernel

from .attention_steps import paged_attention_step, prefill_attention, prefill_mask

__all__ = ["StepBatch", "StepInputs", "build_step", "to_device"]

#: what torch may run a prompt's attention with: its fused kernels, or plain matrix products
#: (where they do not apply). Not cuDNN's attention, which builds a plan for every new shape
#: the first time it meets it -- in a server, every prompt length is a new shape
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

#: each part of a packed copy starts on a multiple of this many int64s (128 bytes): a Triton
#: kernel compiled for an aligned pointer then stays valid for every step (no recompile)
_ALIGN = 16


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without a sync: on CUDA the copy goes from pinned memory and does
    not wait (the caching host allocator keeps the pinned block until the copy is done)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def pack(parts: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """Several lists of ints as int64 tensors on ``device``, in one copy (see :func:`to_device`)."""
    starts, total = [], 0
    for part in parts:
        starts.append(total)
        total += -(-len(part) // _ALIGN) * _ALIGN
    host = torch.zeros(max(total, 1), dtype=torch.int64)
    for start, part in zip(starts, parts):
        if len(part):
            host[start:start + len(part)] = torch.as_tensor(part, dtype=torch.int64)
    dev = to_device(host, device)
    return [dev[s:s + len(p)] for s, p in zip(starts, parts)]


class Extend(NamedTuple):
    """Several new tokens of one request (a prompt or a chunk of one) in a step."""

    offset: int            # where its tokens start among the step's packed tokens
    length: int            # how many
    start: int             # the position of its first new token (= its cached_len)
    slots: torch.Tensor    # its row's slots of positions 0 .. start+length-1 (a view)
    mask: torch.Tensor     # which positions each query reads (prefill_mask), built once per step


@dataclass
class StepBatch:
    """Where the K/V of one step's packed tokens go and what each token attends to.

    Built once per step, read by every layer's attention call. Token ``i`` of the step
    writes its K/V at ``out_loc[i]``. ``single_index=None``: every token is a decode token
    (a decode-only step, as the CUDA graphs run it); then ``out_loc`` is not needed, since
    the decode step finds each slot through the page table itself.
    """

    pool: object                  # kvlab.KVPool: pool.k[layer], pool.v[layer]
    page_table: torch.Tensor
    single_rows: torch.Tensor     # each decode token's page-table row
    single_positions: torch.Tensor  # ... and its position
    single_index: torch.Tensor | None = None   # packed index of each decode token (None: all)
    out_loc: torch.Tensor | None = None        # [N] slot of each packed token
    extend_index: torch.Tensor | None = None   # packed indices of the prefill tokens
    extends: Sequence[Extend] = ()
    decode_step: Callable | None = None  # a replacement for paged_attention_step (chapter 10)
    attention: str = "fast"       # paged_attention_step's impl: chapter 09's kernels or 08's
    single_slots: torch.Tensor | None = None     # page_table[single_rows, single_positions] ...
    single_seq_lens: torch.Tensor | None = None  # ... and single_positions + 1, once per step

    def attend(self, layer: int, query, key, value, scale) -> torch.Tensor:
        """HF layout in (``[1, heads, N, d]``, K/V ``[1, kv_heads, N, d]``), ``[1, N, heads, d]`` out."""
        q = query[0].transpose(0, 1)                  # [N, heads, head_dim]
        k = key[0].transpose(0, 1)                    # [N, kv_heads, head_dim]
        v = value[0].transpose(0, 1)
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
        if self.single_index is None:                 # a decode-only step: one call for all
            return self._decode(q, k, v, k_pool, v_pool, scale).to(query.dtype)[None]
        out = torch.empty(q.shape, dtype=query.dtype, device=q.device)
        if self.extends:
            idx = self.extend_index
            k_pool[self.out_loc[idx]] = k[idx].to(k_pool.dtype)   # the prompts' new K/V first
            v_pool[self.out_loc[idx]] = v[idx].to(v_pool.dtype)
            with sdpa_kernel(PREFILL_BACKENDS):
                for e in self.extends:
                    out[e.offset:e.offset + e.length] = prefill_attention(
                        q[e.offset:e.offset + e.length], k_pool, v_pool, e.slots, e.start, scale,
                        mask=e.mask, check=False).to(out.dtype)
        if self.single_index.numel():
            s = self.single_index
            out[s] = self._decode(q[s], k[s], v[s], k_pool, v_pool, scale).to(out.dtype)
        return out[None]

    def _decode(self, q, k, v, k_pool, v_pool, scale) -> torch.Tensor:
        args = (q, k, v, k_pool, v_pool, self.page_table, self.single_rows,
                self.single_positions, scale)
        if self.decode_step is None:                   # the loop checked the step
            return paged_attention_step(*args, check=False, impl=self.attention, slots=self.single_slots,
                                        seq_lens=self.single_seq_lens, out_dtype=q.dtype)
        return self.decode_step(*args)


class StepInputs(NamedTuple):
    """What the model's forward pass of one packed step takes, all on the page table's device."""

    input_ids: torch.Tensor       # [N]
    positions: torch.Tensor       # [N]
    keep: torch.Tensor            # packed index of each token whose logits are wanted
    batch: StepBatch              # the attention calls' view of the step
    keep_rows: torch.Tensor       # the page-table row of each of those tokens' requests
    decode_index: torch.Tensor    # packed index of each decoding request's token ...
    decode_rows: torch.Tensor     # ... and its row (overlap: its id is read on the device)


def build_step(step, pool, page_table: torch.Tensor, keep: Sequence[bool], group: int,
               decode_step: Callable | None = None, attention: str = "fast") -> StepInputs:
    """The model's inputs for the :class:`~kvlab.manager.req.ForwardBatch` ``step`` (pages mapped).

    ``keep[b]``: request ``b`` wants the logits of its last token of the step (a chunk of a
    prompt that goes on in a later step does not); ``group``: query heads per K/V head;
    ``attention``: the decode kernels (``"fast"`` or ``"teaching"``, see
    :func:`~kvlab.serving.hf.attention_steps.paged_attention_step`).
    Every index is built on the host in
    plain lists and reaches the device in one copy; the slots are looked up on the device
    (``page_table[row, position]``), so nothing here waits for the GPU.
    """
    device = page_table.device
    ids, positions, token_rows, extend_index, single_index, rows, singles, last = ([] for _ in range(8))
    keep_rows, decode_index, decode_rows = [], [], []
    spans = []
    offset = 0
    for b, (req, row, start, end) in enumerate(zip(step.reqs, step.table_idx, step.start, step.end)):
        n = end - start
        ids += req.input_ids[start:end]
        positions += range(start, end)
        token_rows += [row] * n
        if n == 1:
            single_index.append(offset)
            rows.append(row)
            singles.append(start)
        else:
            extend_index += range(offset, offset + n)
            spans.append((offset, n, start, row))
        if not step.prefilling[b]:
            decode_index.append(offset)
            decode_rows.append(row)
        if keep[b]:
            last.append(offset + n - 1)
            keep_rows.append(row)
        offset += n
    (ids_t, pos_t, rows_t, ext_t, single_t, srows_t, spos_t, last_t, krows_t, dec_t, drows_t) = pack(
        [ids, positions, token_rows, extend_index, single_index, rows, singles, last, keep_rows,
         decode_index, decode_rows], device)
    extends = [Extend(o, n, s, page_table[r, :s + n].long(), prefill_mask(s, n, group, device))
               for o, n, s, r in spans]
    batch = StepBatch(pool=pool, page_table=page_table, single_rows=srows_t, single_positions=spos_t,
                      single_index=single_t, out_loc=page_table[rows_t, pos_t].long(),
                      extend_index=ext_t, extends=extends, decode_step=decode_step,
                      attention=attention)
    return StepInputs(ids_t, pos_t, last_t, batch, krows_t, dec_t, drows_t)
