"""Plain-Python oracles for chapters 01 and 02: page starts -> token slots, and the page table.

Lists and loops only, so that a reader can check them by eye. Tests, checkers and the
notebooks compare :mod:`kvlab.alloc.paging` (torch and Triton) against these.
"""
from __future__ import annotations

from typing import Sequence


def page_to_token_ref(page_starts: Sequence[int], page_size: int) -> list[int]:
    """Every token slot of the given pages, in order (chapter 01).

    ``page_starts`` holds page-start slots (page id x page_size), e.g. ``[4, 8]`` with
    ``page_size = 4`` gives ``[4, 5, 6, 7, 8, 9, 10, 11]``.
    """
    slots: list[int] = []
    for start in page_starts:
        for offset in range(page_size):
            slots.append(int(start) + offset)
    return slots


def write_page_table_ref(table: Sequence[Sequence[int]], allocated: Sequence[int],
                         allocation_info: Sequence[tuple[int, int, int]],
                         page_size: int) -> list[list[int]]:
    """A new table with ``allocated`` written per ``(table_idx, first_page, last_page)`` (chapter 02).

    Entry by entry, the next ``(last_page - first_page) * page_size`` values of
    ``allocated`` go into row ``table_idx`` at columns ``first_page * page_size`` up to
    (not including) ``last_page * page_size``. ``table`` itself is not modified.
    """
    new_table = [[int(v) for v in row] for row in table]
    taken = 0
    for table_idx, first_page, last_page in allocation_info:
        for column in range(first_page * page_size, last_page * page_size):
            new_table[table_idx][column] = int(allocated[taken])
            taken += 1
    assert taken == len(allocated), f"allocation_info covers {taken} slots, allocated has {len(allocated)}"
    return new_table
