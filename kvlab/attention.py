"""Attention that reads K/V through the page table, and a tiny model that proves the memory
manager right. Built in chapter 08 (capstone).

Three pieces:

* :class:`KVPool` -- per layer a K and a V tensor of shape ``[num_slots, heads, head_dim]``;
  ``store_kv(k, v, out_loc, layer)`` writes one row per new token at the slots the allocator
  handed out.
* paged decode attention -- one new query per request attends to the request's tokens
  ``[0, seq_len)``, found through its page-table row: a plain-torch reference
  (:func:`paged_decode_attention_reference`) and a checked wrapper around the Triton kernel
  (:func:`paged_decode_attention`, kernel in :mod:`kvlab.kernels.attention`).
* :class:`TinyTransformer` -- seeded random weights, no downloads -- with two ways to
  generate: through kvlab's :class:`~kvlab.CacheManager` and the pool
  (:func:`generate_paged`), and with a plain contiguous KV cache per request
  (:func:`generate_contiguous`), the baseline the paged run must match token for token.

Memory picture (one layer; the V pool has the same layout)::

    page_table (int32)                 k_pool[layer]  [num_slots, heads, head_dim]
    row = table_idx, col = position    ┌──────────────────────────────┐
    ┌───┬───┬───┬───┬────┐             │ slot 0                       │
    │ 8 │ 9 │10 │11 │ 20 │ ──────────► │ ...                          │
    └───┴───┴───┴───┴────┘             │ slot 8..11  tokens 0..3      │ (one page, P = 4)
                                       │ slot 20     token 4          │ (a new page)
                                       └──────────────────────────────┘
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .errors import InvalidArgument, OutOfPages
from .runtime import default_device

__all__ = [
    "KVPool", "paged_decode_attention_reference", "paged_decode_attention",
    "check_paged_attention_inputs", "causal_attention", "TinyConfig", "TinyTransformer",
    "Generation", "generate_contiguous", "PagedEngine", "generate_paged",
]


# --- the KV pool ------------------------------------------------------------------------


class KVPool:
    """K and V storage for every layer, addressed by physical token slot.

    ``k[layer]`` and ``v[layer]`` are ``[num_slots, num_heads, head_dim]``. Slot ``s`` of
    every layer belongs to the same token: the allocator hands out slots, not per-layer
    addresses.
    """

    def __init__(self, num_slots: int, num_layers: int, num_heads: int, head_dim: int,
                 *, dtype: torch.dtype = torch.float32, device=None):
        for name, value in [("num_slots", num_slots), ("num_layers", num_layers),
                            ("num_heads", num_heads), ("head_dim", head_dim)]:
            if not isinstance(value, int) or value < 1:
                raise InvalidArgument(name, "must be a positive int", f"got {value!r}")
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.device = default_device(device)
        shape = (num_layers, num_slots, num_heads, head_dim)
        # zeros, not empty: a slot that was never written reads as 0, never as garbage
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer: int) -> None:
        """Write ``k[i]``, ``v[i]`` (each ``[heads, head_dim]``) at slot ``out_loc[i]`` of ``layer``."""
        if not 0 <= layer < self.num_layers:
            raise InvalidArgument("layer", f"0 <= layer < num_layers={self.num_layers}",
                                  f"got {layer}")
        want = (self.num_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 3 or tuple(t.shape[1:]) != want:
                raise InvalidArgument(name, f"shape [n, {want[0]}, {want[1]}]",
                                      f"got {list(t.shape)}")
        out_loc = torch.as_tensor(out_loc).flatten()
        if k.shape[0] != v.shape[0] or k.shape[0] != out_loc.numel():
            raise InvalidArgument("out_loc", "one slot per row of k and v",
                                  f"{out_loc.numel()} slots, k has {k.shape[0]}, v has {v.shape[0]}")
        if out_loc.numel() == 0:
            return
        if out_loc.dtype.is_floating_point:
            raise InvalidArgument("out_loc", "integer slots", f"got {out_loc.dtype}")
        lo, hi = int(out_loc.min()), int(out_loc.max())
        if lo < 0 or hi >= self.num_slots:
            raise InvalidArgument("out_loc", f"0 <= slot < num_slots={self.num_slots}",
                                  f"got min {lo}, max {hi}")
        idx = out_loc.to(device=self.device, dtype=torch.int64)
        self.k[layer].index_copy_(0, idx, k.to(device=self.device, dtype=self.k.dtype))
        self.v[layer].index_copy_(0, idx, v.to(device=self.device, dtype=self.v.dtype))

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


# --- paged decode attention: host checks, reference, Triton wrapper ---------------------


def check_paged_attention_inputs(q, k_pool, v_pool, page_table, table_idx, seq_lens) -> None:
    """Every rule the kernel relies on, checked on the host before any launch.

    Rules: ``q`` is ``[batch, heads, head_dim]``; pools are ``[num_slots, heads, head_dim]``;
    ``table_idx`` names existing rows; ``1 <= seq_lens[b] <= page_table.shape[1]``; and every
    entry ``page_table[table_idx[b], :seq_lens[b]]`` is a slot in ``[0, num_slots)`` (an
    unmapped -1 or a stale slot would be read as K/V otherwise).
    """
    if q.dim() != 3:
        raise InvalidArgument("q", "shape [batch, heads, head_dim]", f"got {list(q.shape)}")
    batch, heads, head_dim = q.shape
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.dim() != 3 or tuple(pool.shape[1:]) != (heads, head_dim):
            raise InvalidArgument(name, f"shape [num_slots, {heads}, {head_dim}] (heads, head_dim of q)",
                                  f"got {list(pool.shape)}")
    if k_pool.shape != v_pool.shape:
        raise InvalidArgument("v_pool", "same shape as k_pool",
                              f"{list(v_pool.shape)} vs {list(k_pool.shape)}")
    if page_table.dim() != 2:
        raise InvalidArgument("page_table", "2-D [rows, cols]", f"got {list(page_table.shape)}")
    table_idx = torch.as_tensor(table_idx).flatten().cpu()
    seq_lens = torch.as_tensor(seq_lens).flatten().cpu()
    if table_idx.numel() != batch or seq_lens.numel() != batch:
        raise InvalidArgument("table_idx/seq_lens", "one entry per query",
                              f"batch {batch}, table_idx {table_idx.numel()}, seq_lens {seq_lens.numel()}")
    rows, cols = page_table.shape
    num_slots = k_pool.shape[0]
    for b in range(batch):
        row, n = int(table_idx[b]), int(seq_lens[b])
        if not 0 <= row < rows:
            raise InvalidArgument(f"table_idx[{b}]", f"0 <= row < {rows} (page_table rows)", f"got {row}")
        if not 1 <= n <= cols:
            raise InvalidArgument(f"seq_lens[{b}]", f"1 <= seq_len <= {cols} (page_table columns)",
                                  f"got {n}")
        slots = page_table[row, :n]
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= num_slots:
            bad = int(((slots < 0) | (slots >= num_slots)).nonzero()[0])
            raise InvalidArgument(
                f"page_table[{row}, {bad}]", f"a mapped slot in [0, {num_slots}) for every position < seq_len",
                f"request {b} has seq_len {n} but position {bad} holds {int(slots[bad])}")


def paged_decode_attention_reference(q, k_pool, v_pool, page_table, table_idx, seq_lens,
                                     scale: float | None = None) -> torch.Tensor:
    """The obviously-right version: per request, gather its slots, softmax, weighted sum.

    ``q``: ``[batch, heads, head_dim]``; pools ``[num_slots, heads, head_dim]``.
    Returns ``[batch, heads, head_dim]`` float32.
    """
    check_paged_attention_inputs(q, k_pool, v_pool, page_table, table_idx, seq_lens)
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        row, n = int(table_idx[b]), int(seq_lens[b])
        slots = [int(page_table[row, t]) for t in range(n)]      # token t lives at slot slots[t]
        k = k_pool[slots].float()                                  # [n, heads, head_dim]
        v = v_pool[slots].float()
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        weights = torch.softmax(scores, dim=-1)                    # [heads, n]
        out[b] = torch.einsum("hn,nhd->hd", weights, v)
    return out


def paged_decode_attention(q, k_pool, v_pool, page_table, table_idx, seq_lens,
                           scale: float | None = None, *, block_n: int | None = None) -> torch.Tensor:
    """Triton paged decode attention (one program per request and head), checked first.

    Same contract as :func:`paged_decode_attention_reference`. ``block_n`` (a power of two)
    is how many token columns a program reads per loop iteration; by default 32 on a GPU
    and 64 in the interpreter (fewer, wider iterations: the interpreter pays per operation).
    """
    from .kernels.attention import paged_decode_attention_kernel
    from .runtime import pick

    block_n = pick(cpu=64, gpu=32) if block_n is None else block_n
    check_paged_attention_inputs(q, k_pool, v_pool, page_table, table_idx, seq_lens)
    if not isinstance(block_n, int) or block_n < 1 or block_n & (block_n - 1):
        raise InvalidArgument("block_n", "a power of two", f"got {block_n}")
    batch, heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    device = q.device
    q = q.contiguous().float()
    k_pool, v_pool = k_pool.contiguous(), v_pool.contiguous()
    page_table = page_table.contiguous()
    table_idx = torch.as_tensor(table_idx).to(device=device, dtype=torch.int64).contiguous()
    seq_lens = torch.as_tensor(seq_lens).to(device=device, dtype=torch.int64).contiguous()
    out = torch.empty((batch, heads, head_dim), dtype=torch.float32, device=device)
    if batch == 0:
        return out
    paged_decode_attention_kernel[(batch, heads)](
        q, k_pool, v_pool, page_table, table_idx, seq_lens, out, float(scale),
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), page_table.stride(0),
        out.stride(0), out.stride(1), head_dim,
        BLOCK_N=block_n, BLOCK_D=max(16, 1 << (head_dim - 1).bit_length()),
    )
    return out


# --- a tiny transformer -----------------------------------------------------------------


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int) -> torch.Tensor:
    """Plain attention of ``T`` queries at positions ``q_offset..q_offset+T-1`` over keys ``0..S-1``.

    ``q``: ``[T, heads, head_dim]``; ``k``, ``v``: ``[S, heads, head_dim]``. Query ``t`` sees
    keys ``s <= q_offset + t`` (causal).
    """
    T, S = q.shape[0], k.shape[0]
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    allowed = torch.arange(S, device=q.device)[None, :] <= (q_offset + torch.arange(T, device=q.device))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v)


@dataclass(frozen=True)
class TinyConfig:
    """Shape of :class:`TinyTransformer`. Small enough for the interpreter."""

    vocab_size: int = 96
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 16
    max_positions: int = 512
    mlp_mult: int = 4
    seed: int = 0

    @property
    def d_model(self) -> int:
        return self.num_heads * self.head_dim


def _rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# attend(layer, q, k, v) -> attention output [T, heads, head_dim]; where K/V live is its business
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TinyTransformer:
    """A 2-layer pre-norm transformer with seeded random weights (float32).

    The model does not know where K/V are kept: :meth:`forward` takes an ``attend``
    callback per layer, so the same weights run with a contiguous cache or through the
    page table. Positions are learned absolute embeddings (token ``t`` of a request always
    gets position ``t``, whichever slot its K/V lands in).
    """

    def __init__(self, config: TinyConfig = TinyConfig(), device=None):
        self.config = c = config
        self.device = default_device(device)
        g = torch.Generator().manual_seed(c.seed)
        d, hidden = c.d_model, c.d_model * c.mlp_mult

        def w(*shape, std):
            return (torch.randn(*shape, generator=g) * std).to(self.device)

        self.tok_emb = w(c.vocab_size, d, std=1.0)
        self.pos_emb = w(c.max_positions, d, std=0.5)
        self.layers = [
            dict(wq=w(d, d, std=d ** -0.5), wk=w(d, d, std=d ** -0.5), wv=w(d, d, std=d ** -0.5),
                 wo=w(d, d, std=d ** -0.5), w1=w(d, hidden, std=d ** -0.5),
                 w2=w(hidden, d, std=hidden ** -0.5))
            for _ in range(c.num_layers)
        ]
        # a sharper head than std 1 so greedy choices are well separated from rounding noise
        self.lm_head = w(d, c.vocab_size, std=3.0 * d ** -0.5)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Logits ``[T, vocab]`` for ``T`` tokens; ``attend`` stores K/V and attends per layer."""
        c = self.config
        if int(positions.max()) >= c.max_positions:
            raise InvalidArgument("positions", f"< max_positions={c.max_positions}",
                                  f"got {int(positions.max())}")
        x = self.tok_emb[tokens] + self.pos_emb[positions]
        T = x.shape[0]
        for layer, p in enumerate(self.layers):
            h = _rms_norm(x)
            q = (h @ p["wq"]).view(T, c.num_heads, c.head_dim)
            k = (h @ p["wk"]).view(T, c.num_heads, c.head_dim)
            v = (h @ p["wv"]).view(T, c.num_heads, c.head_dim)
            x = x + attend(layer, q, k, v).reshape(T, c.d_model) @ p["wo"]
            x = x + torch.nn.functional.gelu(_rms_norm(x) @ p["w1"]) @ p["w2"]
        return _rms_norm(x) @ self.lm_head


@dataclass
class Generation:
    """What a generation run produced and what it cost."""

    tokens: list[list[int]]              # generated tokens per request (prompt excluded)
    logits: list[torch.Tensor]           # per request [new_tokens, vocab]: the logits behind each token
    prefill_tokens: int                  # prompt tokens whose K/V were computed (cache hits skip some)
    hit_tokens: list[int] = field(default_factory=list)  # per request, prompt tokens taken from the cache


def _check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise InvalidArgument("max_new_tokens", ">= 1", f"got {max_new_tokens}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise InvalidArgument(f"prompts[{i}]", "at least one token", "got an empty prompt")
        if min(p) < 0 or max(p) >= vocab_size:
            raise InvalidArgument(f"prompts[{i}]", f"token ids in [0, {vocab_size})",
                                  f"got min {min(p)}, max {max(p)}")


def generate_contiguous(model: TinyTransformer, prompts: Sequence[Sequence[int]],
                        max_new_tokens: int) -> Generation:
    """The baseline: each request keeps its own contiguous K/V tensors, no pages at all."""
    c = model.config
    _check_prompts(prompts, c.vocab_size, max_new_tokens)
    out_tokens, out_logits, prefill = [], [], 0
    for prompt in prompts:
        total = len(prompt) + max_new_tokens
        k_cache = torch.zeros(c.num_layers, total, c.num_heads, c.head_dim, device=model.device)
        v_cache = torch.zeros_like(k_cache)
        length = 0  # tokens whose K/V are in the cache

        def attend(layer, q, k, v):
            T = q.shape[0]
            k_cache[layer, length:length + T] = k
            v_cache[layer, length:length + T] = v
            return causal_attention(q, k_cache[layer, :length + T], v_cache[layer, :length + T], length)

        ids = torch.tensor(list(prompt), device=model.device)
        logits = model.forward(ids, torch.arange(len(prompt), device=model.device), attend)[-1]
        prefill += len(prompt)
        length = len(prompt)
        toks, logs = [], []
        for step in range(max_new_tokens):
            tok = int(logits.argmax())
            toks.append(tok)
            logs.append(logits)
            if step == max_new_tokens - 1:
                break
            logits = model.forward(torch.tensor([tok], device=model.device),
                                   torch.tensor([length], device=model.device), attend)[-1]
            length += 1
        out_tokens.append(toks)
        out_logits.append(torch.stack(logs).cpu())
    return Generation(out_tokens, out_logits, prefill, [0] * len(prompts))


# --- generation through the page table --------------------------------------------------


class PagedEngine:
    """The tiny model served through kvlab's memory manager (chapter 08).

    Owns a page table, a :class:`~kvlab.CacheManager` (free pages + radix prefix cache)
    and a :class:`KVPool` with one slot per token slot of the manager. Every
    :meth:`generate` call is one batch of requests:

    1. ``admit`` each request (match its prompt in the prefix cache, lock the hit, map it);
    2. ``allocate_paged`` the rest of the prompts; prefill computes only positions
       ``[cached_len, len(prompt))`` -- K/V go to ``pool`` at the row's slots
       (``store_kv``) and attention reads every earlier position through the row;
    3. ``cache_req(finished=False)``: the prompts' whole pages join the prefix cache;
    4. decode: per step ``allocate_paged`` (a new page at each page boundary), ``store_kv``
       of the one new token, then :func:`paged_decode_attention` over ``[0, device_len)``;
    5. ``cache_req(finished=True)``: prompt + answer stay cached for the next batch.

    The prefix cache outlives a call, so a second batch that shares a prefix with the first
    computes fewer prefill tokens (``Generation.prefill_tokens``) and must still produce
    exactly the tokens of :func:`generate_contiguous`.
    """

    def __init__(self, model: TinyTransformer, *, page_size: int, num_pages: int,
                 max_running: int = 8, max_seq_len: int = 256, decode_attention: str = "triton",
                 remap_duplicates: bool = True):
        from .cache_manager import CacheManager
        from .paging import new_page_table

        if decode_attention not in ("triton", "reference"):
            raise InvalidArgument("decode_attention", '"triton" or "reference"', f"got {decode_attention!r}")
        if max_seq_len > model.config.max_positions:
            raise InvalidArgument("max_seq_len", f"<= the model's max_positions={model.config.max_positions}",
                                  f"got {max_seq_len}")
        c = model.config
        self.model = model
        self.max_running = max_running
        self.max_seq_len = max_seq_len
        self.decode_attention = decode_attention
        self.page_table = new_page_table(max_running, max_seq_len, page_size, model.device)
        self.manager = CacheManager(num_pages, page_size, self.page_table,
                                    remap_duplicates=remap_duplicates)
        self.pool = KVPool(num_pages * page_size, c.num_layers, c.num_heads, c.head_dim,
                           device=model.device)

    def _attend_decode(self, q, rows, seq_lens, layer):
        fn = paged_decode_attention if self.decode_attention == "triton" else paged_decode_attention_reference
        return fn(q, self.pool.k[layer], self.pool.v[layer], self.page_table, rows, seq_lens)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 on_step: Callable[[str, list], None] | None = None) -> Generation:
        """Greedy-generate ``max_new_tokens`` for each prompt (one batch).

        ``on_step(phase, reqs)`` is called after the prefill (``"prefill"``) and after every
        decode step (``"decode"``), e.g. to take a picture of the page table.
        """
        from .cache_manager import Req

        c = self.model.config
        _check_prompts(prompts, c.vocab_size, max_new_tokens)
        if not 1 <= len(prompts) <= self.max_running:
            raise InvalidArgument("prompts", f"1 to max_running={self.max_running} requests per batch",
                                  f"got {len(prompts)}")
        for i, p in enumerate(prompts):
            if len(p) + max_new_tokens > self.max_seq_len:
                raise InvalidArgument(f"prompts[{i}]", f"len(prompt) + max_new_tokens <= max_seq_len={self.max_seq_len}",
                                      f"got {len(p)} + {max_new_tokens}")
        dev = self.model.device
        reqs = [Req(list(p), table_idx=i) for i, p in enumerate(prompts)]
        for req in reqs:
            self.manager.admit(req)          # match + lock + map the cached prefix into the row
        hits = [req.cached_len for req in reqs]
        # decide up front that the whole generation fits, so no step fails half-way
        P = self.manager.page_size
        need = sum(-(-(req.device_len + max_new_tokens - 1) // P) - req.cached_len // P for req in reqs)
        have = self.manager.num_free_pages + self.manager.prefix_cache.size_info.evictable_size // P
        if need > have:
            for req in reqs:                 # leave the manager as it was (minus LRU touches)
                self.manager.release_req(req)
            raise OutOfPages(need, have, "batch (prompts + max_new_tokens, after prefix hits)")
        self.manager.allocate_paged(reqs)

        # prefill: only the positions the cache did not have
        logits_now, prefill = [], 0
        for req in reqs:
            row, start, end = req.table_idx, req.cached_len, req.device_len
            prefill += end - start
            out_loc = self.page_table[row, start:end]
            seen = self.page_table[row, :end].long()

            def attend(layer, q, k, v, out_loc=out_loc, seen=seen, start=start):
                self.pool.store_kv(k, v, out_loc, layer)
                return causal_attention(q, self.pool.k[layer][seen], self.pool.v[layer][seen], start)

            ids = torch.tensor(req.input_ids[start:end], device=dev)
            logits_now.append(self.model.forward(ids, torch.arange(start, end, device=dev), attend)[-1])
        logits_now = torch.stack(logits_now)
        toks: list[list[int]] = [[] for _ in reqs]
        logs: list[list[torch.Tensor]] = [[] for _ in reqs]

        def take(logits):
            for b, req in enumerate(reqs):
                tok = int(logits[b].argmax())
                toks[b].append(tok)
                logs[b].append(logits[b].cpu())
                req.append_token(tok)
                req.complete_one()           # cached_len = device_len; device_len += 1

        take(logits_now)
        for req in reqs:
            self.manager.cache_req(req, finished=False)
        if on_step is not None:
            on_step("prefill", reqs)

        rows = torch.tensor([req.table_idx for req in reqs], device=dev)
        for _ in range(max_new_tokens - 1):
            self.manager.allocate_paged(reqs)  # a new page only where a request crosses a boundary
            positions = torch.tensor([req.device_len - 1 for req in reqs], device=dev)
            seq_lens = torch.tensor([req.device_len for req in reqs], device=dev)
            out_loc = self.page_table[rows, positions]
            ids = torch.tensor([req.input_ids[-1] for req in reqs], device=dev)

            def attend(layer, q, k, v, out_loc=out_loc, seq_lens=seq_lens):
                self.pool.store_kv(k, v, out_loc, layer)
                return self._attend_decode(q, rows, seq_lens, layer)

            take(self.model.forward(ids, positions, attend))
            if on_step is not None:
                on_step("decode", reqs)
        for req in reqs:
            self.manager.cache_req(req, finished=True)
        self.manager.check_integrity()
        return Generation(toks, [torch.stack(x) for x in logs], prefill, hits)


def generate_paged(model: TinyTransformer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   *, page_size: int = 4, num_pages: int | None = None, **engine_kwargs) -> Generation:
    """One batch through a fresh :class:`PagedEngine` (no cache hits: a new cache)."""
    # an empty batch gets through to PagedEngine.generate, which names the rule it breaks
    longest = max((len(p) for p in prompts), default=0) + max_new_tokens
    if num_pages is None:
        num_pages = len(prompts) * (-(-longest // page_size)) + 1
    engine_kwargs.setdefault("max_seq_len", max(longest, page_size))
    engine_kwargs.setdefault("max_running", max(len(prompts), 1))
    engine = PagedEngine(model, page_size=page_size, num_pages=num_pages, **engine_kwargs)
    return engine.generate(prompts, max_new_tokens)
