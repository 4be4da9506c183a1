"""The fifth pass over chapters 09 and 12: slips the checkers passed or blamed on the wrong
line, by class (``tests/mutant_kinds.py``):

* ``bounds``: a read past the end of a tensor that only a full pool provokes (the pool's last
  slots in use, a head size below the block);
* ``memo``: state kept between calls (an answer kept on its numbers, a ratio kept in a global);
* ``aside``: an effect on what the statement leaves alone (the device pool a swap-out reads,
  host pages that are reused uncleared);
* ``alike``: an order the cases could not tell from the right one (every cap the same);
* ``blame``: caught, where the message once named another cause (an overflow for any NaN,
  the K/V loads for a page-table row, page order for a page count, ``running[0][0]``).

``tests/test_mutations.py`` runs them with the rest: each wrong answer is rejected with a
message that names its slip or says nothing about the cause; each rewrite is accepted.
"""
from __future__ import annotations

from mutant_kinds import Mutant, Rewrite, WrongAnswer

from kvlab.course.exercises.ch12_choose import next_token_ratio_solution, victim_order_solution
from kvlab.course.exercises.ch12_swap import resume_plan_solution

_K_LOAD = ("            k = tl.load(k_pool_ptr + kv[None, :] + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None],\n"
           "                        other=0.0).to(tl.float32)  # [BLOCK_D, BLOCK_N]\n")
_V_MASK = "mask=mask_n[:, None] & mask_d[None, :],\n                        other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]"
_SLOTS = "slots = tl.load(page_table_ptr + row * stride_pt_row + offs_n, mask=mask_n, other=0).to(tl.int64)"
_UPDATE = "        acc = acc * alpha + w * o\n        total = total * alpha + w\n"
_W = "        w = tl.exp(lse - m_new)  # this split's weight, at most 1\n"
_LIVE = "live = tl.cdiv(seq_len, split_len)"
_COPY_K = "        host.k[page, :, : len(part)] = pool.k[:, part]   # every layer of those positions\n"
_RELEASE = "    manager.release_req(req)                             # its pages back, its lock off: once\n"

MUTANTS_CH09_12 = [
    # --- reads past the end that only a full pool provokes ---
    Mutant("split_attention", "mask=mask_n[None, :] & mask_d[:, None],", "mask=mask_n[None, :],",
           ("[the pool's last slots in use, head_dim 12 (BLOCK_D 16)]", "a read past the end of `k_pool_ptr`",
            "line"), "K loaded without the head-dimension mask (right while spare pages follow)", "bounds"),
    Mutant("split_attention", _V_MASK, _V_MASK.replace(" & mask_d[None, :]", ""),
           ("[the pool's last slots in use, head_dim 12 (BLOCK_D 16)]", "a read past the end of `v_pool_ptr`"),
           "V loaded without the head-dimension mask", "bounds"),
    Mutant("merge_splits", ", mask=mask_d, other=0.0)\n", ")\n",
           ("[head_dim 12 (BLOCK_D 16): the last request fills every split]", "a read past the end of `o_ptr`"),
           "a split's o loaded without the head-dimension mask (its extra lanes are never stored)", "bounds"),
    Mutant("paged_attention_kernel", "k = tl.load(k_pool_ptr + kv_offs, mask=kv_mask, other=0.0)",
           "k = tl.load(k_pool_ptr + kv_offs, mask=mask_n[:, None], other=0.0)",
           ("a read past the end of `k_pool_ptr`", "a read outside the tensors (above) brought in a guard value"),
           "K loaded without the head-dimension mask (chapter 08)", "bounds"),
    # --- the message names the slip made ---
    Mutant("split_attention", _SLOTS, _SLOTS.replace("row * stride_pt_row", "b * stride_pt_row"),
           ("looks like the block reads page-table row b", "and so: the safety net caught"),
           "reads page-table row b, the request's number, not its row", "blame"),
    Mutant("split_attention", "mask_n = offs_n < end", "mask_n = offs_n <= end",
           ("looks like the block's mask takes the split's end too",),
           "the block's mask ends one position late (offs_n <= end)", "blame"),
    Mutant("split_attention", _K_LOAD,
           "            k = tl.load(k_pool_ptr + kv[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :],\n"
           "                        other=0.0).to(tl.float32)\n",
           ("[one request, one token, four K/V heads]", "looks like K is loaded in V's shape"),
           "K loaded in V's shape [BLOCK_N, BLOCK_D] (tl.dot still runs when BLOCK_N == BLOCK_D)", "blame"),
    Mutant("merge_splits", _UPDATE, "        acc = (acc + w * o) * alpha\n        total = (total + w) * alpha\n",
           ("looks like acc and total are rescaled after this split is added",),
           "rescales after adding: the first split's weight is multiplied by 0", "blame"),
    Mutant("merge_splits", "w = tl.exp(lse - m_new)", "w = tl.exp(lse - m)",
           ("it gives what each of these slips gives", "exp(lse - m) = exp(inf) = inf"),
           "weighs a split from the old max (inf at the first split): no overflow of a large lse", "blame"),
    Mutant("merge_splits", _LIVE, "live = seq_len // (split_len * num_splits)",
           ("the merge walks no split", "0 / 0 = NaN"), "walks no split (0 / 0, not an overflow)", "blame"),
    Mutant("merge_splits", "for s in range(0, live):", "for s in range(0, num_splits):",
           ("looks like the merge also reads splits that hold nothing",),
           "walks every split, also those holding nothing", "blame"),
    Mutant("merge_splits", _LIVE, "live = seq_len // split_len + 1",
           ("[lengths ending exactly on a split: the next split holds nothing]",
            "looks like the merge also reads splits that hold nothing"),
           "a wrong guard for empty splits: one split too many when seq_len ends on a split", "blame"),
    Mutant("merge_splits", _W, "        w = tl.where(lse > 0, tl.exp(lse - m_new), 0.0)  # skip 'empty' splits\n",
           ("no exp of these lse can overflow", "a guard that skips every split"),
           "a guard that takes a negative lse for an empty split: nothing weighted, 0 / 0", "blame"),
    Mutant("swap_out", "pages = host.take(-(-n // P))", "pages = host.take(n // P)",
           ("3 host page(s) taken for 14 positions", "n // P = 3 leaves out the last, partly filled page"),
           "takes n // P host pages (the last, partial page left out)", "blame"),
    Mutant("victim_order", "        ranked = sorted(running, key=lambda r: (r.generated, -r.prompt_len), reverse=True)\n",
           "        running.sort(key=lambda r: (r.generated, -r.prompt_len), reverse=True)\n        ranked = running\n",
           ("`running` holds the same items in another order", "`running[1]` was RequestView(key=2"),
           "sorts running in place: told as a reorder, not as running[1][0]", "blame"),
    Mutant("resume_plan", "host_pages[pos // P] * P + pos % P", "host_pages[pos // P] + pos % P",
           ("its host slot should be", "is host slots [", "the wrong slot"),
           "a host page taken for its first host slot (page, not page * P)", "blame"),
    # --- effects on what the statement leaves alone ---
    Mutant("swap_out", _RELEASE, "    pool.k[:, slots] = 0.0  # (the copy is done: clear the device side)\n"
           "    pool.v[:, slots] = 0.0\n" + _RELEASE,
           ("changed during your swap-out", "another running request's row maps it", "only reads the device pool"),
           "zeroes the device K/V it copied (a prefix another running request shares)", "aside"),
    Mutant("swap_out", "    return pages\n", "    pool.k[:, slots] = 0.0\n    pool.v[:, slots] = 0.0\n    return pages\n",
           ("changed during your swap-out",), "zeroes the device K/V after release_req (pages now another's)",
           "aside"),
    # (.to(...): on a GPU a plain += of the device pool into the CPU host pages is refused
    # first, a different slip; the checker names that one through torch_error_hint)
    Mutant("swap_out", _COPY_K, _COPY_K.replace("] = pool.k[:, part]", "] += pool.k[:, part].to(host.k.device)"),
           ("host.k[", "host pages are reused without being cleared"),
           "adds to the host pages (right while they are fresh zeros)", "aside"),
    # --- orders the cases could not tell apart ---
    Mutant("victim_order", "        ranked = sorted(running, key=lambda r: (r.generated, -r.prompt_len), reverse=True)\n",
           "        ranked = sorted(running, key=lambda r: (r.generated / r.max_new, -r.prompt_len), reverse=True)\n",
           ("policy 'retract'", "your order ranks by progress"),
           "retracts the least progress (generated / max_new) first (right while every cap is equal)", "alike"),
    Mutant("victim_order", "        ranked = sorted(running, key=lambda r: (r.generated, -r.prompt_len), reverse=True)\n",
           "        ranked = sorted(running, key=lambda r: (r.generated - r.max_new, -r.prompt_len), reverse=True)\n",
           ("policy 'retract'", "the most tokens still to generate"),
           "retracts the most tokens left to generate first (right while every cap is equal)", "alike"),
]


def victim_order_kept_by_numbers(policy, running, _kept={}):  # noqa: B006 - the slip is the kept dict
    """keeps each order, keyed on the requests' numbers (not their keys)"""
    numbers = (policy, tuple(tuple(view)[1:] for view in running))
    if numbers not in _kept:
        _kept[numbers] = victim_order_solution(policy, running)
    return _kept[numbers]


def resume_plan_kept_by_numbers(how, saved, hit, input_len, host_pages, row, page_size, _kept={}):  # noqa: B006
    """keeps each plan, keyed on its numbers (not on the pages and the row)"""
    numbers = (how, saved, hit, input_len, page_size)
    if numbers not in _kept:
        _kept[numbers] = resume_plan_solution(how, saved, hit, input_len, host_pages, row, page_size)
    return _kept[numbers]


def next_token_ratio_kept_per_policy(policy, ratio, retracted, remaining, _kept={}):  # noqa: B006
    """keeps the ratio per policy between calls (reads `ratio` only at the start of a run)"""
    if ratio != policy.init_ratio:
        ratio = _kept.get(id(policy), ratio)
    _kept[id(policy)] = new = next_token_ratio_solution(policy, ratio, retracted, remaining)
    return new


WRONG_ANSWERS_CH09_12 = [
    WrongAnswer("victim_order", victim_order_kept_by_numbers,
                ("called again with the same numbers under other keys", "it returned the keys of the call before"),
                "memo"),
    WrongAnswer("resume_plan", resume_plan_kept_by_numbers,
                ("the second call returned the first call's copies", "host page h is host slots [h*P, (h+1)*P)"),
                "memo"),
    WrongAnswer("next_token_ratio", next_token_ratio_kept_per_policy,
                ("[two runs in turns, one policy: each call gets its own run's ratio] run 2",
                 "keeps the ratio between calls"), "memo"),
]

REWRITES_CH09_12 = [
    Rewrite("split_attention", "mask=mask_n[None, :] & mask_d[:, None],",
            "mask=(offs_n[None, :] < end) & (offs_d[:, None] < head_dim),",
            "K's mask written out from offs_n and offs_d"),
    Rewrite("merge_splits", _LIVE, "live = (seq_len + split_len - 1) // split_len",
            "the live splits by the ceiling written out"),
    Rewrite("swap_out", _COPY_K, "        host.k[page, :, : len(part)].copy_(pool.k[:, part])\n",
            "the host copy with copy_ (into the page, never added)"),
    Rewrite("resume_plan",
            "        for pos in range(hit, saved):            # what it had computed and the cache lost\n"
            "            host_slot = host_pages[pos // P] * P + pos % P\n",
            "        host_slots = [h * P + i for h in host_pages for i in range(P)]  # host page h: slots [h*P, (h+1)*P)\n"
            "        for pos in range(hit, saved):\n"
            "            host_slot = host_slots[pos]\n",
            "the host slots listed page by page"),
    Rewrite("victim_order",
            "        ranked = sorted(running, key=lambda r: (r.generated, -r.prompt_len), reverse=True)\n"
            "        order = ranked[::-1]",
            "        ranked = sorted(enumerate(running), key=lambda p: (p[1].generated, -p[1].prompt_len, -p[0]))\n"
            "        order = [r for _, r in ranked]",
            "the tie rule made explicit: the later in running first"),
]
