"""A port of nano-vllm's block manager, for the differential test of chapter 11's hash cache.

Written from the behaviour of ``nanovllm/engine/block_manager.py`` in GeeeekExplorer/nano-vllm
at commit 2f352aea436c1d8c49a6c15f67b40bb32c0c2a8c (``Block``, ``BlockManager`` with
``compute_hash``, ``allocate``, ``deallocate``, ``can_append``, ``may_append``) and of
``Sequence.block`` / ``num_blocks`` in ``nanovllm/engine/sequence.py``. Kept in ``tests/``:
kvlab never imports it.

One change, said here: ``compute_hash`` uses the first 8 bytes of SHA-256 where nano-vllm
uses xxh64 (``xxhash`` is not a kvlab dependency). It keeps nano-vllm's form: a 64-bit int,
``-1`` for "no parent", the parent as 8 little-endian bytes, then the token ids as NumPy's
int64 bytes. The hash values differ from kvlab's (BLAKE2b), so the test compares pages, not
hash values.
"""
from __future__ import annotations

import hashlib
from collections import deque

import numpy as np


class PortSequence:
    """The parts of nano-vllm's ``Sequence`` the block manager reads."""

    def __init__(self, token_ids, block_size: int):
        self.token_ids = list(token_ids)
        self.block_size = block_size
        self.num_cached_tokens = 0
        self.block_table: list[int] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)


class PortBlock:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    def update(self, h: int, token_ids: list[int]) -> None:
        self.hash = h
        self.token_ids = token_ids

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []


class NanoBlockManagerPort:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [PortBlock(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    @staticmethod
    def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
        h = hashlib.sha256()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(np.array(token_ids, dtype=np.int64).tobytes())
        return int.from_bytes(h.digest()[:8], "little")

    def _allocate_block(self, block_id: int) -> PortBlock:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.reset()  # the old hash stays in hash_to_block_id (nano-vllm at 2f352ae)
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return block

    def _deallocate_block(self, block_id: int) -> None:
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def can_allocate(self, seq: PortSequence) -> bool:
        return len(self.free_block_ids) >= seq.num_blocks

    def allocate(self, seq: PortSequence) -> None:
        assert not seq.block_table
        h = -1
        cache_miss = False
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h) if len(token_ids) == self.block_size else -1
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                cache_miss = True
            if cache_miss:
                block_id = self.free_block_ids[0]
                block = self._allocate_block(block_id)
            else:
                seq.num_cached_tokens += self.block_size
                if block_id in self.used_block_ids:
                    block = self.blocks[block_id]
                    block.ref_count += 1
                else:
                    block = self._allocate_block(block_id)
            if h != -1:
                block.update(h, token_ids)
                self.hash_to_block_id[h] = block_id
            seq.block_table.append(block_id)

    def deallocate(self, seq: PortSequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq: PortSequence) -> bool:
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: PortSequence) -> None:
        block_table = seq.block_table
        last_block = self.blocks[block_table[-1]]
        if len(seq) % self.block_size == 1:
            assert last_block.hash != -1
            block_id = self.free_block_ids[0]
            self._allocate_block(block_id)
            block_table.append(block_id)
        elif len(seq) % self.block_size == 0:
            assert last_block.hash == -1
            token_ids = seq.block(seq.num_blocks - 1)
            prefix = self.blocks[block_table[-2]].hash if len(block_table) > 1 else -1
            h = self.compute_hash(token_ids, prefix)
            last_block.update(h, token_ids)
            self.hash_to_block_id[h] = last_block.block_id
        else:
            assert last_block.hash == -1

    # --- read-only views for the test (not in nano-vllm) ------------------------------------

    def cached_blocks(self) -> set[int]:
        """Blocks a lookup can find: the map sends their own hash to them."""
        return {b for h, b in self.hash_to_block_id.items() if self.blocks[b].hash == h}

    def stale_hit(self, seq: PortSequence) -> int | None:
        """The block ``allocate(seq)`` would take as a hit through a map entry its block no
        longer carries (the block was reused, then filled with the same tokens after another
        prefix), or None."""
        h = -1
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            if len(token_ids) < self.block_size:
                return None
            h = self.compute_hash(token_ids, h)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                return None
            if self.blocks[block_id].hash != h:
                return block_id
        return None

    def registers_a_twin(self, seq: PortSequence) -> bool:
        """Whether ``may_append(seq)`` would point the map away from another block that is in
        use and carries the same hash (two sequences filled identical pages)."""
        if len(seq) % self.block_size != 0:
            return False
        prefix = self.blocks[seq.block_table[-2]].hash if len(seq.block_table) > 1 else -1
        h = self.compute_hash(seq.block(seq.num_blocks - 1), prefix)
        other = self.hash_to_block_id.get(h)
        return (other is not None and other != seq.block_table[-1] and self.blocks[other].hash == h
                and self.blocks[other].ref_count > 0)
