"""Chapter 10's checker, kvlab.check.paged_attention_step: it passes the reference solution,
says "not attempted" for the starter, and names each common mistake."""
from __future__ import annotations

import pytest
import torch

import kvlab
import kvlab.check
from kvlab.check import CheckFailed
from kvlab.check.ch10_hf import paged_attention_step_solution
from kvlab.hf.attention import paged_attention_reference, paged_decode_attention


def test_the_solution_and_the_package_pass():
    assert kvlab.check.paged_attention_step(paged_attention_step_solution, n_random=2) == 12
    assert kvlab.check.paged_attention_step(kvlab.hf.paged_attention_step, n_random=1) == 11


def test_the_starter_is_not_attempted(capsys):
    def my_step(q, k, v, k_pool, v_pool, page_table, rows, positions, scale):
        # YOUR CODE HERE: paged_attention_step
        raise NotImplementedError("write the step")

    assert kvlab.check.paged_attention_step(my_step) == 0
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
    (row_b, "row b instead of row rows[b]"),
    (only_k, "v_pool"),
    (without_itself, "must see itself"),
    (attend_then_store, "attends before writing"),
    (heads_modulo, "h // (heads // kv_heads)"),
])
def test_each_mistake_is_named(wrong, says):
    with pytest.raises(CheckFailed) as err:
        kvlab.check.paged_attention_step(wrong, n_random=0)
    assert says in str(err.value)
    assert kvlab.check.status("paged_attention_step") == "failed"
