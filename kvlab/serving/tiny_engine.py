"""A tiny model that proves the memory manager right, and the engine that serves it through
kvlab's pages (chapter 08 capstone; mini-sglang's ``engine/``).

* :class:`TinyTransformer` -- seeded random weights, no downloads. It does not know where K/V
  live: its ``forward`` takes an ``attend(layer, q, k, v)`` callback.
* :func:`generate_contiguous` -- the baseline: a plain contiguous KV cache per request.
* :class:`PagedEngine` -- the same model served through :class:`~kvlab.CacheManager` and a
  :class:`~kvlab.attention.kv_pool.KVPool`: prefill and decode steps from the manager's serving
  vocabulary (``prefill`` / ``decode_step`` / ``complete_step``), the forward pass in between.
  It must produce exactly the tokens of :func:`generate_contiguous`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Sequence

import torch

from ..base.args import check_int, check_token_ids, div_ceil
from ..attention.paged_attention import causal_attention, paged_decode_attention
from ..manager.cache_manager import CacheManager, ForwardBatch, Req
from ..base.errors import InvalidArgument
from ..attention.kv_pool import KVPool
from ..alloc.paging import new_page_table
from ..course.reference.attention_ref import paged_decode_attention_reference
from ..base.runtime import default_device

__all__ = ["TinyConfig", "TinyTransformer", "Generation", "generate_contiguous", "PagedEngine",
           "generate_paged"]


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


def _check_prompts(prompts, vocab_size: int, max_new_tokens) -> list[list[int]]:
    """The prompts as lists of ints, each non-empty with ids in ``[0, vocab_size)``."""
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise InvalidArgument("prompts", "must be a list of prompts (lists of token ids)",
                              f"got {type(prompts).__name__}")
    out = [check_token_ids(f"prompts[{i}]", p) for i, p in enumerate(prompts)]
    for i, p in enumerate(out):
        if len(p) == 0:
            raise InvalidArgument(f"prompts[{i}]", "at least one token", "got an empty prompt")
        if min(p) < 0 or max(p) >= vocab_size:
            raise InvalidArgument(f"prompts[{i}]", f"token ids in [0, {vocab_size})",
                                  f"got min {min(p)}, max {max(p)}")
    return out


def generate_contiguous(model: TinyTransformer, prompts: Sequence[Sequence[int]],
                        max_new_tokens: int) -> Generation:
    """The baseline: each request keeps its own contiguous K/V tensors, no pages at all."""
    c = model.config
    prompts = _check_prompts(prompts, c.vocab_size, max_new_tokens)
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


class _Greedy:
    """The tokens and logits a generation produced so far, one list per request."""

    def __init__(self, n: int):
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logits: list[list[torch.Tensor]] = [[] for _ in range(n)]

    def take(self, logits: torch.Tensor) -> list[int]:
        """Greedy choice of each request's next token from ``logits`` ``[batch, vocab]``."""
        chosen = logits.argmax(-1).tolist()
        for b, tok in enumerate(chosen):
            self.tokens[b].append(tok)
            self.logits[b].append(logits[b].cpu())
        return chosen


class PagedEngine:
    """The tiny model served through kvlab's memory manager (chapter 08).

    Owns a page table, a :class:`~kvlab.CacheManager` (free pages + radix prefix cache)
    and a :class:`~kvlab.attention.kv_pool.KVPool` with one slot per token slot of the manager. Every
    :meth:`generate` call is one batch of requests; the prefix cache outlives a call, so a
    second batch that shares a prefix with the first computes fewer prefill tokens
    (``Generation.prefill_tokens``) and must still produce exactly the tokens of
    :func:`generate_contiguous`.
    """

    def __init__(self, model: TinyTransformer, *, page_size: int, num_pages: int,
                 max_running: int = 8, max_seq_len: int = 256, decode_attention: str = "triton",
                 remap_duplicates: bool = True):
        if decode_attention not in ("triton", "reference"):
            raise InvalidArgument("decode_attention", '"triton" or "reference"', f"got {decode_attention!r}")
        self.max_running = check_int("max_running", max_running, minimum=1)
        self.max_seq_len = check_int("max_seq_len", max_seq_len, minimum=1)
        if max_seq_len > model.config.max_positions:
            raise InvalidArgument("max_seq_len", f"<= the model's max_positions={model.config.max_positions}",
                                  f"got {max_seq_len}")
        c = model.config
        self.model = model
        self.decode_attention = decode_attention
        self.page_table = new_page_table(max_running, max_seq_len, page_size, model.device)
        self.manager = CacheManager(num_pages, page_size, self.page_table,
                                    remap_duplicates=remap_duplicates)
        self.pool = KVPool(num_pages * page_size, c.num_layers, c.num_heads, c.head_dim,
                           device=model.device)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 on_step: Callable[[str, list], None] | None = None) -> Generation:
        """Greedy-generate ``max_new_tokens`` for each prompt (one batch).

        ``on_step(phase, reqs)`` is called after the prefill (``"prefill"``) and after every
        decode step (``"decode"``), e.g. to take a picture of the page table.
        """
        prompts = self._check_batch(prompts, max_new_tokens)
        # 1. one request per prompt, each in its own page-table row
        reqs = [Req(p, table_idx=i) for i, p in enumerate(prompts)]
        # 2. prefill: admit (match + lock the cached prefix), make sure the whole generation
        #    fits (so no step fails half-way), map the rest of the prompts, and compute only
        #    the positions the cache did not have
        batch = self.manager.prefill(reqs, reserve_tokens=max_new_tokens - 1)
        hits, prefill_tokens = list(batch.start), batch.num_tokens
        out = _Greedy(len(reqs))
        # 3. record each first token; the prompts' whole pages join the prefix cache
        self.manager.complete_step(batch, out.take(self._forward_prefill(batch)))
        if on_step is not None:
            on_step("prefill", reqs)
        # 4. decode: one token per request per step (a new page only at a page boundary)
        for _ in range(max_new_tokens - 1):
            batch = self.manager.decode_step(reqs)
            self.manager.complete_step(batch, out.take(self._forward_decode(batch)))
            if on_step is not None:
                on_step("decode", reqs)
        # 5. finish: prompt and answer stay in the prefix cache for the next batch
        for req in reqs:
            self.manager.cache_req(req, finished=True)
        self.manager.check_integrity()
        return Generation(out.tokens, [torch.stack(x) for x in out.logits], prefill_tokens, hits)

    def _check_batch(self, prompts, max_new_tokens) -> list[list[int]]:
        prompts = _check_prompts(prompts, self.model.config.vocab_size, max_new_tokens)
        if not 1 <= len(prompts) <= self.max_running:
            raise InvalidArgument("prompts", f"1 to max_running={self.max_running} requests per batch",
                                  f"got {len(prompts)}")
        for i, p in enumerate(prompts):
            if len(p) + max_new_tokens > self.max_seq_len:
                raise InvalidArgument(f"prompts[{i}]", f"len(prompt) + max_new_tokens <= max_seq_len={self.max_seq_len}",
                                      f"got {len(p)} + {max_new_tokens}")
        return prompts

    # --- the forward passes: K/V go to the pool at the row's slots -------------------------

    def _forward_prefill(self, batch: ForwardBatch) -> torch.Tensor:
        """Each request's uncached positions; attention gathers every earlier one through the
        row (plain torch). Returns the logits of each request's last position ``[batch, vocab]``."""
        logits = []
        for i, req in enumerate(batch.reqs):
            start, end = batch.start[i], batch.end[i]
            attend = partial(self._attend_prefill, batch.slots(i), start)
            ids = torch.tensor(req.input_ids[start:end], device=self.model.device)
            positions = torch.arange(start, end, device=self.model.device)
            logits.append(self.model.forward(ids, positions, attend)[-1])
        return torch.stack(logits)

    def _attend_prefill(self, seen: torch.Tensor, start: int, layer: int, q, k, v) -> torch.Tensor:
        self.pool.store_kv(k, v, seen[start:], layer)
        seen = seen.long()
        return causal_attention(q, self.pool.k[layer][seen], self.pool.v[layer][seen], start)

    def _forward_decode(self, batch: ForwardBatch) -> torch.Tensor:
        """One new token per request; attention reads ``[0, device_len)`` through the rows."""
        attend = partial(self._attend_decode, batch.out_loc(), batch.rows(), batch.seq_lens())
        return self.model.forward(batch.input_ids(), batch.positions(), attend)

    def _attend_decode(self, out_loc, rows, seq_lens, layer: int, q, k, v) -> torch.Tensor:
        self.pool.store_kv(k, v, out_loc, layer)
        attention = (paged_decode_attention if self.decode_attention == "triton"
                     else paged_decode_attention_reference)
        return attention(q, self.pool.k[layer], self.pool.v[layer], self.page_table, rows, seq_lens)


def generate_paged(model: TinyTransformer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   *, page_size: int = 4, num_pages: int | None = None, **engine_kwargs) -> Generation:
    """One batch through a fresh :class:`PagedEngine` (no cache hits: a new cache)."""
    # an empty batch gets through to PagedEngine.generate, which names the rule it breaks
    longest = max((len(p) for p in prompts), default=0) + max_new_tokens
    if num_pages is None:
        num_pages = len(prompts) * div_ceil(longest, page_size) + 1
    engine_kwargs.setdefault("max_seq_len", max(longest, page_size))
    engine_kwargs.setdefault("max_running", max(len(prompts), 1))
    engine = PagedEngine(model, page_size=page_size, num_pages=num_pages, **engine_kwargs)
    return engine.generate(prompts, max_new_tokens)
