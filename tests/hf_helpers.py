"""What the kvlab.serving.hf tests share: transformers' own greedy generation as the reference, the
comparison of a run with it, prompts behind a shared system prompt, a torch decode step."""
from __future__ import annotations

import random

import torch

from kvlab.serving.hf import paged_attention_reference

ATOL = 1e-4
VOCAB = 128


def reference(model, prompt, max_new_tokens):
    """transformers' own greedy generation of one prompt: (new tokens, logits [n, vocab])."""
    out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_new_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float().cpu()


def assert_identical(model, gen, prompts, got, max_new_tokens):
    """Same tokens as generate() for each prompt alone; logits within ATOL. ``max_new_tokens``:
    one for all, or one per prompt."""
    for i, prompt in enumerate(prompts):
        n = max_new_tokens[i] if isinstance(max_new_tokens, (list, tuple)) else max_new_tokens
        want_tokens, want_logits = reference(model, prompt, n)
        assert got[i] == want_tokens, (
            f"prompt {i} (length {len(prompt)}): kvlab {got[i]} != generate {want_tokens}")
        err = float((gen.logits[i] - want_logits).abs().max())
        assert err <= ATOL, f"prompt {i}: logits differ by {err:.2e} > {ATOL}"


def shared_prefix_prompts(seed: int, system_len: int = 20, suffixes=(3, 9, 1, 6)):
    """Prompts that share a system prompt (distinct first suffix tokens), plus a one-token
    prompt."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(system_len)]
    firsts = rng.sample(range(VOCAB), len(suffixes))
    prompts = [system + [f] + [rng.randrange(VOCAB) for _ in range(n - 1)]
               for f, n in zip(firsts, suffixes)]
    return prompts + [[rng.randrange(VOCAB)]]


def manager_state(gen):
    m = gen.manager
    return (sorted(m.free_slots.tolist()), gen.page_table.clone(),
            m.prefix_cache.size_info, len(m.running))


def torch_decode_step(q, k, v, k_pool, v_pool, page_table, rows, positions, scale):
    """paged_attention_step in plain torch (no Triton: fast in the interpreter)."""
    slots = page_table[rows, positions].long()
    k_pool[slots] = k
    v_pool[slots] = v
    return paged_attention_reference(q, k_pool, v_pool, page_table, rows, positions + 1, scale)


def pages_accounted_for(gen) -> None:
    """Between calls: no request holds a row, and every page is free or in the prefix cache."""
    m = gen.manager
    assert m.running == [], f"rows still held: {[r.table_idx for r in m.running]}"
    m.check_integrity()
    cached = m.prefix_cache.size_info.total_size // gen.page_size
    assert m.num_free_pages + cached == gen.num_pages, (m.num_free_pages, cached, gen.num_pages)
