"""The batches ``python -m kvlab.bench`` times (chapter 09): seeded, realistic, self-consistent.

An extend batch of ``bs`` requests with mean extend ``m`` has extend lengths that sum to
exactly ``bs * m`` (pairs ``m + d``, ``m - d``), so a case's token count, and with it the
teaching kernel's compile-time size ``next_power_of_2(T)``, is known from its name.

Pool layout of one batch (pages)::

    [ prefix pages of request 0 | request 1 | ... | free pages (shuffled) ............ ]
                                              free_pages = those, in random order

``last_loc`` points at each request's last prefix token on its own last prefix page, so the
rule ``(last_loc + 1) % P == prefix_len % P`` holds.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..base import runtime
from ..base.args import div_ceil

#: (batch size, mean extend tokens) of the timed extend cases
EXTEND_CASES: list[tuple[int, int]] = [(1, 4096), (8, 2048), (64, 512), (256, 128), (256, 2048),
                                       (1, 32768)]
#: batch sizes of the timed decode steps
DECODE_BATCHES: list[int] = [1, 64, 256, 1024]
PAGE_SIZES: list[int] = [1, 16, 64]
#: batch sizes at a fixed total of tokens: shows the teaching kernel's O(bs^2) prefix sums
SCALING_BATCHES: list[int] = [1, 64, 512, 2048, 8192, 16384]
SCALING_TOKENS = 16384
#: (batch size, mean extend) of the public-call rows: one long prompt, mixed batches, many
#: short requests, up to 4096 requests and half a million tokens
PUBLIC_EXTEND_CASES: list[tuple[int, int]] = [(1, 4096), (64, 512), (256, 128), (1024, 64), (4096, 16),
                                              (256, 256), (256, 2048)]
PUBLIC_PAGE_SIZES: list[int] = [16, 64]
PUBLIC_DECODE_BATCHES: list[int] = [1, 64, 256, 1024, 4096]
#: batch sizes at which the host time of the length checks is measured
HOST_CHECK_BATCHES: list[int] = [64, 256, 1024, 4096, 16384]


@dataclass
class ExtendBatch:
    """One extend batch, on the device and (the lengths) on the host."""

    bs: int
    page_size: int
    prefix_lens: torch.Tensor   # [bs] int64, device
    seq_lens: torch.Tensor      # [bs] int64, device
    last_loc: torch.Tensor      # [bs] int64, device
    free_pages: torch.Tensor    # [F] int64, device
    prefix_cpu: list[int]
    seq_cpu: list[int]
    extend_num_tokens: int
    num_new_pages: int

    @property
    def name(self) -> str:
        return f"bs={self.bs} T={self.extend_num_tokens} P={self.page_size}"


@dataclass
class DecodeBatch:
    bs: int
    page_size: int
    seq_lens: torch.Tensor      # [bs] lengths AFTER the new token
    last_loc: torch.Tensor
    free_pages: torch.Tensor
    seq_cpu: list[int]
    num_new_pages: int


def extend_lengths(bs: int, mean_extend: int, rng: random.Random) -> list[int]:
    """``bs`` extend lengths around ``mean_extend`` that sum to exactly ``bs * mean_extend``."""
    lens = [mean_extend] * bs
    for i in range(0, bs - 1, 2):
        d = rng.randint(0, mean_extend // 2)
        lens[i] += d
        lens[i + 1] -= d
    return lens


def make_extend_batch(bs: int, mean_extend: int, page_size: int, *, seed: int = 0,
                      max_prefix: int = 512, slack_pages: int = 64, extend_lens: list[int] | None = None,
                      device: "torch.device | str | None" = None) -> ExtendBatch:
    """A seeded extend batch; ``extend_lens`` overrides the generated lengths."""
    rng = random.Random(seed * 1_000_003 + bs * 7919 + mean_extend * 31 + page_size)
    P = page_size
    ext = extend_lens if extend_lens is not None else extend_lengths(bs, mean_extend, rng)
    pre = [rng.choice([0, rng.randint(1, max_prefix)]) for _ in range(bs)]
    seq = [p + e for p, e in zip(pre, ext)]
    prefix_pages = [div_ceil(p, P) for p in pre]
    new_pages = sum(div_ceil(s, P) - div_ceil(p, P) for p, s in zip(pre, seq))
    used = sum(prefix_pages)
    num_pages = used + new_pages + slack_pages
    last, next_page = [], 0
    for p, n in zip(pre, prefix_pages):
        next_page += n
        last.append((next_page - 1) * P + (p - 1) % P if p > 0 else -1)
    free = list(range(used, num_pages))
    rng.shuffle(free)
    dev = runtime.default_device(device)

    def t(x):
        return torch.tensor(x, dtype=torch.int64, device=dev)

    return ExtendBatch(bs, P, t(pre), t(seq), t(last), t(free), pre, seq, sum(ext), new_pages)


def make_decode_batch(bs: int, page_size: int, *, seed: int = 0, max_len: int = 4096,
                      device: "torch.device | str | None" = None) -> DecodeBatch:
    """A seeded decode step: about one request in P starts a page (all of them when P == 1)."""
    rng = random.Random(seed * 1_000_003 + bs * 13 + page_size)
    P = page_size
    seq = [rng.randint(1, max_len) for _ in range(bs)]
    pages_before = [div_ceil(s - 1, P) for s in seq]
    last, next_page = [], 0
    for s, n in zip(seq, pages_before):
        next_page += n
        last.append((next_page - 1) * P + (s - 2) % P if s > 1 else -1)
    need = sum(1 for s in seq if (s - 1) % P == 0)
    free = list(range(next_page, next_page + need + 64))
    rng.shuffle(free)
    dev = runtime.default_device(device)

    def t(x):
        return torch.tensor(x, dtype=torch.int64, device=dev)

    return DecodeBatch(bs, P, t(seq), t(last), t(free), seq, need)


def page_table_job(batch: ExtendBatch):
    """What the page-table write of ``batch`` needs: ``(page_table, allocated, allocation_info)``.

    Request r writes its new pages ``[ceil(pre/P), ceil(seq/P))`` into row r.
    """
    P = batch.page_size
    info = [(r, div_ceil(p, P), div_ceil(s, P)) for r, (p, s) in
            enumerate(zip(batch.prefix_cpu, batch.seq_cpu))]
    cols = max(last for _, _, last in info) * P
    dev = batch.prefix_lens.device
    table = torch.full((batch.bs + 1, max(cols, P)), -1, dtype=torch.int32, device=dev)
    n_slots = sum((last - first) * P for _, first, last in info)
    allocated = torch.arange(n_slots, dtype=torch.int64, device=dev)
    return table, allocated, info
