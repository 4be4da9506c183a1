"""A request, and a batch of requests for one forward pass, as the cache manager sees them.

Built in chapter 06 beside :class:`~kvlab.manager.cache_manager.CacheManager` (mini-sglang keeps the
same two in ``core.py``: ``Req`` and ``Batch``). The two lengths drive everything::

    position  0 .............. cached_len ............. device_len
              [ KV computed, mapped in the row | computed by the coming forward pass ]

A forward pass computes the KV of positions ``[cached_len, device_len)``; afterwards
``complete_one`` moves ``cached_len`` up to ``device_len`` and ``device_len`` one further (room
for the token the pass produced, whose KV the next pass computes).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..base.args import check_int, check_token_ids
from ..base.errors import InvalidArgument
from ..prefix.hash_chain import HashCacheHandle
from ..prefix.radix_node import RadixCacheHandle

__all__ = ["Req", "ForwardBatch"]


@dataclass(eq=False)
class Req:
    """A request as the cache manager sees it (mini-sglang's meanings).

    * ``input_ids``: prompt plus generated tokens so far (kept as a list of ints).
    * ``table_idx``: its row in the page table.
    * ``cached_len``: tokens whose KV is computed and mapped in the row (valid to read).
    * ``device_len``: tokens that will be on the device after the coming step.
    * ``cache_handle``: the locked prefix-cache handle covering ``[0, handle.cached_len)``.

    Compared by identity (``eq=False``): a request is also the owner of its cache locks.
    Every field is checked on construction (``InvalidArgument`` naming it).
    """

    input_ids: list
    table_idx: int
    cached_len: int = 0
    device_len: int = -1  # -1: len(input_ids)
    cache_handle: RadixCacheHandle | HashCacheHandle | None = None
    rid: int = -1
    max_new_tokens: int = 0
    finished: bool = False
    prompt_len: int = field(default=-1)

    def __post_init__(self):
        self.input_ids = check_token_ids("req.input_ids", self.input_ids)
        self.table_idx = check_int("req.table_idx", self.table_idx, minimum=0)
        self.cached_len = check_int("req.cached_len", self.cached_len, minimum=0)
        self.device_len = check_int("req.device_len", self.device_len, minimum=-1)
        self.rid = check_int("req.rid", self.rid)
        self.max_new_tokens = check_int("req.max_new_tokens", self.max_new_tokens, minimum=0)
        self.prompt_len = check_int("req.prompt_len", self.prompt_len, minimum=-1)
        if not isinstance(self.finished, bool):
            raise InvalidArgument("req.finished", "must be a bool", f"got {self.finished!r}")
        if self.cache_handle is not None and not isinstance(self.cache_handle,
                                                            (RadixCacheHandle, HashCacheHandle)):
            raise InvalidArgument("req.cache_handle", "must be None or a prefix-cache handle",
                                  f"got {type(self.cache_handle).__name__}")
        if self.device_len < 0:
            self.device_len = len(self.input_ids)
        if self.prompt_len < 0:
            self.prompt_len = len(self.input_ids)

    @property
    def input_len(self) -> int:
        return len(self.input_ids)

    @property
    def output_len(self) -> int:
        """Tokens generated so far."""
        return len(self.input_ids) - self.prompt_len

    def complete_one(self) -> None:
        """After a forward step: what was on the device is now cached; one more token comes."""
        self.cached_len = self.device_len
        self.device_len += 1

    def append_token(self, token: int) -> None:
        """Record a sampled token (its KV is computed by the next step)."""
        self.input_ids.append(check_int("token", token))


@dataclass(frozen=True, eq=False)
class ForwardBatch:
    """What one forward pass computes: for request ``i``, the KV of positions
    ``[start[i], end[i])`` (its ``cached_len`` and ``device_len`` when the batch was made).

    Made by :meth:`CacheManager.prefill <kvlab.manager.cache_manager.CacheManager.prefill>`,
    :meth:`~kvlab.manager.cache_manager.CacheManager.decode_step` or
    :meth:`~kvlab.manager.cache_manager.CacheManager.mixed_step` once the pages are mapped; handed
    back to :meth:`~kvlab.manager.cache_manager.CacheManager.complete_step` with the produced tokens.
    In between, a model reads what it needs from here::

        batch.input_ids()   tokens at those positions, request after request
        batch.positions()   the positions themselves           (one per token)
        batch.out_loc()     the KV slot of each of them: where the pass writes K and V
        batch.seq_lens()    end[i]: how many tokens request i's attention reads
        batch.slots(i)      page_table[row i, :end[i]]: every slot request i's attention reads
    """

    reqs: tuple[Req, ...]
    prefilling: tuple[bool, ...]  # per request: this pass computes its prompt (else: one decode token)
    table_idx: tuple[int, ...]
    start: tuple[int, ...]
    end: tuple[int, ...]
    page_table: torch.Tensor = field(repr=False)

    @classmethod
    def of(cls, prefill, decode, page_table: torch.Tensor) -> "ForwardBatch":
        """The batch of ``prefill`` requests, then ``decode`` requests, as their lengths stand now."""
        reqs = tuple(prefill) + tuple(decode)
        return cls(reqs, (True,) * len(prefill) + (False,) * len(decode),
                   tuple(r.table_idx for r in reqs), tuple(r.cached_len for r in reqs),
                   tuple(r.device_len for r in reqs), page_table)

    @property
    def phase(self) -> str:
        """``"prefill"``, ``"decode"``, or ``"mixed"`` (a continuous-batching step: new prompts
        and decoding requests in one pass)."""
        if all(self.prefilling):
            return "prefill"
        return "decode" if not any(self.prefilling) else "mixed"

    def __len__(self) -> int:
        return len(self.reqs)

    @property
    def extend_lens(self) -> tuple[int, ...]:
        """Tokens this pass computes, per request."""
        return tuple(e - s for s, e in zip(self.start, self.end))

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def _device(self) -> torch.device:
        return self.page_table.device

    def positions(self) -> torch.Tensor:
        """``int64``: ``start[i], ..., end[i] - 1`` for each request in turn."""
        parts = [torch.arange(s, e, dtype=torch.int64) for s, e in zip(self.start, self.end)]
        return (torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)).to(self._device())

    def input_ids(self) -> torch.Tensor:
        """``int64``: the token at every position of :meth:`positions`."""
        ids = [t for r, s, e in zip(self.reqs, self.start, self.end) for t in r.input_ids[s:e]]
        return torch.tensor(ids, dtype=torch.int64, device=self._device())

    def out_loc(self) -> torch.Tensor:
        """The KV slot of every position of :meth:`positions` (where this pass writes K/V)."""
        rows = torch.tensor([t for t, n in zip(self.table_idx, self.extend_lens) for _ in range(n)],
                            dtype=torch.int64, device=self._device())
        return self.page_table[rows, self.positions()]

    def seq_lens(self) -> torch.Tensor:
        """``int64``: ``end[i]``, the tokens request ``i``'s attention reads after this pass."""
        return torch.tensor(self.end, dtype=torch.int64, device=self._device())

    def rows(self) -> torch.Tensor:
        """``int64``: each request's page-table row."""
        return torch.tensor(self.table_idx, dtype=torch.int64, device=self._device())

    def slots(self, i: int) -> torch.Tensor:
        """Every slot request ``i``'s attention reads: its row over ``[0, end[i])``."""
        i = check_int("i", i)
        if not 0 <= i < len(self.reqs):
            raise InvalidArgument("i", f"a request of the batch: in [0, {len(self.reqs)})", f"got {i}")
        return self.page_table[self.table_idx[i], : self.end[i]]
