"""Serve a Hugging Face causal LM through kvlab's cache manager, token for token (chapter 10).

:class:`PagedGenerator` is a small continuous-batching server loop. Its memory is kvlab's:
a :class:`~kvlab.CacheManager` (free pages, page table, radix prefix cache) and a
:class:`~kvlab.KVPool` with one K and one V row per token slot and layer. The model is the
user's own transformers model; kvlab swaps in only its attention function
(:mod:`kvlab.hf.plugin`), so norms, RoPE and MLPs run as the model's authors wrote them.

One **step** of the loop::

    waiting ──admit──► new requests   (match the prompt in the radix cache, lock the hit)
                │
                ▼
    mixed_step(new, running)          (one allocate_paged: pages for the new prompts' uncached
                │                      positions, and a page for each running request that
                │                      crosses a boundary)
                ▼
    one forward over the packed tokens of the step, one row of position ids:
        [ new A: positions 12..20 | new B: 16..30 | running C: 41 | running D: 7 ]
        every layer: K/V of all these tokens -> pool slots (page table); then
          several tokens of a request (a prompt)  -> prefill attention through its row (torch)
          one token of a request (decoding)       -> the Triton paged decode kernel (GQA)
                │
                ▼
    greedy token per request; complete_step: cache_req(finished=False) for the new ones (their
    prompt pages join the prefix cache at once), cache_req(finished=True) for the finished ones
    (EOS or max_new_tokens), whose rows go back to the waiting requests

A request is admitted only if the pages it may still need (prompt + ``max_new_tokens`` - 1
positions, minus its cache hit) fit beside what the running requests may still need, counting
evictable cached pages as free -- so no step can run out of pages half-way. A request that can
never fit raises :class:`~kvlab.OutOfPages` before anything changes. A request whose prompt
shares whole pages with a request admitted in the same step waits one step, then reads those
pages from the cache instead of computing them again (SGLang's in-batch prefix caching).

The loop speaks to :class:`~kvlab.CacheManager` in its serving words: ``admit`` and
``available_pages`` to decide who runs (this loop's policy: one request at a time, with page
reservations and in-batch sharing), ``mixed_step`` to map a step that prefills new requests
and decodes running ones in one pass, and ``complete_step`` to record the tokens, cache the new
prompts' pages and end the finished requests -- the same words the simulator (chapter 07) and
chapter 08's engine use.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch

from ..args import check_int, check_page_size, check_token_ids, div_ceil
from ..errors import InvalidArgument, OutOfPages
from .attention import check_rows_mapped, paged_attention_step, prefill_attention
from .plugin import (check_generation_config, check_model, eos_token_ids, paged_attention_active,
                     register_attention)

__all__ = ["PagedGenerator", "RequestStats", "StepInfo", "StepBatch"]


class RequestStats(NamedTuple):
    """What one request of the last :meth:`PagedGenerator.generate` call cost and produced."""

    prompt_len: int
    cached: int        # prompt tokens whose K/V came from the prefix cache
    computed: int      # prompt tokens whose K/V the prefill computed
    generated: int     # new tokens (the EOS token included when it ended the request)
    finished_by: str   # "eos" or "length"


class StepInfo(NamedTuple):
    """One step of the loop, for ``on_step``: which requests (prompt indices) did what."""

    index: int
    prefill: list[int]    # admitted in this step: their prompts were computed
    decode: list[int]     # running: one new token each
    tokens: int           # tokens in the step's forward pass


@dataclass
class StepBatch:
    """Where the K/V of one step's packed tokens go and what each token attends to.

    Built once per step (and checked once), read by every layer's attention call. Token
    ``i`` of the step belongs to a request whose K/V it writes at ``out_loc[i]``.
    """

    pool: object                  # kvlab.KVPool: pool.k[layer], pool.v[layer]
    page_table: torch.Tensor
    out_loc: torch.Tensor         # [N] slot of each packed token
    extend_index: torch.Tensor    # packed indices of the tokens of multi-token requests
    extends: list                 # (offset, length, start, slots of positions 0..end-1)
    single_index: torch.Tensor    # packed index of each one-token request (decoding)
    single_rows: torch.Tensor     # its page-table row
    single_positions: torch.Tensor  # its token's position
    decode_step: Callable | None = None  # a replacement for paged_attention_step (chapter 10)

    def attend(self, layer: int, query, key, value, scale) -> torch.Tensor:
        """HF layout in (``[1, heads, N, d]``, K/V ``[1, kv_heads, N, d]``), ``[1, N, heads, d]`` out."""
        q = query[0].transpose(0, 1)                  # [N, heads, head_dim]
        k = key[0].transpose(0, 1)                    # [N, kv_heads, head_dim]
        v = value[0].transpose(0, 1)
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        if self.extends:
            idx = self.extend_index
            k_pool[self.out_loc[idx]] = k[idx].to(k_pool.dtype)   # the prompts' new K/V first
            v_pool[self.out_loc[idx]] = v[idx].to(v_pool.dtype)
            for offset, length, start, slots in self.extends:
                out[offset:offset + length] = prefill_attention(
                    q[offset:offset + length], k_pool, v_pool, slots, start, scale)
        if self.single_index.numel():
            s = self.single_index
            args = (q[s], k[s], v[s], k_pool, v_pool, self.page_table, self.single_rows,
                    self.single_positions, scale)
            if self.decode_step is None:
                out[s] = paged_attention_step(*args, check=False)   # checked once for the step
            else:
                out[s] = self.decode_step(*args).float()
        return out.to(query.dtype)[None]


@dataclass(eq=False)
class _Seq:
    """One prompt's journey through the loop."""

    index: int
    prompt: list[int]
    req: object = None            # kvlab.Req while admitted
    cached: int = 0
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    finished_by: str = ""


class PagedGenerator:
    """Greedy generation for a Llama-family or Qwen2 transformers model, K/V in kvlab's pool.

    ``gen = PagedGenerator(model, page_size=16, num_pages=256)``;
    ``gen.generate(prompts, max_new_tokens=32)`` returns, per prompt (a list of token ids),
    the new tokens -- exactly those of ``model.generate(..., do_sample=False)`` for that
    prompt alone, EOS included when it ends the answer. The prefix cache outlives a call: a
    later call whose prompts repeat earlier text (a conversation that re-sends its history)
    computes only what is new. ``gen.stats`` counts the last call's work.

    ``max_running``: page-table rows, i.e. requests decoding at once (the rest wait);
    ``max_seq_len``: positions per row (default: the pool, up to the model's
    ``max_position_embeddings``); ``decode_step``: a function with the signature of
    :func:`kvlab.hf.paged_attention_step` to use instead of it (chapter 10's exercise).
    """

    def __init__(self, model, page_size: int = 16, num_pages: int = 256, *, max_running: int = 16,
                 max_seq_len: int | None = None, decode_step: Callable | None = None):
        from ..cache_manager import CacheManager
        from ..kvcache import KVPool
        from ..paging import new_page_table

        check_model(model)
        self.model = model
        self.page_size = check_page_size(page_size)
        self.num_pages = check_int("num_pages", num_pages, minimum=1)
        self.max_running = check_int("max_running", max_running, minimum=1)
        c = model.config
        if max_seq_len is None:
            max_seq_len = min(self.num_pages * self.page_size,
                              getattr(c, "max_position_embeddings", None) or 1 << 62)
        max_seq_len = check_int("max_seq_len", max_seq_len, minimum=1)
        if decode_step is not None and not callable(decode_step):
            raise InvalidArgument("decode_step", "a function like kvlab.hf.paged_attention_step",
                                  f"got {type(decode_step).__name__}")
        self.decode_step = decode_step
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        device = model.device
        self.page_table = new_page_table(self.max_running, max_seq_len, self.page_size, device)
        self.manager = CacheManager(self.num_pages, self.page_size, self.page_table)
        self.pool = KVPool(self.num_pages * self.page_size, c.num_hidden_layers, kv_heads, head_dim,
                           dtype=model.dtype, device=device)
        self.stats: dict[str, int] = {}
        self.requests: list[RequestStats] = []
        self.logits: list[torch.Tensor] = []
        register_attention()

    # --- the public call ------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32, *,
                 output_logits: bool = False,
                 on_step: Callable[[StepInfo], None] | None = None) -> list[list[int]]:
        """New tokens per prompt (greedy; stops at EOS as ``generate`` does).

        ``output_logits=True`` keeps, in ``self.logits[i]``, the float32 logits behind each
        token of prompt ``i`` (``[new_tokens, vocab]``, on the CPU). ``on_step(StepInfo)``
        is called after every step (e.g. to photograph ``self.page_table``). Checks
        everything first: bad prompts raise :class:`~kvlab.InvalidArgument` and a prompt
        the pool can never hold raises :class:`~kvlab.OutOfPages`, with nothing changed.
        """
        seqs, max_new = self._check(prompts, max_new_tokens)
        eos = eos_token_ids(self.model)
        waiting: deque[_Seq] = deque(seqs)
        running: list[_Seq] = []
        free_rows = list(range(self.max_running))
        stats = dict(requests=len(seqs), prefill_computed=0, prefill_cached=0, generated=0,
                     steps=0, prefill_steps=0, decode_tokens=0, deferred=0, most_running=0)
        live: list[_Seq] = []     # admitted and not finished: released if anything goes wrong
        try:
            with paged_attention_active(self.model), torch.inference_mode():
                while waiting or running:
                    # 1. admit waiting requests while rows and pages last (match + lock their hits)
                    new = self._admit(waiting, running, free_rows, max_new, stats)
                    live += new
                    batch = new + running
                    if not batch:  # _check made sure each request fits an idle pool: never spin
                        raise AssertionError("kvlab.hf: no request could be admitted to an idle pool")
                    # 2. map the new prompts and one more position of each running request
                    step = self.manager.mixed_step([s.req for s in new], [s.req for s in running])
                    # 3. one forward pass over the step's packed tokens
                    logits = self._forward(step)
                    tokens = logits.argmax(-1).tolist()
                    done = []
                    for seq, row_logits, token in zip(batch, logits, tokens):
                        seq.tokens.append(token)
                        if output_logits:
                            seq.logits.append(row_logits.float().cpu())
                        if token in eos or len(seq.tokens) == max_new:
                            seq.finished_by = "eos" if token in eos else "length"
                        done.append(bool(seq.finished_by))
                    # 4. record the tokens; new prompts' pages join the cache, finished requests end
                    self.manager.complete_step(step, tokens, done)
                    for seq in batch:
                        if seq.finished_by:
                            free_rows.append(seq.req.table_idx)
                            live.remove(seq)
                    running = [s for s in batch if not s.finished_by]
                    stats["steps"] += 1
                    stats["prefill_steps"] += bool(new)
                    stats["decode_tokens"] += len(batch) - len(new)
                    stats["most_running"] = max(stats["most_running"], len(batch))
                    if on_step is not None:
                        on_step(StepInfo(stats["steps"] - 1, [s.index for s in new],
                                         [s.index for s in batch if s not in new],
                                         sum(s.req.cached_len - s.cached if s in new else 1 for s in batch)))
        except BaseException:
            for seq in live:                 # give their pages back; the cache keeps what it has
                if seq.req is not None and not seq.req.finished:
                    self.manager.release_req(seq.req)
            raise
        self.manager.check_integrity()
        stats["generated"] = sum(len(s.tokens) for s in seqs)
        self.stats = stats
        self.requests = [RequestStats(len(s.prompt), s.cached, len(s.prompt) - s.cached,
                                      len(s.tokens), s.finished_by) for s in seqs]
        self.logits = [torch.stack(s.logits) for s in seqs] if output_logits else []
        return [s.tokens for s in seqs]

    # --- before anything changes ----------------------------------------------------------

    def _check(self, prompts, max_new_tokens) -> tuple[list[_Seq], int]:
        max_new = check_int("max_new_tokens", max_new_tokens, minimum=1)
        if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, Sequence):
            raise InvalidArgument("prompts", "a list of prompts, each a list of token ids",
                                  f"got {type(prompts).__name__}")
        if len(prompts) == 0:
            raise InvalidArgument("prompts", "at least one prompt", "got none")
        check_generation_config(self.model)
        vocab = self.model.config.vocab_size
        cols = self.page_table.shape[1]
        P = self.page_size
        seqs = []
        for i, prompt in enumerate(prompts):
            ids = check_token_ids(f"prompts[{i}]", prompt)
            if not ids:
                raise InvalidArgument(f"prompts[{i}]", "at least one token", "got an empty prompt")
            if min(ids) < 0 or max(ids) >= vocab:
                raise InvalidArgument(f"prompts[{i}]", f"token ids in [0, {vocab}) (the model's vocabulary)",
                                      f"got min {min(ids)}, max {max(ids)}")
            positions = len(ids) + max_new - 1   # the last new token's K/V is never computed
            if positions > cols:
                raise InvalidArgument(f"prompts[{i}]", f"len(prompt) + max_new_tokens - 1 <= {cols} "
                                      "(positions of a page-table row: max_seq_len)",
                                      f"got {len(ids)} + {max_new} - 1")
            if div_ceil(positions, P) > self.num_pages:
                raise OutOfPages(div_ceil(positions, P), self.num_pages,
                                 f"request (prompts[{i}]: {len(ids)} prompt tokens + {max_new} new, "
                                 f"pages of {P}; the pool has {self.num_pages} pages in all)")
            seqs.append(_Seq(i, ids))
        return seqs, max_new

    # --- scheduling -----------------------------------------------------------------------

    def _pages_to_come(self, seq: _Seq, max_new: int) -> int:
        """Pages ``seq`` may still allocate: all it may ever map minus what its row maps now."""
        total = div_ceil(len(seq.prompt) + max_new - 1, self.page_size)
        return total - self.manager.allocated_pages(seq.req)

    def _admit(self, waiting: deque, running: list, free_rows: list, max_new: int,
               stats: dict) -> list[_Seq]:
        """Admit waiting requests (in order) while rows and pages last."""
        from ..req import Req

        P = self.page_size
        admitted: list[_Seq] = []
        for seq in list(waiting):
            if not free_rows:
                break
            req = Req(list(seq.prompt), table_idx=free_rows[0])
            hit = self.manager.match_req(req).handle.cached_len   # prompt[:-1] in the radix cache
            # whole pages it shares with a prompt admitted in this step: wait, then hit them
            shared = max((_common_prefix(seq.prompt[:-1], a.prompt) // P * P for a in admitted),
                         default=0)
            if shared > hit:
                stats["deferred"] += 1
                continue
            seq.req = req
            self.manager.admit(req)           # match + lock the hit + map it into the row
            reserved = sum(self._pages_to_come(s, max_new) for s in running + admitted + [seq])
            if reserved > self.manager.available_pages:   # free + evictable pages
                self.manager.release_req(req)   # not now: rows, pages and locks as before
                seq.req = None
                break
            free_rows.pop(0)
            waiting.remove(seq)
            seq.cached = seq.req.cached_len
            stats["prefill_cached"] += seq.cached
            stats["prefill_computed"] += len(seq.prompt) - seq.cached
            admitted.append(seq)
        return admitted

    # --- one forward step ------------------------------------------------------------------

    def _forward(self, step) -> torch.Tensor:
        """Run the model once over every request's new tokens of ``step`` (a
        :class:`~kvlab.req.ForwardBatch`, pages mapped), return the logits of each request's
        last token (``[len(step), vocab]``)."""
        device = self.page_table.device
        lengths = list(step.extend_lens)               # decode: 1
        ends = step.seq_lens()
        req_rows = step.rows()
        check_rows_mapped(self.page_table, req_rows, ends, self.pool.num_slots)  # once per step
        positions_t = step.positions()
        out_loc = step.out_loc().long()
        offsets = [sum(lengths[:b]) for b in range(len(step))]
        extends, extend_index, single = [], [], []
        for b in range(len(step)):
            if lengths[b] == 1:
                single.append(b)
            else:
                extends.append((offsets[b], lengths[b], step.start[b], step.slots(b).long()))
                extend_index += range(offsets[b], offsets[b] + lengths[b])
        batch = StepBatch(
            pool=self.pool, page_table=self.page_table, out_loc=out_loc,
            extend_index=torch.tensor(extend_index, dtype=torch.long, device=device),
            extends=extends,
            single_index=torch.tensor([offsets[b] for b in single], dtype=torch.long, device=device),
            single_rows=req_rows[single].long(),
            single_positions=ends[single].long() - 1,
            decode_step=self.decode_step)
        last = torch.tensor([o + n - 1 for o, n in zip(offsets, lengths)], device=device)
        out = self.model(input_ids=step.input_ids()[None], position_ids=positions_t[None],
                         use_cache=False, logits_to_keep=last, kvlab_step=batch)
        return out.logits[0]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
