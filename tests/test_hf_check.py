"""Chapter 10's checker, kvlab.check.paged_attention_step: it passes the reference solution,
says "not attempted" for the starter, and names each common mistake."""
from __future__ import annotations

import pytest
import torch

import kvlab
import kvlab.check
from kvlab.check import CheckFailed
from kvlab.course.exercises.ch10_hf import paged_attention_step_solution
from kvlab.serving.hf.attention_steps import paged_attention_reference, paged_decode_attention


def test_the_solution_and_the_package_pass(capsys):
    kvlab.check.paged_attention_step(paged_attention_step_solution, n_random=2)
    assert "✓ paged_attention_step: all 12 cases pass" in capsys.readouterr().out
    kvlab.check.paged_attention_step(kvlab.serving.hf.paged_attention_step, n_random=1)
    assert "✓ paged_attention_step: all 11 cases pass" in capsys.readouterr().out


def test_the_starter_is_not_attempted(capsys):
    def my_step(q, k, v, k_pool, v_pool, page_table, rows, positions, scale):
        # YOUR CODE HERE: paged_attention_step
        raise NotImplementedError("write the step")

    assert kvlab.check.paged_attention_step(my_step) is None
    assert "not attempted yet: paged_attention_step" in capsys.readouterr().out
    assert kvlab.check.status("paged_attention_step") == "not attempted"


def no_page_table(q, k, v, k_pool, v_pool, page_table, rows, positions, scale):
    k_pool[positions.long()] = k
    v_pool[positions.long()] = v
    return paged_decode_attention(q, k_pool, v_pool, page_table, rows, positions + 1, scale)


def row_b(q, k, v, k_pool, v_pool, page_table, rows, positions, scale):
    slots = page_table[torch.arange(len(rows)), positions].long()
    k_pool[slots] = k
    v_pool[slots] = v
    return paged_decode_attention(q, k_pool, v_pool, page_table, rows, positions + 1, scale)


def only_k(q, k, v, k_pool, v_pool, page_table, rows, positions, scale):
    slots = page_table[rows, positions].long()
    k_pool[slots] = k
    return paged_decode_attention(q, k_pool, v_pool, page_table, rows, positions + 1, scale)


def without_itself(q, k, v, k_pool, v_pool, page_table, rows, positions, scale):
    slots = page_table[rows, positions].long()
    k_pool[slots] = k
    v_pool[slots] = v
    return paged_attention_reference(q, k_pool, v_pool, page_table, rows,
                                     positions.clamp(min=1), scale)


def attend_then_store(q, k, v, k_pool, v_pool, page_table, rows, positions, scale):
    out = paged_attention_reference(q, k_pool, v_pool, page_table, rows, positions + 1, scale)
    slots = page_table[rows, positions].long()
    k_pool[slots] = k
    v_pool[slots] = v
    return out


def heads_modulo(q, k, v, k_pool, v_pool, page_table, rows, positions, scale):
    slots = page_table[rows, positions].long()
    k_pool[slots] = k
    v_pool[slots] = v
    group = q.shape[1] // k_pool.shape[1]
    return paged_attention_reference(q, k_pool.repeat(1, group, 1), v_pool.repeat(1, group, 1),
                                     page_table, rows, positions + 1, scale)


@pytest.mark.parametrize("wrong, says", [
    (no_page_table, "slot positions[b], not at the slot its page-table row names"),
    # rows[b] replaced by b in the first case (one request, its first token) writes where one
    # position too far would write too (row 0 maps nothing there): the message names no cause
    (row_b, "request 0's new K should be in slot 0"),
    (only_k, "v_pool"),
    (without_itself, "must see itself"),
    (attend_then_store, "attends before writing"),
    (heads_modulo, "h // (heads // kv_heads)"),
])
def test_each_mistake_is_named(wrong, says):
    with pytest.raises(CheckFailed) as err:
        kvlab.check.paged_attention_step(wrong, n_random=0)
    assert says in str(err.value)
    assert ("looks like" in str(err.value)) == (wrong is not row_b)
    assert kvlab.check.status("paged_attention_step") == "failed"


# --- the padding of a decode step (kvlab.check.pad_decode_batch) -------------------------

from kvlab.course.exercises.ch10_graphs import pad_decode_batch_solution  # noqa: E402


def test_pad_decode_batch_passes_the_solution_and_the_package(capsys):
    kvlab.check.pad_decode_batch(pad_decode_batch_solution, n_random=2)
    assert "✓ pad_decode_batch: all 14 cases pass" in capsys.readouterr().out
    kvlab.check.pad_decode_batch(kvlab.serving.hf.pad_decode_batch, n_random=3)
    assert "✓ pad_decode_batch: all 15 cases pass" in capsys.readouterr().out
    assert kvlab.check.status("pad_decode_batch") == "passed"


def test_pad_decode_batch_starter_is_not_attempted(capsys):
    def my_pad(rows, positions, page_table, sizes, dummy_row):
        # YOUR CODE HERE: pad_decode_batch
        raise NotImplementedError("pad the step")

    assert kvlab.check.pad_decode_batch(my_pad) is None
    assert "not attempted yet: pad_decode_batch" in capsys.readouterr().out
    assert kvlab.check.status("pad_decode_batch") == "not attempted"


def _padded(rows, positions, sizes, dummy, *, size=None, pad_row=None, pad_position=None):
    n = len(rows)
    size = size if size is not None else next((s for s in sorted(sizes) if s >= n), n)
    r = torch.cat([rows, rows.new_full((size - n,), dummy if pad_row is None else pad_row)])
    fill = positions.new_zeros(size - n) if pad_position is None else positions[-1:].repeat(size - n)
    return r, torch.cat([positions, fill])


def largest_size(rows, positions, table, sizes, dummy):
    r, p = _padded(rows, positions, sizes, dummy, size=max(max(sizes), len(rows)))
    return r, p, table[r, p]


def no_padding(rows, positions, table, sizes, dummy):
    return rows, positions, table[rows, positions]


def row_zero(rows, positions, table, sizes, dummy):
    r, p = _padded(rows, positions, sizes, dummy, pad_row=0)
    return r, p, table[r, p]


def last_position(rows, positions, table, sizes, dummy):
    r, p = _padded(rows, positions, sizes, dummy, pad_position="last")
    return r, p, table[r, p]


def slots_are_positions(rows, positions, table, sizes, dummy):
    r, p = _padded(rows, positions, sizes, dummy)
    return r, p, p


@pytest.mark.parametrize("wrong, says", [
    (largest_size, "always pads to the largest captured size"),
    (no_padding, "did not pad at all"),
    (row_zero, "a real request's row"),
    (last_position, "the dummy request is at position 0"),
    (slots_are_positions, "page_table[row, position]"),
])
def test_each_padding_mistake_is_named(wrong, says):
    with pytest.raises(CheckFailed) as err:
        kvlab.check.pad_decode_batch(wrong, n_random=0)
    assert says in str(err.value)
    assert kvlab.check.status("pad_decode_batch") == "failed"
