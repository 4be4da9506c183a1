"""Serve a Hugging Face causal LM through kvlab's cache manager, token for token (chapter 10).

:class:`PagedGenerator` is a small continuous-batching server loop. Its memory is kvlab's:
a :class:`~kvlab.CacheManager` (free pages, page table, radix prefix cache) and a
:class:`~kvlab.KVPool` with one K and one V row per token slot and layer. The model is the
user's own transformers model; kvlab swaps in only its attention function
(:mod:`kvlab.serving.hf.plugin`), so norms, RoPE and MLPs run as the model's authors wrote them.

One **step** of the loop::

    waiting ──► PrefillAdder: chunks of prompts begun earlier first, then new requests while a
                │             row, the token budget and the page reservations allow
                ▼             (kvlab.serving.hf.prefill; admit = match the prompt, lock the hit)
    mixed_step(prefill, running)      (one allocate_paged: pages for this step's prompt chunks,
                │                      and a page for each running request that crosses a
                │                      boundary)
                ▼
    a decode-only step of at most the largest captured size: padded with the dummy row and
    replayed from a CUDA graph (kvlab.serving.hf.graphs); any other step: one eager forward over the
    packed tokens, one row of position ids:
        [ new A: positions 0..7 | chunk of B: 16..30 | running C: 41 | running D: 7 ]
        every layer: K/V of all these tokens -> pool slots (page table); then
          several tokens of a request (a prompt)  -> prefill attention through its row (torch)
          one token of a request (decoding)       -> the Triton paged decode kernel (GQA)
                │
                ▼
    greedy token per request, read back once (the step's one wait for the GPU); the lengths
    move past the step (complete_step); a prompt's last chunk gives its first token and
    cache_req(finished=False) puts its prompt's pages in the prefix cache;
    cache_req(finished=True) ends the finished requests (EOS or max_new_tokens), whose rows
    go back to the waiting requests

**Overlap scheduling** (``overlap=True``, the default on a GPU): the host schedules and
launches step n+1 before it reads step n's tokens, so the GPU never waits for the host's
bookkeeping; a step's tokens are consumed one step later, as in mini-sglang's
``overlap_loop``. :mod:`kvlab.serving.hf.loop` runs the steps and says where kvlab departs from
mini-sglang; :mod:`kvlab.serving.hf.overlap` is where the device work runs.

Admission is by memory: as many requests run as page-table rows and pages allow. A request
is admitted only if the pages it may still need (prompt + ``max_new_tokens`` - 1 positions,
minus its cache hit) fit beside what the others may still need, counting evictable cached
pages as free -- so no step can run out of pages half-way. A request that can never fit
raises :class:`~kvlab.OutOfPages` before anything changes.

The loop speaks to :class:`~kvlab.CacheManager` in its serving words (``admit``,
``available_pages``, ``mixed_step``, ``complete_step``): the same words the simulator
(chapter 07) and chapter 08's engine use.

``policy=`` (chapter 12, :mod:`kvlab.serving.pressure`) replaces that admission rule: ``"reserve"``
(the default, as above), ``"recompute"``, ``"retract"`` or ``"swap"``, which admit on less and
make room when a step does not fit (:mod:`kvlab.serving.hf.room`, before each step; the swap policy's
host copies in :mod:`kvlab.serving.hf.swap`). Whatever the policy, every answer is ``generate``'s.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import torch

from ...base.args import check_bool, check_int, check_page_size, check_token_ids, div_ceil
from ...base.errors import InvalidArgument, OutOfPages
from .attention_steps import check_impl, check_rows_mapped
from .graphs import COMPILE_BY_DEFAULT, DecodeGraphs, graph_batch_sizes
from .loop import ServingLoop, StepInfo
from .overlap import DeviceQueue, StepTimes, device_queue, to_host
from .plugin import (check_generation_config, check_model, eos_token_ids, paged_attention_active,
                     register_attention)
from .prefill import Seq
from .step import build_step

__all__ = ["PagedGenerator", "RequestStats", "StepInfo", "StepTimes"]

#: what ``decode_graphs`` may be: see :class:`PagedGenerator`
GRAPH_MODES = ("auto", "capture", "eager", "off")


class RequestStats(NamedTuple):
    """What one request of the last :meth:`PagedGenerator.generate` call cost and produced."""

    prompt_len: int
    cached: int        # prompt tokens whose K/V came from the prefix cache
    computed: int      # prompt tokens whose K/V the prefill computed
    generated: int     # new tokens (the EOS token included when it ended the request)
    finished_by: str   # "eos", "length" or "stop" (``end_after``)
    stops: int = 0             # times the policy stopped it (preempted, retracted, swapped out)
    recomputed: int = 0        # positions computed again after its comebacks
    token_steps: tuple = ()    # the step (StepInfo.index) that produced each of its tokens
    arrival: float = 0.0     # seconds after the call began when it arrived
    times: tuple = ()        # when each new token reached the host (s after the call began)

    @property
    def ttft(self) -> float:
        """Time to first token, from its arrival (s)."""
        return self.times[0] - self.arrival

    @property
    def latency(self) -> float:
        """End-to-end latency: arrival to its last token (s)."""
        return self.times[-1] - self.arrival

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: the gaps between its consecutive tokens (s)."""
        return [b - a for a, b in zip(self.times, self.times[1:])]


class PagedGenerator:
    """Greedy generation for a Llama-family, Qwen2 or Qwen3 transformers model, K/V in kvlab's pool.

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
    * ``decode_step``: a function with the signature of :func:`kvlab.serving.hf.paged_attention_step`
      to use instead of it (chapter 10's exercise);
    * ``attention``: the decode kernels, ``"fast"`` (chapter 09's: a K/V group's query heads
      in one program, a split over the sequence) or ``"teaching"`` (chapter 08's);
    * ``compile_decode``: ``torch.compile`` the padded decode step's forward pass at start-up,
      before the graphs are captured (chapter 09; :class:`~kvlab.serving.hf.graphs.DecodeGraphs`).
      ``None``: :data:`~kvlab.serving.hf.graphs.COMPILE_BY_DEFAULT` where graphs are captured, else off;
    * ``check_steps``: check every step's rows on the host before its forward pass (a few waits
      for the GPU per step; default: only without CUDA, where a bad slot would corrupt memory);
    * ``overlap``: overlap scheduling (see above; default: on a CUDA device). Without CUDA each
      forward pass runs on a worker thread, which stands in for a GPU stream (with overlap or
      not). An attribute: ``gen.overlap = False`` turns it off for the next calls;
    * ``policy``: what to do when KV memory runs out (chapter 12, :mod:`kvlab.serving.pressure`):
      ``"reserve"`` (each answer's whole length at admission: no step runs short),
      ``"recompute"``, ``"retract"``, ``"swap"`` (``host_pages``: its host pool, in pages;
      default as many as the device pool), or a :class:`kvlab.serving.pressure.Policy`.
    """

    def __init__(self, model, page_size: int = 16, num_pages: int = 256, *, max_running: int = 256,
                 max_seq_len: int | None = None, prefill_budget: int = 8192,
                 chunked_prefill: bool = True, decode_graphs: str = "auto",
                 graph_sizes: Sequence[int] | None = None, decode_step: Callable | None = None,
                 check_steps: bool | None = None, attention: str = "fast",
                 compile_decode: bool | None = None, overlap: bool | None = None, policy="reserve",
                 host_pages: int | None = None):
        from ...attention.kv_pool import KVPool
        from ...alloc.paging import new_page_table
        from ..pressure import make_policy
        from .swap import HostKV

        check_model(model)
        self.model = model
        self.page_size = check_page_size(page_size)
        self.num_pages = check_int("num_pages", num_pages, minimum=1)
        self.max_running = check_int("max_running", max_running, minimum=1)
        self.prefill_budget = check_int("prefill_budget", prefill_budget, minimum=1)
        self.chunked_prefill = check_bool("chunked_prefill", chunked_prefill)
        self.policy = make_policy(policy)
        if host_pages is not None:
            host_pages = check_int("host_pages", host_pages, minimum=0)
        c = model.config
        self._row_limit = "max_seq_len"
        if max_seq_len is None:
            max_seq_len = self.num_pages * self.page_size
            positions = getattr(c, "max_position_embeddings", None)
            if positions and positions < max_seq_len:
                max_seq_len, self._row_limit = positions, "the model's max_position_embeddings"
        max_seq_len = check_int("max_seq_len", max_seq_len, minimum=1)
        if decode_step is not None and not callable(decode_step):
            raise InvalidArgument("decode_step", "a function like kvlab.serving.hf.paged_attention_step",
                                  f"got {type(decode_step).__name__}")
        if decode_graphs not in GRAPH_MODES:
            raise InvalidArgument("decode_graphs", f"one of {GRAPH_MODES}", f"got {decode_graphs!r}")
        self.decode_step = decode_step
        self.attention = check_impl(attention, "attention")
        if compile_decode is not None:
            check_bool("compile_decode", compile_decode)
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        self.group = heads // kv_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        device = model.device
        self.check_steps = device.type != "cuda" if check_steps is None else check_bool(
            "check_steps", check_steps)
        self.overlap = device.type == "cuda" if overlap is None else overlap
        self._queues: dict[bool, DeviceQueue] = {}
        # overlap: each page-table row's last sampled token, which the row's next decode step
        # reads on the device (the host learns it one step later); the dummy row's too
        self.last_tokens = torch.zeros(self.max_running + 1, dtype=torch.int64, device=device)
        # one row more than max_running: the dummy request's (new_page_table makes it)
        self.page_table = new_page_table(self.max_running, max_seq_len, self.page_size, device)
        self.dummy_row = self.max_running
        # one page more than the manager hands out: the dummy page, where padded entries write
        self.pool = KVPool((self.num_pages + 1) * self.page_size, c.num_hidden_layers, kv_heads,
                           head_dim, dtype=model.dtype, device=device)
        self._map_dummy_row()
        # the swap policy's host pool (pinned on CUDA): where stopped requests' K/V waits
        self.host = (HostKV(self.pool, self.page_size, self.num_pages if host_pages is None else host_pages)
                     if self.policy.on_preempt == "swap" else None)
        self.clear_prefix_cache()
        self.stats: dict[str, int] = {}
        self.requests: list[RequestStats] = []
        self.logits: list[torch.Tensor] = []
        register_attention()
        self.graphs = self._decode_graphs(decode_graphs, graph_sizes, compile_decode)
        self.timeline: list[StepTimes] = []

    @property
    def overlap(self) -> bool:
        """Overlap scheduling on (settable between calls)."""
        return self._overlap

    @overlap.setter
    def overlap(self, value: bool) -> None:
        self._overlap = check_bool("overlap", value)

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
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
            raise InvalidArgument("graph_sizes", "a list of batch sizes", f"got {type(sizes).__name__}")
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
        from ...alloc.paging import page_to_token, write_page_table_triton

        dummy = self.num_pages * self.page_size
        self.page_table[self.dummy_row].fill_(dummy)
        page = torch.tensor([dummy], dtype=torch.int32, device=self.page_table.device)
        write_page_table_triton(self.page_table, page_to_token(page, self.page_size),
                                [(self.dummy_row, 0, 1)], self.page_size)

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix: all pages free again, as in a fresh generator (a cold
        cache). The pool, the page table and any captured graphs stay."""
        from ...manager.cache_manager import CacheManager

        # without CUDA the page table is written by plain torch: the Triton interpreter serves
        # one kernel at a time, and the forward pass may run on a worker thread meanwhile
        writer = "triton" if self.page_table.device.type == "cuda" else "host"
        self._settle()
        self.manager = CacheManager(self.num_pages, self.page_size, self.page_table,
                                    page_table_writer=writer)

    # --- the public call ------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens=32, *,
                 output_logits: bool = False, on_step: Callable[[StepInfo], None] | None = None,
                 arrivals: Sequence[float] | None = None, timeline: bool = False,
                 end_after: Sequence[int] | None = None) -> list[list[int]]:
        """New tokens per prompt (greedy; stops at EOS as ``generate`` does).

        ``max_new_tokens``: one number for all prompts, or one per prompt.
        ``output_logits=True`` keeps, in ``self.logits[i]``, the float32 logits behind each
        token of prompt ``i`` (``[new_tokens, vocab]``, on the CPU). ``on_step(StepInfo)``
        is called after every step (e.g. to photograph ``self.page_table``). ``arrivals``:
        per prompt, seconds after the call begins before which it is not admitted (an online
        server's requests; ``self.requests[i].times`` says when each token reached the
        host). ``timeline=True``: ``self.timeline`` gets one :class:`StepTimes` per step.
        ``end_after[i]``: prompt ``i`` ends after that many new tokens as if the model had
        produced an end of text there (``finished_by="stop"``; the scheduler does not know it
        in advance: a stand-in for EOS on a model whose answers never end, as a random one's).
        Checks everything first: bad arguments raise :class:`~kvlab.InvalidArgument` and a
        prompt the pool can never hold raises :class:`~kvlab.OutOfPages`, with nothing
        changed. After any error or interrupt every page is accounted for again and the
        generator is ready for the next call.
        """
        seqs = self._check(prompts, max_new_tokens, arrivals)
        ends = self._check_end_after(end_after, seqs)
        check_bool("output_logits", output_logits)
        check_bool("timeline", timeline)
        if on_step is not None and not callable(on_step):
            raise InvalidArgument("on_step", "a function of one StepInfo, or None",
                                  f"got {type(on_step).__name__}")
        self._settle()                         # what an interrupted call left, if anything
        overlap = self.overlap
        queue = self._queue(overlap)
        queue.begin(timeline)
        loop = ServingLoop(self, seqs, eos=eos_token_ids(self.model), overlap=overlap, queue=queue,
                           output_logits=output_logits, on_step=on_step, ends=ends)
        with paged_attention_active(self.model), torch.inference_mode():
            try:
                loop.run()
            except BaseException:
                self._settle()                 # give their pages back; the cache keeps what it has
                raise
        self.manager.check_integrity()
        loop.stats["generated"] = sum(len(s.tokens) for s in seqs)
        self.stats = loop.stats
        self.timeline = loop.timeline
        self.requests = [RequestStats(len(s.prompt), s.cached, len(s.prompt) - s.cached,
                                      len(s.tokens), s.finished_by, s.stops, s.recomputed,
                                      tuple(s.token_steps), s.arrival, tuple(s.times)) for s in seqs]
        self.logits = [torch.stack(s.logits) for s in seqs] if output_logits else []
        return [s.tokens for s in seqs]

    def _queue(self, overlap: bool) -> DeviceQueue:
        if overlap not in self._queues:
            self._queues[overlap] = device_queue(self.page_table.device)
        return self._queues[overlap]

    def _settle(self) -> None:
        """Make the state whole again after a call that failed or was interrupted anywhere:
        wait for the device work it left, then release every request still holding a row
        (between calls none does). Read from the state itself, so it finishes the job
        whether or not an earlier attempt was itself interrupted."""
        for queue in getattr(self, "_queues", {}).values():
            queue.drain()
        manager = getattr(self, "manager", None)
        for req in list(manager.running) if manager is not None else []:
            manager.release_req(req)

    # --- before anything changes ----------------------------------------------------------

    def _check(self, prompts, max_new_tokens, arrivals) -> list[Seq]:
        if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, Sequence):
            raise InvalidArgument("prompts", "a list of prompts, each a list of token ids",
                                  f"got {type(prompts).__name__}")
        if len(prompts) == 0:
            raise InvalidArgument("prompts", "at least one prompt", "got none")
        max_new = _per_prompt("max_new_tokens", max_new_tokens, len(prompts))
        max_new = [check_int(name, m, minimum=1) for name, m in max_new]
        times = [0.0] * len(prompts)
        if arrivals is not None:
            times = []
            for name, t in _per_prompt("arrivals", arrivals, len(prompts), scalar=False):
                if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                    raise InvalidArgument(name, "a finite number of seconds >= 0", f"got {t!r}")
                times.append(float(t))
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
            positions = len(ids) + max_new[i] - 1   # the last new token's K/V is never computed
            if div_ceil(positions, P) > self.num_pages:
                raise OutOfPages(div_ceil(positions, P), self.num_pages,
                                 f"request (prompts[{i}]: {len(ids)} prompt tokens + {max_new[i]} new, "
                                 f"pages of {P}; the pool has {self.num_pages} pages in all)")
            if positions > cols:
                raise InvalidArgument(f"prompts[{i}]", f"len(prompt) + max_new_tokens - 1 <= {cols} "
                                      f"(positions of a page-table row: {self._row_limit})",
                                      f"got {len(ids)} + {max_new[i]} - 1")
            seqs.append(Seq(i, ids, max_new=max_new[i], arrival=times[i]))
        return seqs

    @staticmethod
    def _check_end_after(end_after, seqs: list[Seq]) -> list:
        if end_after is None:
            return [None] * len(seqs)
        return [check_int(name, e, minimum=1) for name, e in
                _per_prompt("end_after", end_after, len(seqs), scalar=False)]

    # --- one forward step ------------------------------------------------------------------

    def _launch_step(self, step, produces: Sequence[bool], queue: DeviceQueue, *, overlap: bool,
                     output_logits: bool):
        """Hand the forward pass over every request's new tokens of ``step`` (a
        :class:`~kvlab.manager.req.ForwardBatch`, pages mapped) to ``queue``: the greedy next token of
        each request with ``produces[b]`` (and its logits, if wanted), copied to the host.
        Returns the queue's ticket and the captured batch size a decode-only step runs at (0:
        one packed eager pass). ``overlap``: decoding requests read their input token on the
        device (``last_tokens``) and every new token is written back there."""
        if self.check_steps:
            check_rows_mapped(self.page_table, step.rows(), step.seq_lens(), self.pool.num_slots)
        last_tokens = self.last_tokens if overlap else None
        if self.graphs is not None and not any(step.prefilling) and self.graphs.fits(len(step)):
            ids = [req.input_ids[start] for req, start in zip(step.reqs, step.start)]
            rows, starts, graphs = step.table_idx, step.start, self.graphs

            def work():
                tokens, logits = graphs.run(ids, rows, starts, last_tokens)
                return to_host(tokens), to_host(logits) if output_logits else None
            return queue.submit(work), graphs.padded_size(len(step))
        inputs = build_step(step, self.pool, self.page_table, produces, self.group, self.decode_step,
                            self.attention)
        model = self.model

        def work():
            ids = inputs.input_ids
            if last_tokens is not None and inputs.decode_index.numel():
                ids[inputs.decode_index] = last_tokens[inputs.decode_rows]
            out = model(input_ids=ids[None], position_ids=inputs.positions[None], use_cache=False,
                        logits_to_keep=inputs.keep, kvlab_step=inputs.batch)
            logits = out.logits[0]
            tokens = logits.argmax(-1)
            if last_tokens is not None:
                last_tokens[inputs.keep_rows] = tokens
            return to_host(tokens), to_host(logits) if output_logits else None
        return queue.submit(work), 0


def _per_prompt(name: str, value, n: int, *, scalar: bool = True) -> list[tuple[str, object]]:
    """``value`` for each of ``n`` prompts, with the name to blame: one for all (``scalar``),
    or a list of ``n``."""
    if scalar and (isinstance(value, bool) or not isinstance(value, Sequence) or isinstance(value, (str, bytes))):
        return [(name, value)] * n
    if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Sequence):
        raise InvalidArgument(name, f"a list of {n} (one per prompt)", f"got {type(value).__name__}")
    if len(value) != n:
        raise InvalidArgument(name, f"one per prompt ({n})", f"got {len(value)}")
    return [(f"{name}[{i}]", v) for i, v in enumerate(value)]
