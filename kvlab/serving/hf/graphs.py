"""Decode steps replayed from CUDA graphs, padded with the page table's dummy row (chapter 10).

A decode step of a small model is a few hundred small kernels, each launched from Python:
the GPU waits for the host. A CUDA graph records those launches once and replays them with
one call. Its shapes and addresses are frozen, so a server captures the decode step at a
few batch sizes, reading its inputs from fixed buffers, and pads a batch up to the next
captured size. mini-sglang (``python/minisgl/engine/graph.py``, ``GraphRunner``) captures at
``[1, 2, 4]`` and every multiple of 8 up to a maximum (``_determine_cuda_graph_bs``), largest
first, all graphs sharing one memory pool; a batch larger than the largest size runs
without a graph. Its engine (``engine/engine.py``) keeps one extra page-table row for a
*dummy request* (row ``max_running_req``) and one extra page in the KV pool (the
*dummy page*, page ``num_pages``, which no request ever owns), and fills the dummy row with
the dummy page's slot. Padded entries of the batch are that request at position 0, so they
write their K/V into the dummy page and read only it::

    page table                                   KV pool
    row 0    [ 12 13 14 15 | 40 41 42 .. ]        page 3  = slots 12..15   (request A)
    row 1    [  4  5  6  7 | ..          ]        ...
    row R    [  D  D  D  D   D  D  D  D ]  dummy  page num_pages = slots D..D+P-1: nobody's

    5 running requests, padded to the captured size 8:
    entry       0   1   2   3   4 |  5  6  7
    row         3   0   7   1   2 |  R  R  R
    position   40  17  33   8  21 |  0  0  0
    slot       ..  ..  ..  ..  .. |  D  D  D        (page_table[row, position])

:func:`pad_decode_batch` is that padding (chapter 10's exercise); :class:`DecodeGraphs`
keeps the buffers and the graphs and runs a decode step through them. Without CUDA (the
interpreter) it runs the very same padded step without capturing it, so the tokens are the
same everywhere.

Before capturing, it can ``torch.compile`` the step's forward pass (chapter 09): the many small
kernels of a transformers layer (norms, RoPE, activations, residual adds) fused into a few,
the attention call left as it is (a graph break), the batch size symbolic so that one
compilation serves every captured size. SGLang's ``--enable-torch-compile`` does the same
before its capture, compiling per batch size (``patch_model`` in
``python/sglang/srt/model_executor/cuda_graph_runner.py``).
"""
from __future__ import annotations

import gc
from contextlib import nullcontext
from typing import Callable, Sequence

import torch

from ...base.args import check_int
from ...base.errors import InvalidArgument
from .attention_steps import warm_up_fast_kernels
from .fuse import fuse_projections, fused_forwards
from .step import StepBatch, to_device

__all__ = ["graph_batch_sizes", "graph_size", "check_pad_inputs", "pad_decode_batch", "DecodeGraphs",
           "dynamo_graphs", "COMPILE_BY_DEFAULT"]


#: whether PagedGenerator compiles its captured decode step unless told (compile_decode=None):
#: on an H200 the compiled step of the serving model replays faster at 64 and 256 running
#: requests, for tens of seconds more start-up (python -m kvlab.bench --attention measures both;
#: figures/bench.md); without graphs (in the interpreter) it stays off
COMPILE_BY_DEFAULT = True


def dynamo_graphs() -> int:
    """How many graphs ``torch.compile`` has built in this process so far: a recompile builds
    one more, so a serving loop that compiles nothing after start-up leaves it unchanged."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def graph_batch_sizes(max_bs: int) -> list[int]:
    """The batch sizes mini-sglang captures: 1, 2, 4, then every multiple of 8 up to ``max_bs``."""
    max_bs = check_int("max_bs", max_bs, minimum=1)
    return [s for s in (1, 2, 4) if s <= max_bs] + list(range(8, max_bs + 1, 8))


def graph_size(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``n`` requests (``None``: larger than every size)."""
    return next((s for s in sorted(sizes) if s >= n), None)


def check_pad_inputs(rows, positions, page_table, sizes, dummy_row) -> list[int]:
    """The rules of :func:`pad_decode_batch` (a few waits for the GPU: the entries' values);
    returns the sizes as ints."""
    if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2:
        raise InvalidArgument("page_table", "a 2-D tensor (rows x positions)", f"got {type(page_table).__name__}")
    n_rows, cols = page_table.shape
    for name, t, limit in (("rows", rows, n_rows), ("positions", positions, cols)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise InvalidArgument(name, "a 1-D integer tensor, one entry per request",
                                  f"got {getattr(t, 'shape', type(t).__name__)}")
        if t.device != page_table.device:
            raise InvalidArgument(name, f"on the page table's device ({page_table.device})", f"got {t.device}")
        if t.numel() and not bool(((t >= 0) & (t < limit)).all()):
            raise InvalidArgument(name, f"entries in [0, {limit})", f"got min {int(t.min())}, max {int(t.max())}")
    if rows.numel() != positions.numel():
        raise InvalidArgument("positions", f"one per request ({rows.numel()})", f"got {positions.numel()}")
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
        raise InvalidArgument("sizes", "a non-empty list of batch sizes", f"got {sizes!r}")
    sizes = [check_int(f"sizes[{i}]", s, minimum=1) for i, s in enumerate(sizes)]
    check_int("dummy_row", dummy_row, minimum=0)
    if dummy_row >= n_rows:
        raise InvalidArgument("dummy_row", f"a row of the page table, in [0, {n_rows})", f"got {dummy_row}")
    return sizes


def pad_decode_batch(rows: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor,
                     sizes: Sequence[int], dummy_row: int, *, check: bool = True):
    """Pad one decode step's entries up to the next captured batch size (mini-sglang's
    ``GraphRunner.pad_batch``).

    ``rows[b]``, ``positions[b]``: request ``b``'s page-table row and the position of its new
    token (int64 tensors, on the page table's device). Returns ``(rows, positions, slots)``
    of length ``graph_size(len(rows), sizes)``: the real entries unchanged, then padded entries
    of the dummy request (row ``dummy_row``, position 0), and every entry's K/V slot
    ``page_table[rows, positions]`` -- for a padded entry the dummy page's. A batch larger
    than every size is returned unpadded (it runs without a graph). ``check=False`` skips
    :func:`check_pad_inputs` (the decode graphs' own entries, every step).
    """
    if check:
        sizes = check_pad_inputs(rows, positions, page_table, sizes, dummy_row)
    n = len(rows)
    size = graph_size(n, sizes) or n
    rows = torch.cat([rows, rows.new_full((size - n,), dummy_row)])
    positions = torch.cat([positions, positions.new_zeros(size - n)])
    return rows, positions, page_table[rows, positions]


class DecodeGraphs:
    """The decode step at the batch sizes ``sizes``: fixed input buffers, and a CUDA graph
    per size captured at construction (``capture=True``) or the same step run eagerly.

    :meth:`run` takes the real entries (token ids, rows, positions), pads them with the dummy
    request, runs the step and returns each real entry's greedy next token and logits.
    ``attention``: the decode kernels (:func:`~kvlab.serving.hf.attention_steps.paged_attention_step`'s
    ``impl``; the fast ones are compiled for both of their variants here, at start-up).
    ``compile``: ``torch.compile`` the step's forward pass first (:meth:`_compile`, chapter 09);
    ``graphs_at_start`` then counts the graphs it built, for a check that none follow.
    ``fuse``: each layer's q/k/v and gate/up projections computed as one product each in the
    step (:mod:`kvlab.serving.hf.fuse`; the model's weights become views of the fused ones, in place).
    """

    def __init__(self, model, pool, page_table: torch.Tensor, dummy_row: int,
                 sizes: Sequence[int], *, capture: bool, decode_step: Callable | None = None,
                 attention: str = "fast", compile: bool = False, fuse: bool = True):
        if not sizes:
            raise InvalidArgument("sizes", "at least one batch size", "got none")
        if capture and page_table.device.type != "cuda":
            raise InvalidArgument("decode_graphs", '"capture" needs a model on a CUDA device (graphs '
                                  'record GPU work): use "eager" or "off" elsewhere',
                                  f"the model is on {page_table.device}")
        self.model = model
        self.page_table = page_table
        self.dummy_row = dummy_row
        self.sizes = sorted(sizes)
        self.capture = capture
        device = page_table.device
        max_bs = self.sizes[-1]
        # the entries' token ids, positions and page-table rows: the graphs read these buffers
        self.ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.rows = torch.full((max_bs,), dummy_row, dtype=torch.int64, device=device)
        self.logits = torch.zeros(max_bs, model.config.vocab_size, dtype=model.dtype, device=device)
        self.tokens = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.steps = {bs: StepBatch(pool=pool, page_table=page_table, single_rows=self.rows[:bs],
                                    single_positions=self.positions[:bs], decode_step=decode_step,
                                    attention=attention)
                      for bs in self.sizes}
        self.compiled = compile
        self.fuse = fuse
        #: projection groups computed as one product in the step (see :mod:`kvlab.serving.hf.fuse`)
        self.fused_groups = fuse_projections(model) if fuse else 0
        self._model_forward = model.forward
        if compile:
            self._compile()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if decode_step is None and attention == "fast":
            warm_up_fast_kernels(pool.k[0], pool.v[0], page_table, dummy_row,
                                 model.config.num_attention_heads, model.dtype)
        if capture:
            self._capture()
        elif compile:
            for bs in reversed(self.sizes):    # compile now, at start-up, not while serving
                self._forward(bs)
        #: graphs torch.compile had built when start-up ended (see :func:`dynamo_graphs`)
        self.graphs_at_start = dynamo_graphs() if compile else None

    def fits(self, n: int) -> bool:
        """A decode step of ``n`` requests has a size to run at."""
        return n <= self.sizes[-1]

    def padded_size(self, n: int) -> int:
        return graph_size(n, self.sizes) or n

    def _compile(self) -> None:
        """``torch.compile`` the model's forward pass, the attention call left out
        (:func:`kvlab.serving.hf.plugin.kvlab_attention` is ``torch.compiler.disable``-d: a graph
        break), so the K/V store and the Triton kernels run as they are, and the compiler fuses what lies between two attention calls -- norms, RoPE,
        activations, residual adds -- into a few kernels. The batch size is a symbolic size
        (``dynamic=True``), so all sizes share the compiled code: one compilation (and one for
        size 1) at start-up rather than one per size."""
        self._model_forward = torch.compile(self.model.forward, dynamic=True)

    def _forward(self, bs: int) -> None:
        """The step at size ``bs``: what a graph records and replays."""
        ids, positions = self.ids[:bs], self.positions[:bs]
        step = self.steps[bs]
        # what every layer's attention reads, computed once per step (a graph records it once)
        step.single_slots = self.page_table[self.rows[:bs], positions].long()
        step.single_seq_lens = positions + 1
        with fused_forwards(self.model) if self.fuse else nullcontext():
            logits = self._model_forward(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                                         logits_to_keep=0, kvlab_step=step).logits[0]
        self.logits[:bs].copy_(logits)
        torch.argmax(logits, dim=-1, out=self.tokens[:bs])

    def _capture(self) -> None:
        """Largest size first, one memory pool for all (mini-sglang's order); every entry the
        dummy request. A run before each capture compiles and initialises what it uses.

        Python's garbage collector stays off meanwhile: collecting an old generator in the
        middle of a capture would free its graphs' memory (a ``cudaFree``), which a capture
        does not allow."""
        pool = None
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            for bs in reversed(self.sizes):
                self._forward(bs)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(bs)
                pool = graph.pool() if pool is None else pool
                self.graphs[bs] = graph
        finally:
            if was_enabled:
                gc.enable()
        torch.cuda.synchronize(self.page_table.device)

    def run(self, input_ids: Sequence[int], rows: Sequence[int], positions: Sequence[int],
            last_tokens: torch.Tensor | None = None):
        """One decode step of ``len(rows)`` requests (at most the largest size): returns
        ``(tokens, logits)`` of the real entries, on the device. Nothing here waits for the GPU.
        ``last_tokens`` (overlap scheduling): each entry's token id is ``last_tokens[row]`` on
        the device, not ``input_ids``, and the step's new tokens are written back there."""
        n = len(rows)
        entries = to_device(torch.tensor([input_ids, positions, rows], dtype=torch.int64),
                          self.page_table.device)
        rows_p, positions_p, _ = pad_decode_batch(entries[2], entries[1], self.page_table, self.sizes,
                                                  self.dummy_row, check=False)
        bs = len(rows_p)
        self.ids[n:bs].zero_()
        self.ids[:n].copy_(entries[0] if last_tokens is None else last_tokens[entries[2]])
        self.positions[:bs].copy_(positions_p)
        self.rows[:bs].copy_(rows_p)
        if self.capture:
            self.graphs[bs].replay()
        else:
            self._forward(bs)
        if last_tokens is not None:
            last_tokens[entries[2]] = self.tokens[:n]
        return self.tokens[:n], self.logits[:n]
