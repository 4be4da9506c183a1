"""The KV pool: K and V of every layer, addressed by physical token slot (chapter 08).

mini-sglang keeps the same piece in ``kvcache/``. The allocator hands out token slots, and slot
``s`` of every layer belongs to the same token, so one slot number addresses a token's K and V
in all layers::

    k[layer]  [num_slots, heads, head_dim]       v[layer]: the same layout
    ┌──────────────────────────────┐
    │ slot 0                       │
    │ ...                          │
    │ slot 8..11  tokens 0..3      │  <- one page (P = 4) of a request's row
    │ slot 20     token 4          │  <- a page the next allocation handed out
    └──────────────────────────────┘
"""
from __future__ import annotations

import random
from typing import NamedTuple

import torch

from ..base.args import check_int, check_int_vector
from ..base.errors import InvalidArgument
from ..base.runtime import default_device

__all__ = ["KVPool", "PagedLayout", "random_paged_layout"]


class KVPool:
    """K and V storage for every layer, addressed by physical token slot.

    ``k[layer]`` and ``v[layer]`` are ``[num_slots, num_heads, head_dim]``. Slot ``s`` of
    every layer belongs to the same token: the allocator hands out slots, not per-layer
    addresses.
    """

    def __init__(self, num_slots: int, num_layers: int, num_heads: int, head_dim: int,
                 *, dtype: torch.dtype = torch.float32, device=None):
        self.num_slots = check_int("num_slots", num_slots, minimum=1)
        self.num_layers = check_int("num_layers", num_layers, minimum=1)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self.device = default_device(device)
        shape = (self.num_layers, self.num_slots, self.num_heads, self.head_dim)
        # zeros, not empty: a slot that was never written reads as 0, never as garbage
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer: int) -> None:
        """Write ``k[i]``, ``v[i]`` (each ``[heads, head_dim]``) at slot ``out_loc[i]`` of ``layer``.

        Every rule is checked first: a refused call writes nothing."""
        layer = check_int("layer", layer)
        if not 0 <= layer < self.num_layers:
            raise InvalidArgument("layer", f"0 <= layer < num_layers={self.num_layers}",
                                  f"got {layer}")
        want = (self.num_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != want:
                raise InvalidArgument(name, f"shape [n, {want[0]}, {want[1]}]",
                                      f"got {list(getattr(t, 'shape', []))}")
        out_loc = check_int_vector("out_loc", torch.as_tensor(out_loc).flatten())
        if k.shape[0] != v.shape[0] or k.shape[0] != out_loc.numel():
            raise InvalidArgument("out_loc", "one slot per row of k and v",
                                  f"{out_loc.numel()} slots, k has {k.shape[0]}, v has {v.shape[0]}")
        if out_loc.numel() == 0:
            return
        lo, hi = int(out_loc.min()), int(out_loc.max())
        if lo < 0 or hi >= self.num_slots:
            raise InvalidArgument("out_loc", f"0 <= slot < num_slots={self.num_slots}",
                                  f"got min {lo}, max {hi}")
        idx = out_loc.to(device=self.device, dtype=torch.int64)
        self.k[layer].index_copy_(0, idx, k.to(device=self.device, dtype=self.k.dtype))
        self.v[layer].index_copy_(0, idx, v.to(device=self.device, dtype=self.v.dtype))


class PagedLayout(NamedTuple):
    """One decode step's input to paged attention (unpacks in the kernels' argument order)."""

    q: torch.Tensor           # [batch, heads, head_dim]   one new query per request
    k_pool: torch.Tensor      # [num_slots, kv_heads, head_dim]
    v_pool: torch.Tensor
    page_table: torch.Tensor  # [batch + 1, cols] int32: request b in row table_idx[b], -1 unmapped
    table_idx: torch.Tensor   # [batch]
    seq_lens: torch.Tensor    # [batch]  request b attends to positions [0, seq_lens[b])


def random_paged_layout(seed: int, page_size: int, seq_lens, *, heads: int = 2,
                        kv_heads: int | None = None, head_dim: int = 16, spare_pages: int = 2,
                        device=None) -> PagedLayout:
    """A seeded pool of random K/V and a page table as an allocator leaves it after some churn:
    each request's tokens on shuffled, disjoint pages, its row chosen at random (the tests,
    the checkers and chapters 08 and 10 all draw their attention inputs from here).

    ``kv_heads`` (default ``heads``) K/V heads, for grouped-query attention.
    """
    kv_heads = heads if kv_heads is None else kv_heads
    seq_lens = [int(n) for n in seq_lens]
    rng = random.Random(seed)
    per_req = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(per_req) + spare_pages
    pages = list(range(num_pages))
    rng.shuffle(pages)
    row_of = list(range(len(seq_lens) + 1))
    rng.shuffle(row_of)
    table = torch.full((len(seq_lens) + 1, max(per_req, default=1) * page_size), -1, dtype=torch.int32)
    taken = 0
    for b, n in enumerate(seq_lens):
        mine = pages[taken:taken + per_req[b]]
        taken += per_req[b]
        table[row_of[b], :n] = torch.tensor([p * page_size + o for p in mine for o in range(page_size)][:n],
                                            dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_pages * page_size, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_pages * page_size, kv_heads, head_dim, generator=gen)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=gen)
    device = default_device(device) if device is not None else torch.device("cpu")
    return PagedLayout(q.to(device), k.to(device), v.to(device), table.to(device),
                       torch.tensor(row_of[:len(seq_lens)], device=device),
                       torch.tensor(seq_lens, device=device))


#: the page a :func:`random_decode_step`'s dummy row maps (its first slot), beyond every real page
DUMMY_PAGE = 30


class DecodeStep(NamedTuple):
    """One decode step's page-table view: request ``b`` in row ``rows[b]``, its new token at
    ``positions[b]``; row ``dummy_row`` maps only the dummy page (chapter 10's padding)."""

    rows: torch.Tensor        # [batch] int64
    positions: torch.Tensor   # [batch] int64
    page_table: torch.Tensor  # [table_rows + 1, cols] int32, -1 unmapped
    dummy_row: int


def random_decode_step(seed: int, page_size: int, seq_lens, table_rows: int = 10,
                       dummy_row: int | None = None) -> DecodeStep:
    """A page table of ``table_rows`` rows plus the dummy row (``dummy_row``, the last by
    default), whose every entry is the first slot of page :data:`DUMMY_PAGE`: request ``b``
    holds ``seq_lens[b]`` positions on shuffled pages below it, in a shuffled row of the others;
    its new token is its last (chapter 10's exercise and its checker draw their steps here)."""
    P, lens = page_size, [int(n) for n in seq_lens]
    rng = random.Random(seed)
    dummy = table_rows if dummy_row is None else dummy_row
    table = torch.full((table_rows + 1, max(lens, default=0) // P * P + P), -1, dtype=torch.int32)
    table[dummy] = DUMMY_PAGE * P
    pages = rng.sample(range(DUMMY_PAGE), sum(-(-n // P) for n in lens))
    rows = rng.sample([r for r in range(table_rows + 1) if r != dummy], len(lens))
    for row, n in zip(rows, lens):
        mine = [pages.pop() for _ in range(-(-n // P))]
        table[row, :len(mine) * P] = torch.tensor([p * P + i for p in mine for i in range(P)])
    return DecodeStep(torch.tensor(rows, dtype=torch.int64),
                      torch.tensor([n - 1 for n in lens], dtype=torch.int64), table, dummy)
