"""Serve a Hugging Face causal LM through kvlab's cache manager, token for token (chapter 10).

:class:`PagedGenerator` is a small continuous-batching server loop. Its memory is kvlab's:
a :class:`~kvlab.CacheManager` (free pages, page table, radix prefix cache) and a
:class:`~kvlab.KVPool` with one K and one V row per token slot and layer. The model is the
user's own transformers model; kvlab swaps in only its attention function
(:mod:`kvlab.hf.plugin`), so norms, RoPE and MLPs run as the model's authors wrote them.

One **step** of the loop::

    waiting ──► PrefillAdder: chunks of prompts begun earlier first, then new requests while a
                │             row, the token budget and the page reservations allow
                ▼             (kvlab.hf.prefill; admit = match the prompt, lock the hit)
    mixed_step(prefill, running)      (one allocate_paged: pages for this step's prompt chunks,
                │                      and a page for each running request that crosses a
                │                      boundary)
                ▼
    a decode-only step of at most the largest captured size: padded with the dummy row and
    replayed from a CUDA graph (kvlab.hf.graphs); any other step: one eager forward over the
    packed tokens, one row of position ids:
        [ new A: positions 0..7 | chunk of B: 16..30 | running C: 41 | running D: 7 ]
        every layer: K/V of all these tokens -> pool slots (page table); then
          several tokens of a request (a prompt)  -> prefill attention through its row (torch)
          one token of a request (decoding)       -> the Triton paged decode kernel (GQA)
                │
                ▼
    greedy token per request, read back once (the step's one wait for the GPU); complete_step:
    a prompt's last chunk gives its first token and cache_req(finished=False) puts its
    prompt's pages in the prefix cache; cache_req(finished=True) ends the finished requests
    (EOS or max_new_tokens), whose rows go back to the waiting requests

Admission is by memory: as many requests run as page-table rows and pages allow. A request
is admitted only if the pages it may still need (prompt + ``max_new_tokens`` - 1 positions,
minus its cache hit) fit beside what the others may still need, counting evictable cached
pages as free -- so no step can run out of pages half-way. A request that can never fit
raises :class:`~kvlab.OutOfPages` before anything changes.

The loop speaks to :class:`~kvlab.CacheManager` in its serving words (``admit``,
``available_pages``, ``mixed_step``, ``complete_step``): the same words the simulator
(chapter 07) and chapter 08's engine use.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, NamedTuple, Sequence

import torch

from ..args import check_int, check_page_size, check_token_ids, div_ceil
from ..errors import InvalidArgument, OutOfPages
from .attention import check_impl, check_rows_mapped
from .graphs import COMPILE_BY_DEFAULT, DecodeGraphs, graph_batch_sizes
from .plugin import (check_generation_config, check_model, eos_token_ids, paged_attention_active,
                     register_attention)
from .prefill import PrefillAdder, Seq
from .step import build_step

__all__ = ["PagedGenerator", "RequestStats", "StepInfo"]

#: what ``decode_graphs`` may be: see :class:`PagedGenerator`
GRAPH_MODES = ("auto", "capture", "eager", "off")


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
    prefill: list[int]    # admitted in this step: their prompts (or a first chunk) were computed
    decode: list[int]     # running: one new token each
    tokens: int           # tokens in the step's forward pass
    chunks: list[int]     # computed a chunk of a prompt begun in an earlier step
    padded_to: int        # a decode step run at this captured batch size (0: a packed step)


class PagedGenerator:
    """Greedy generation for a Llama-family or Qwen2 transformers model, K/V in kvlab's pool.

    ``gen = PagedGenerator(model, page_size=16, num_pages=256)``;
    ``gen.generate(prompts, max_new_tokens=32)`` returns, per prompt (a list of token ids),
    the new tokens -- exactly those of ``model.generate(..., do_sample=False)`` for that
    prompt alone, EOS included when it ends the answer. The prefix cache outlives a call: a
    later call whose prompts repeat earlier text (a conversation that re-sends its history)
    computes only what is new. ``gen.stats`` counts the last call's work.

    * ``max_running``: page-table rows, i.e. the most requests running at once (mini-sglang's
      ``max_running_req``); how many really run is decided by memory;
    * ``max_seq_len``: positions per row (default: the pool, up to the model's
      ``max_position_embeddings``);
    * ``prefill_budget``: prompt tokens computed per step; ``chunked_prefill``: cut a prompt
      into chunks to stay within it (``False``: whole prompts, the first of a step always goes);
    * ``decode_graphs``: ``"capture"`` records the decode step as CUDA graphs at the sizes
      ``graph_sizes`` (default: mini-sglang's, up to ``max_running`` and 256) at construction
      and replays them; ``"eager"`` runs the same padded step without graphs; ``"off"`` runs
      decode steps like any other; ``"auto"``: ``"capture"`` on a CUDA device unless
      ``decode_step`` is given, else ``"eager"``;
    * ``decode_step``: a function with the signature of :func:`kvlab.hf.paged_attention_step`
      to use instead of it (chapter 10's exercise);
    * ``attention``: the decode kernels, ``"fast"`` (chapter 09's: a K/V group's query heads
      in one program, a split over the sequence) or ``"teaching"`` (chapter 08's);
    * ``compile_decode``: ``torch.compile`` the padded decode step's forward pass at start-up,
      before the graphs are captured (chapter 09; :class:`~kvlab.hf.graphs.DecodeGraphs`).
      ``None``: :data:`~kvlab.hf.graphs.COMPILE_BY_DEFAULT` where graphs are captured, else off;
    * ``check_steps``: check every step's rows on the host before its forward pass (a few waits
      for the GPU per step; default: only without CUDA, where a bad slot would corrupt memory).
    """

    def __init__(self, model, page_size: int = 16, num_pages: int = 256, *, max_running: int = 256,
                 max_seq_len: int | None = None, prefill_budget: int = 8192,
                 chunked_prefill: bool = True, decode_graphs: str = "auto",
                 graph_sizes: Sequence[int] | None = None, decode_step: Callable | None = None,
                 check_steps: bool | None = None, attention: str = "fast",
                 compile_decode: bool | None = None):
        from ..kvcache import KVPool
        from ..paging import new_page_table

        check_model(model)
        self.model = model
        self.page_size = check_page_size(page_size)
        self.num_pages = check_int("num_pages", num_pages, minimum=1)
        self.max_running = check_int("max_running", max_running, minimum=1)
        self.prefill_budget = check_int("prefill_budget", prefill_budget, minimum=1)
        self.chunked_prefill = _check_bool("chunked_prefill", chunked_prefill)
        c = model.config
        self._row_limit = "max_seq_len"
        if max_seq_len is None:
            max_seq_len = self.num_pages * self.page_size
            positions = getattr(c, "max_position_embeddings", None)
            if positions and positions < max_seq_len:
                max_seq_len, self._row_limit = positions, "the model's max_position_embeddings"
        max_seq_len = check_int("max_seq_len", max_seq_len, minimum=1)
        if decode_step is not None and not callable(decode_step):
            raise InvalidArgument("decode_step", "a function like kvlab.hf.paged_attention_step",
                                  f"got {type(decode_step).__name__}")
        if decode_graphs not in GRAPH_MODES:
            raise InvalidArgument("decode_graphs", f"one of {GRAPH_MODES}", f"got {decode_graphs!r}")
        self.decode_step = decode_step
        self.attention = check_impl(attention, "attention")
        if compile_decode is not None:
            _check_bool("compile_decode", compile_decode)
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        self.group = heads // kv_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        device = model.device
        self.check_steps = device.type != "cuda" if check_steps is None else _check_bool(
            "check_steps", check_steps)
        # one row more than max_running: the dummy request's (new_page_table makes it)
        self.page_table = new_page_table(self.max_running, max_seq_len, self.page_size, device)
        self.dummy_row = self.max_running
        # one page more than the manager hands out: the dummy page, where padded entries write
        self.pool = KVPool((self.num_pages + 1) * self.page_size, c.num_hidden_layers, kv_heads,
                           head_dim, dtype=model.dtype, device=device)
        self._map_dummy_row()
        self.clear_prefix_cache()
        self.stats: dict[str, int] = {}
        self.requests: list[RequestStats] = []
        self.logits: list[torch.Tensor] = []
        register_attention()
        self.graphs = self._decode_graphs(decode_graphs, graph_sizes, compile_decode)

    def _decode_graphs(self, mode: str, sizes: Sequence[int] | None,
                       compile_decode: bool | None) -> DecodeGraphs | None:
        """The padded decode step (captured now, at start-up, or run eagerly), or None."""
        if mode == "auto":
            on_gpu = self.model.device.type == "cuda" and self.decode_step is None
            mode = "capture" if on_gpu else "eager"
        if mode == "off":
            if compile_decode:
                raise InvalidArgument("compile_decode", 'True only with decode_graphs "capture" or '
                                      '"eager" (it compiles the padded decode step)', 'decode_graphs="off"')
            return None
        if compile_decode is None:
            compile_decode = COMPILE_BY_DEFAULT and mode == "capture"
        if sizes is None:
            sizes = graph_batch_sizes(min(self.max_running, 256))
        sizes = sorted(set(check_int(f"graph_sizes[{i}]", s, minimum=1) for i, s in enumerate(sizes)))
        if not sizes or sizes[-1] > self.max_running:
            raise InvalidArgument("graph_sizes", f"batch sizes in [1, max_running={self.max_running}]",
                                  f"got {list(sizes)}")
        with paged_attention_active(self.model), torch.inference_mode():
            return DecodeGraphs(self.model, self.pool, self.page_table, self.dummy_row, sizes,
                                capture=mode == "capture", decode_step=self.decode_step,
                                attention=self.attention, compile=compile_decode)

    def _map_dummy_row(self) -> None:
        """Every entry of the dummy row points into the dummy page (its first slot, and its
        first page written through the page-table kernel: compiled now, at start-up)."""
        from ..paging import page_to_token, write_page_table_triton

        dummy = self.num_pages * self.page_size
        self.page_table[self.dummy_row].fill_(dummy)
        page = torch.tensor([dummy], dtype=torch.int32, device=self.page_table.device)
        write_page_table_triton(self.page_table, page_to_token(page, self.page_size),
                                [(self.dummy_row, 0, 1)], self.page_size)

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix: all pages free again, as in a fresh generator (a cold
        cache). The pool, the page table and any captured graphs stay."""
        from ..cache_manager import CacheManager

        self.manager = CacheManager(self.num_pages, self.page_size, self.page_table)

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
        waiting: deque[Seq] = deque(seqs)
        chunked: list[Seq] = []    # admitted; their prompts are computed chunk by chunk
        running: list[Seq] = []    # decoding: one token per step
        free_rows = list(range(self.max_running))
        stats = dict(requests=len(seqs), prefill_computed=0, prefill_cached=0, generated=0,
                     steps=0, prefill_steps=0, decode_steps=0, graph_steps=0, chunks=0,
                     decode_tokens=0, deferred=0, most_running=0)
        live: list[Seq] = []     # admitted and not finished: released if anything goes wrong
        try:
            with paged_attention_active(self.model), torch.inference_mode():
                while waiting or chunked or running:
                    # 1. who prefills this step, and how much (admission by memory, chunks)
                    adder = PrefillAdder(self.manager, max_new, self.prefill_budget,
                                         chunked=self.chunked_prefill, holding=running + chunked)
                    new = self._admit(adder, waiting, chunked, free_rows, stats)
                    live += new
                    prefill = adder.added
                    if not prefill and not running:  # _check made sure each request fits alone
                        raise AssertionError("kvlab.hf: no request could be admitted to an idle pool")
                    # 2. map the prompt chunks and one more position of each running request
                    step = self.manager.mixed_step([s.req for s in prefill], [s.req for s in running])
                    batch = prefill + running
                    # who gets a token: running requests, and prompts whose last chunk this is
                    last = [s.req.device_len == len(s.prompt) for s in prefill] + [True] * len(running)
                    # 3. one forward pass (a replayed graph for a decode-only step)
                    token_t, logits, padded_to = self._forward(step, last)
                    tokens = iter(token_t.tolist())      # the step's one wait for the GPU
                    rows = iter(logits.to("cpu", torch.float32, copy=True)) if output_logits else None
                    next_tokens, done = [], []
                    for seq, produced in zip(batch, last):
                        token = next(tokens) if produced else None
                        next_tokens.append(token)
                        if produced:
                            seq.tokens.append(token)
                            if rows is not None:
                                seq.logits.append(next(rows))
                            if token in eos or len(seq.tokens) == max_new:
                                seq.finished_by = "eos" if token in eos else "length"
                        done.append(bool(seq.finished_by))
                    # 4. record the tokens; finished prompts' pages join the cache; done ones end
                    self.manager.complete_step(step, next_tokens, done)
                    for seq in batch:
                        if seq.finished_by:
                            free_rows.append(seq.req.table_idx)
                            live.remove(seq)
                    chunked = [s for s, produced in zip(prefill, last) if not produced]
                    running = [s for s, produced in zip(batch, last) if produced and not s.finished_by]
                    self._count(stats, step, prefill, new, chunked, padded_to)
                    if on_step is not None:
                        on_step(StepInfo(stats["steps"] - 1, [s.index for s in new],
                                         [s.index for s in batch[len(prefill):]], step.num_tokens,
                                         [s.index for s in prefill if s not in new], padded_to))
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

    def _check(self, prompts, max_new_tokens) -> tuple[list[Seq], int]:
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
            if div_ceil(positions, P) > self.num_pages:
                raise OutOfPages(div_ceil(positions, P), self.num_pages,
                                 f"request (prompts[{i}]: {len(ids)} prompt tokens + {max_new} new, "
                                 f"pages of {P}; the pool has {self.num_pages} pages in all)")
            if positions > cols:
                raise InvalidArgument(f"prompts[{i}]", f"len(prompt) + max_new_tokens - 1 <= {cols} "
                                      f"(positions of a page-table row: {self._row_limit})",
                                      f"got {len(ids)} + {max_new} - 1")
            seqs.append(Seq(i, ids))
        return seqs, max_new

    # --- scheduling -----------------------------------------------------------------------

    def _admit(self, adder: PrefillAdder, waiting: deque, chunked: list, free_rows: list,
               stats: dict) -> list[Seq]:
        """Chunks of prompts begun earlier first (they keep their rows and handles), then
        waiting requests in order while rows, the budget and pages last; returns the new ones."""
        for seq in chunked:
            if not adder.add_chunk(seq):
                break
        new: list[Seq] = []
        for seq in list(waiting):
            verdict = adder.try_admit(seq, free_rows, chunked)
            if verdict == "full":
                break
            if verdict == "added":
                waiting.remove(seq)
                new.append(seq)
                stats["prefill_cached"] += seq.cached
                stats["prefill_computed"] += len(seq.prompt) - seq.cached
        stats["deferred"] += adder.deferred
        return new

    @staticmethod
    def _count(stats: dict, step, prefill: list, new: list, chunked: list, padded_to: int) -> None:
        stats["steps"] += 1
        stats["prefill_steps"] += bool(prefill)
        stats["decode_steps"] += not prefill
        stats["graph_steps"] += bool(padded_to)
        stats["chunks"] += len(chunked)
        stats["decode_tokens"] += len(step) - len(prefill)
        stats["most_running"] = max(stats["most_running"], len(step))

    # --- one forward step ------------------------------------------------------------------

    def _forward(self, step, last: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Run the model once over every request's new tokens of ``step`` (a
        :class:`~kvlab.req.ForwardBatch`, pages mapped). Returns the greedy next token and
        the logits of each request with ``last[b]`` (on the device), and the captured batch
        size a decode-only step ran at (0: one packed eager pass)."""
        if self.check_steps:
            check_rows_mapped(self.page_table, step.rows(), step.seq_lens(), self.pool.num_slots)
        if self.graphs is not None and not any(step.prefilling) and self.graphs.fits(len(step)):
            ids = [req.input_ids[start] for req, start in zip(step.reqs, step.start)]
            tokens, logits = self.graphs.run(ids, step.table_idx, step.start)
            return tokens, logits, self.graphs.padded_size(len(step))
        inputs = build_step(step, self.pool, self.page_table, last, self.group, self.decode_step,
                            self.attention)
        out = self.model(input_ids=inputs.input_ids[None], position_ids=inputs.positions[None],
                         use_cache=False, logits_to_keep=inputs.keep, kvlab_step=inputs.batch)
        logits = out.logits[0]
        return logits.argmax(-1), logits, 0


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(name, "True or False", f"got {value!r}")
    return value
