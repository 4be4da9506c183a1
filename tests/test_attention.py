"""Chapter 08: the KV pool, paged decode attention (Triton vs plain torch), the tiny model."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvlab import InvalidArgument
from kvlab.attention.paged_attention import causal_attention, paged_decode_attention
from kvlab.serving.tiny_engine import PagedEngine, TinyConfig, TinyTransformer, generate_contiguous, generate_paged
from kvlab.attention.kv_pool import KVPool
from kvlab.course.reference import paged_decode_attention_reference


def _layout(seed: int, page_size: int, seq_lens: list[int], heads: int = 2, head_dim: int = 16,
            spare_pages: int = 3, device=None):
    """A pool with random K/V and a page table whose rows map each request's tokens to
    randomly chosen, disjoint pages (like an allocator after some churn)."""
    rng = random.Random(seed)
    pages_per_req = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_req) + spare_pages
    order = list(range(num_pages))
    rng.shuffle(order)
    cols = max(1, max(pages_per_req)) * page_size
    rows = len(seq_lens) + 2
    table = torch.full((rows, cols), -1, dtype=torch.int32)
    row_of = list(range(rows))
    rng.shuffle(row_of)
    row_of = row_of[:len(seq_lens)]
    taken = 0
    for b, n in enumerate(seq_lens):
        pages = order[taken:taken + pages_per_req[b]]
        taken += pages_per_req[b]
        slots = [p * page_size + o for p in pages for o in range(page_size)][:n]
        table[row_of[b], :n] = torch.tensor(slots, dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(num_pages * page_size, 1, heads, head_dim, device=device)
    pool.k[0] = torch.randn(pool.k[0].shape, generator=g)
    pool.v[0] = torch.randn(pool.v[0].shape, generator=g)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=g)
    dev = pool.device
    return (q.to(dev), pool, table.to(dev), torch.tensor(row_of), torch.tensor(seq_lens))


def _both(q, pool, table, rows, lens, block_n=16):
    got = paged_decode_attention(q, pool.k[0], pool.v[0], table, rows, lens, block_n=block_n)
    want = paged_decode_attention_reference(q, pool.k[0], pool.v[0], table, rows, lens)
    return got.cpu(), want.cpu()


@pytest.mark.parametrize("page_size,seq_lens", [
    (1, [1]),                     # page size 1, one token
    (1, [5, 17, 3]),              # page size 1, several requests
    (4, [8, 4, 12]),              # page-aligned lengths
    (4, [7, 1, 13]),              # unaligned lengths
    (16, [33]),                   # one request, three blocks of BLOCK_N
    (16, [16, 16, 1, 40, 2, 31, 5, 64]),  # many requests
])
def test_paged_attention_matches_reference_edge_cases(page_size, seq_lens):
    got, want = _both(*_layout(0, page_size, seq_lens))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@given(seed=st.integers(0, 10_000), page_size=st.sampled_from([1, 2, 4, 16]),
       seq_lens=st.lists(st.integers(1, 45), min_size=1, max_size=5),
       heads=st.integers(1, 3), head_dim=st.sampled_from([8, 12, 16]),
       block_n=st.sampled_from([4, 16]))
def test_paged_attention_matches_reference_random(seed, page_size, seq_lens, heads, head_dim, block_n):
    got, want = _both(*_layout(seed, page_size, seq_lens, heads, head_dim), block_n=block_n)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_oracle_refuses_what_it_cannot_gather_with_its_own_checks():
    q, pool, table, rows, lens = _layout(1, 4, [6, 9])
    args = (q, pool.k[0], pool.v[0], table)
    with pytest.raises(InvalidArgument, match="a mapped slot"):  # -1 would wrap to the last slot
        paged_decode_attention_reference(*args, rows, torch.tensor([7, 9]))
    with pytest.raises(InvalidArgument, match="seq_lens\\[1\\]"):
        paged_decode_attention_reference(*args, rows, torch.tensor([6, 0]))
    with pytest.raises(InvalidArgument, match="table_idx\\[0\\]"):
        paged_decode_attention_reference(*args, torch.tensor([table.shape[0], int(rows[1])]), lens)
    with pytest.raises(InvalidArgument, match="k_pool"):
        paged_decode_attention_reference(q, pool.k[0][:, :1], pool.v[0], table, rows, lens)


def test_paged_attention_equals_contiguous_attention():
    # the same keys laid out contiguously give the same answer: the page table is only an address map
    q, pool, table, rows, lens = _layout(3, 4, [11])
    slots = table[int(rows[0]), :11].long()
    k, v = pool.k[0][slots], pool.v[0][slots]
    plain = causal_attention(q, k, v, q_offset=10)  # the one query is the last position
    got = paged_decode_attention(q, pool.k[0], pool.v[0], table, rows, lens)
    torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)


def test_paged_attention_rejects_bad_input_before_launch():
    q, pool, table, rows, lens = _layout(1, 4, [6, 9])
    args = (q, pool.k[0], pool.v[0], table)
    with pytest.raises(InvalidArgument, match="seq_lens\\[1\\]"):
        paged_decode_attention(*args, rows, torch.tensor([6, 0]))
    with pytest.raises(InvalidArgument, match="page_table columns"):
        paged_decode_attention(*args, rows, torch.tensor([6, table.shape[1] + 1]))
    with pytest.raises(InvalidArgument, match="table_idx\\[0\\]"):
        paged_decode_attention(*args, torch.tensor([table.shape[0], int(rows[1])]), lens)
    with pytest.raises(InvalidArgument, match="a mapped slot"):  # position 6 of row 0 is unmapped (-1)
        paged_decode_attention(*args, rows, torch.tensor([7, 9]))
    stale = table.clone()
    stale[int(rows[0]), 2] = pool.num_slots  # one past the pool
    with pytest.raises(InvalidArgument, match="a mapped slot"):
        paged_decode_attention(q, pool.k[0], pool.v[0], stale, rows, lens)
    with pytest.raises(InvalidArgument, match="k_pool"):
        paged_decode_attention(q, pool.k[0][:, :1], pool.v[0], table, rows, lens)
    with pytest.raises(InvalidArgument, match="block_n"):
        paged_decode_attention(*args, rows, lens, block_n=12)


def test_store_kv_writes_rows_and_rejects_bad_slots_without_change():
    pool = KVPool(10, 2, 2, 4)
    k = torch.arange(3 * 2 * 4, dtype=torch.float32).view(3, 2, 4)
    pool.store_kv(k, -k, torch.tensor([7, 0, 3]), layer=1)
    assert torch.equal(pool.k[1][[7, 0, 3]].cpu(), k) and torch.equal(pool.v[1][[7, 0, 3]].cpu(), -k)
    assert pool.k[0].abs().sum() == 0  # the other layer is untouched
    before = pool.k.clone(), pool.v.clone()
    with pytest.raises(InvalidArgument, match="out_loc"):
        pool.store_kv(k, k, torch.tensor([1, 2, 10]), layer=0)
    with pytest.raises(InvalidArgument, match="out_loc"):
        pool.store_kv(k, k, torch.tensor([1, 2]), layer=0)
    with pytest.raises(InvalidArgument, match="layer"):
        pool.store_kv(k, k, torch.tensor([1, 2, 3]), layer=2)
    with pytest.raises(InvalidArgument, match="k"):
        pool.store_kv(k[:, :1], k, torch.tensor([1, 2, 3]), layer=0)
    assert torch.equal(pool.k, before[0]) and torch.equal(pool.v, before[1])


def test_tiny_model_is_seeded_and_incremental_decode_matches_full_forward():
    cfg = TinyConfig(vocab_size=64, seed=7)
    m1, m2 = TinyTransformer(cfg), TinyTransformer(cfg)
    assert torch.equal(m1.lm_head, m2.lm_head)
    assert not torch.equal(m1.lm_head, TinyTransformer(TinyConfig(vocab_size=64, seed=8)).lm_head)
    prompt = [5, 9, 1, 33, 2]
    gen = generate_contiguous(m1, [prompt], max_new_tokens=6)
    full = prompt + gen.tokens[0]

    def attend_full(layer, q, k, v):
        return causal_attention(q, k, v, 0)

    ids = torch.tensor(full, device=m1.device)
    logits = m1.forward(ids, torch.arange(len(full), device=m1.device), attend_full).cpu()
    # the logits behind generated token i are the full forward's logits at position len(prompt)-1+i
    torch.testing.assert_close(gen.logits[0], logits[len(prompt) - 1:len(full) - 1], atol=1e-4, rtol=1e-4)
    assert gen.tokens[0] == logits[len(prompt) - 1:len(full) - 1].argmax(-1).tolist()
    assert gen.prefill_tokens == len(prompt)


# --- the tiny model through the page table vs a contiguous KV cache ---------------------

SMALL = TinyConfig(vocab_size=64, num_layers=2, num_heads=2, head_dim=16, seed=11)


def _prompts(seed, n, shared, extra=(2, 7)):
    rng = random.Random(seed)
    system = [rng.randrange(SMALL.vocab_size) for _ in range(shared)]
    return [system + [rng.randrange(SMALL.vocab_size) for _ in range(rng.randint(*extra))]
            for _ in range(n)]


def _assert_same(paged, contiguous, atol=1e-4):
    assert paged.tokens == contiguous.tokens
    for a, b in zip(paged.logits, contiguous.logits):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_generation_equals_contiguous_with_the_triton_kernel(page_size):
    model = TinyTransformer(SMALL)
    prompts = _prompts(0, 3, shared=9)
    _assert_same(generate_paged(model, prompts, 4, page_size=page_size),
                 generate_contiguous(model, prompts, 4))


def test_prefix_hits_compute_fewer_tokens_and_change_nothing():
    model = TinyTransformer(SMALL)
    first, second = _prompts(1, 3, shared=13), _prompts(2, 3, shared=13)
    second = [first[0][:13] + p[13:] for p in second]            # same 13-token system prompt
    engine = PagedEngine(model, page_size=4, num_pages=40, max_running=3, max_seq_len=40,
                         decode_attention="reference")
    g1 = engine.generate(first, 5)
    g2 = engine.generate(second, 5)
    assert g1.hit_tokens == [0, 0, 0]
    assert g2.hit_tokens == [12, 12, 12]                           # 3 whole pages of 4
    assert g2.prefill_tokens == sum(len(p) for p in second) - 36
    _assert_same(g1, generate_contiguous(model, first, 5))
    _assert_same(g2, generate_contiguous(model, second, 5))
    # asking the first batch again: prompt and answer are cached, only the last token is computed
    g3 = engine.generate(first, 5)
    assert g3.tokens == g1.tokens and g3.prefill_tokens < g1.prefill_tokens
    engine.manager.check_integrity()


def test_twin_prompts_in_one_batch_read_the_remapped_duplicate_pages():
    model = TinyTransformer(SMALL)
    twin = _prompts(3, 1, shared=10)[0]
    prompts = [twin, twin, _prompts(4, 1, shared=5)[0]]
    engine = PagedEngine(model, page_size=2, num_pages=40, max_running=3, max_seq_len=32,
                         decode_attention="reference")
    _assert_same(engine.generate(prompts, 6), generate_contiguous(model, prompts, 6))


def test_engine_refuses_a_batch_that_cannot_fit_and_changes_nothing():
    from kvlab import OutOfPages

    model = TinyTransformer(SMALL)
    engine = PagedEngine(model, page_size=4, num_pages=5, max_running=2, max_seq_len=40)
    free_before = engine.manager.free_slots.clone()
    with pytest.raises(OutOfPages):
        engine.generate(_prompts(5, 2, shared=8), 6)   # 2 x (>=10 + 5) tokens > 20 slots
    assert torch.equal(engine.manager.free_slots, free_before)
    assert (engine.page_table == -1).all()
    engine.manager.check_integrity()
    with pytest.raises(InvalidArgument, match="prompts\\[0\\]"):
        engine.generate([[SMALL.vocab_size]], 2)
    with pytest.raises(InvalidArgument, match="1 to max_running"):
        generate_paged(model, [], 2)  # an empty batch: the rule, not a bare max() error
