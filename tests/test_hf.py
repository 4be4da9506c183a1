"""kvlab.serving.hf.PagedGenerator serves real transformers models token for token.

Small random Llama, Qwen2 and Qwen3 models (2 layers, 4 query heads on 2 K/V heads, RoPE; Qwen3
normalises each head's q and k inside its attention) are saved
with ``save_pretrained`` and loaded with ``from_pretrained``; every run is compared with
``model.generate(torch.tensor([prompt]), do_sample=False)`` for each prompt alone: the same
new tokens, and logits within 1e-4 (float32). No network.
"""
from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", minversion="4.56",
    reason="kvlab.serving.hf needs transformers >= 4.56: pip install 'transformers>=4.56'")

import kvlab  # noqa: E402
from kvlab import InvalidArgument, OutOfPages  # noqa: E402
from hf_helpers import (VOCAB, assert_identical, manager_state, reference,  # noqa: E402
                        shared_prefix_prompts, torch_decode_step)
from kvlab.serving.hf import PagedGenerator, tiny_model  # noqa: E402
from kvlab.serving.hf.plugin import ATTENTION_NAME  # noqa: E402

ARCHS = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each architecture saved to disk and loaded back (the real loading path), on the
    runtime's device (Qwen3 with heads of 32 on a hidden size of 64, as its head_dim need not
    divide it)."""
    return {arch: tiny_model(arch, str(tmp_path_factory.mktemp(arch)), seed=0, device=kvlab.DEVICE,
                             **(dict(head_dim=32) if arch == "qwen3" else {})) for arch in ARCHS}


#: how the loop serves: prompts in chunks of at most 7 tokens per step and decode steps padded
#: to captured sizes (CUDA graphs on a GPU, the same padded step eagerly elsewhere); or whole
#: prompts and unpadded decode steps
SERVING = {"chunks, padded decode": dict(prefill_budget=7),
           "whole prompts, plain decode": dict(chunked_prefill=False, decode_graphs="off")}


@pytest.mark.parametrize("attention", ["fast", "teaching"])
@pytest.mark.parametrize("serving", sorted(SERVING))
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_same_tokens_as_generate_with_shared_prefixes(models, arch, page_size, serving, attention):
    model = models[arch]
    prompts = shared_prefix_prompts(seed=page_size)
    gen = PagedGenerator(model, page_size=page_size, num_pages=256 // page_size + 8, max_running=8,
                         attention=attention, **SERVING[serving])
    got = gen.generate(prompts, max_new_tokens=4, output_logits=True)
    assert (gen.stats["chunks"] > 0) == (serving == "chunks, padded decode")
    assert (gen.stats["graph_steps"] > 0) == (serving == "chunks, padded decode")
    assert_identical(model, gen, prompts, got, 4)
    # the system prompt's whole pages are computed once: the first prompt computes them,
    # the three others (deferred one step) read them from the cache
    shared = 20 // page_size * page_size
    assert [r.cached for r in gen.requests] == [0, shared, shared, shared, 0]
    assert gen.stats["prefill_cached"] == 3 * shared
    assert gen.stats["prefill_computed"] == sum(map(len, prompts)) - 3 * shared
    assert gen.stats["generated"] == 4 * len(prompts)
    assert model.config._attn_implementation != ATTENTION_NAME   # the model's own again

    # the same prompts again: every prompt's whole pages (up to its last token) are cached,
    # K/V that the first call's decode steps and prefill left in the pool
    again = prompts[:3]
    got2 = gen.generate(again, max_new_tokens=4, output_logits=True)
    assert got2 == got[:3]
    assert_identical(model, gen, again, got2, 4)
    assert [r.cached for r in gen.requests] == [(len(p) - 1) // page_size * page_size for p in again]
    gen.manager.check_integrity()
    assert gen.manager.running == []


@pytest.mark.parametrize("arch", ARCHS)
def test_continuous_batching_with_a_pool_small_enough_to_evict(models, arch):
    """Few pages: requests wait, and are admitted while others decode (a mixed step: prompt 1
    waits one step to hit prompt 0's pages, then prefills while prompt 0 decodes; prompt 2
    waits for pages), and the second round evicts what the first left in the cache."""
    model = models[arch]
    P = 4
    rng = random.Random(7)
    system = [rng.randrange(VOCAB) for _ in range(12)]
    first = [system + [1], system + [2, 3, 4, 5], [rng.randrange(VOCAB) for _ in range(26)],
             [rng.randrange(VOCAB) for _ in range(9)]]
    second = [[rng.randrange(VOCAB) for _ in range(n)] for n in (17, 11, 3)]
    gen = PagedGenerator(model, page_size=P, num_pages=12, max_running=3)
    steps = []
    got = gen.generate(first, max_new_tokens=5, output_logits=True, on_step=steps.append)
    assert_identical(model, gen, first, got, 5)
    assert gen.stats["most_running"] <= 3 and gen.stats["deferred"] >= 1
    assert gen.requests[1].cached == 12
    assert any(s.prefill and s.decode for s in steps), "no step mixed a prefill with decoding"
    cached_before = gen.manager.prefix_cache.size_info.total_size
    assert cached_before > 0

    got = gen.generate(second, max_new_tokens=5, output_logits=True)
    assert_identical(model, gen, second, got, 5)
    # the pool (12 pages of 4) cannot hold both rounds: the first round's cache was evicted
    kept = [gen.manager.prefix_cache.match_prefix(p[:-1]).handle.cached_len for p in first]
    full = [(len(p) - 1) // P * P for p in first]
    assert kept != full, "nothing of the first round was evicted"
    gen.manager.check_integrity()


@pytest.mark.parametrize("arch", ARCHS)
def test_eos_ends_a_request_as_generate_does(models, arch, monkeypatch):
    model = models[arch]
    prompts = shared_prefix_prompts(seed=3, system_len=6, suffixes=(4, 2, 7))
    plain, _ = reference(model, prompts[0], 6)
    eos = plain[2]                      # prompt 0 will stop at its 3rd token
    monkeypatch.setattr(model.generation_config, "eos_token_id", [eos, VOCAB - 1])
    gen = PagedGenerator(model, page_size=4, num_pages=64)
    got = gen.generate(prompts, max_new_tokens=6, output_logits=True)
    assert_identical(model, gen, prompts, got, 6)
    assert got[0] == plain[:plain.index(eos) + 1]
    assert gen.requests[0].finished_by == "eos"
    assert all(r.finished_by == ("eos" if t[-1] in (eos, VOCAB - 1) else "length")
               for r, t in zip(gen.requests, got))
    assert gen.manager.running == []


def test_a_pool_too_small_for_a_request_says_out_of_pages_not_max_seq_len(models):
    """Without max_seq_len, rows are as long as the pool: a request that needs more positions
    than the pool holds is refused for the pool (OutOfPages), not for a row length the caller
    never set."""
    gen = PagedGenerator(models["llama"], page_size=4, num_pages=6)
    with pytest.raises(OutOfPages, match=r"prompts\[0\]") as err:
        gen.generate([list(range(20))], max_new_tokens=8)        # 27 positions > 24 slots
    assert "max_seq_len" not in str(err.value)
    short = PagedGenerator(models["llama"], page_size=4, num_pages=64, max_seq_len=16)
    with pytest.raises(InvalidArgument, match="max_seq_len") as err:
        short.generate([list(range(20))], max_new_tokens=8)      # the caller's own limit
    assert err.value.argument == "prompts[0]"


def test_a_prompt_the_pool_can_never_hold_raises_out_of_pages_and_changes_nothing(models):
    model = models["llama"]
    gen = PagedGenerator(model, page_size=4, num_pages=6, max_seq_len=64)
    gen.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9]], max_new_tokens=3)    # leaves cached pages
    before = manager_state(gen)
    with pytest.raises(OutOfPages, match="prompts\\[1\\]"):
        gen.generate([[1, 2, 3], list(range(20))], max_new_tokens=8)   # 27 positions > 24 slots
    after = manager_state(gen)
    assert before[0] == after[0] and torch.equal(before[1], after[1])
    assert before[2:] == after[2:]
    assert gen.generate([[1, 2, 3]], max_new_tokens=2) == [reference(model, [1, 2, 3], 2)[0]]


@pytest.mark.parametrize("prompts, max_new, argument", [
    ([[]], 2, "prompts[0]"),
    ([[1, 2], [3, VOCAB]], 2, "prompts[1]"),
    ([[1, -1]], 2, "prompts[0]"),
    ([[1, 2]], 0, "max_new_tokens"),
    ([[1, 2.0]], 2, "prompts[0][1]"),
    ("hello", 2, "prompts"),
    ([], 2, "prompts"),
    ([list(range(60))], 8, "prompts[0]"),     # 67 positions > max_seq_len 64
])
def test_bad_input_is_refused_before_anything_changes(models, prompts, max_new, argument):
    gen = PagedGenerator(models["llama"], page_size=4, num_pages=32, max_seq_len=64)
    gen.generate([[5, 6, 7, 8, 9]], max_new_tokens=2)
    before = manager_state(gen)
    with pytest.raises(InvalidArgument) as err:
        gen.generate(prompts, max_new_tokens=max_new)
    assert err.value.argument == argument
    after = manager_state(gen)
    assert before[0] == after[0] and torch.equal(before[1], after[1]) and before[2:] == after[2:]


def test_other_architectures_are_refused_naming_what_is_supported(models):
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=32))
    with pytest.raises(InvalidArgument, match="Llama.*Qwen2.*Qwen3.*got GPT2LMHeadModel"):
        PagedGenerator(gpt2)
    with pytest.raises(InvalidArgument, match="got LlamaModel"):
        PagedGenerator(models["llama"].model)          # no language-model head
    windowed = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=8))
    with pytest.raises(InvalidArgument, match="use_sliding_window"):
        PagedGenerator(windowed)


def test_a_generation_config_beyond_greedy_is_refused(models, monkeypatch):
    model = models["qwen2"]
    monkeypatch.setattr(model.generation_config, "repetition_penalty", 1.3)
    gen = PagedGenerator(model, page_size=4, num_pages=16)
    with pytest.raises(InvalidArgument, match="repetition_penalty"):
        gen.generate([[1, 2, 3]], max_new_tokens=2)


def test_a_failing_step_releases_its_requests_and_restores_the_model(models):
    model = models["llama"]
    calls = []

    def broken_decode_step(*args):
        calls.append(1)
        raise RuntimeError("boom")

    gen = PagedGenerator(model, page_size=4, num_pages=32, decode_step=broken_decode_step)
    with pytest.raises(RuntimeError, match="boom"):
        gen.generate([[1, 2, 3, 4, 5], [6]], max_new_tokens=3)
    assert calls
    assert gen.manager.running == []                  # their pages went back
    gen.manager.check_integrity()
    assert model.config._attn_implementation != ATTENTION_NAME
    with pytest.raises(RuntimeError, match="PagedGenerator"):
        with kvlab.serving.hf.plugin.paged_attention_active(model):   # outside the loop: no step info
            model(torch.tensor([[1, 2]], device=model.device))


def test_a_decode_step_of_your_own_serves_the_model(models):
    """The chapter's exercise plugs in here: any function with paged_attention_step's
    signature (this one in plain torch) serves the model with the same tokens."""
    model = models["qwen2"]

    prompts = shared_prefix_prompts(seed=5, system_len=9, suffixes=(2, 5))
    gen = PagedGenerator(model, page_size=4, num_pages=64, decode_step=torch_decode_step)
    got = gen.generate(prompts, max_new_tokens=5, output_logits=True)
    assert_identical(model, gen, prompts, got, 5)


@pytest.mark.parametrize("attention", ["fast", "teaching"])
def test_the_chosen_decode_kernels_are_the_ones_that_run(models, attention, kernel_run):
    """attention="fast" decodes through chapter 09's kernels, "teaching" through chapter 08's,
    in padded graph steps and packed steps alike; the other one is never launched."""
    from kvlab.attention import decode_kernels as teaching_kernels
    from kvlab.attention import split_kernels as fast_attention

    launched = {"fast": 0, "teaching": 0}
    for name, kernel in (("fast", fast_attention.split_decode_kernel),
                         ("teaching", teaching_kernels.paged_decode_attention_kernel)):
        def counted(*args, _run=kernel.run, _name=name, **kwargs):
            launched[_name] += 1
            return _run(*args, **kwargs)
        kernel_run(kernel, counted)
    prompts = shared_prefix_prompts(seed=7, system_len=9, suffixes=(2, 5))
    gen = PagedGenerator(models["llama"], page_size=4, num_pages=64, max_running=4, prefill_budget=8,
                         attention=attention)
    got = gen.generate(prompts, max_new_tokens=4, output_logits=True)
    assert gen.stats["graph_steps"] > 0 and gen.stats["chunks"] > 0   # both kinds of step ran
    other = "teaching" if attention == "fast" else "fast"
    assert launched[attention] > 0 and launched[other] == 0, launched
    assert_identical(models["llama"], gen, prompts, got, 4)


def _inductor_runs() -> str | None:
    """Why torch.compile's inductor cannot compile here (None: it can): on a CPU it needs a
    C++ compiler. On a GPU it generates Triton kernels, which every GPU run has: there it is
    never skipped (a failure to compile is the test's failure)."""
    if kvlab.base.runtime.DEVICE.type == "cuda":
        return None
    try:
        fn = torch.compile(lambda x: torch.sin(x) * 2 + 1, dynamic=False)
        torch.testing.assert_close(fn(torch.ones(3)), torch.sin(torch.ones(3)) * 2 + 1)
    except Exception as e:  # noqa: BLE001 - any failure means: no compiler here
        return f"torch.compile cannot run here: {type(e).__name__}: {str(e)[:200]}"
    return None


def test_a_compiled_decode_step_gives_the_same_tokens_and_recompiles_nothing_after_start_up(models):
    """compile_decode=True: torch.compile of the padded decode step, compiled at start-up (the
    batch size symbolic, the attention call left to run as it is); serving then builds no new
    graph, whatever the batch, and the tokens are generate()'s."""
    why = _inductor_runs()
    if why:
        pytest.skip(why)
    from kvlab.serving.hf.graphs import dynamo_graphs

    model = models["llama"]
    gen = PagedGenerator(model, page_size=4, num_pages=64, max_running=4, graph_sizes=[2, 4],
                         compile_decode=True)
    assert gen.graphs.compiled and gen.graphs.graphs_at_start == dynamo_graphs() > 0
    prompts = shared_prefix_prompts(seed=3, system_len=6, suffixes=(1, 4, 2))   # 4 prompts: 4, 3, 2 run
    got = gen.generate(prompts, max_new_tokens=5, output_logits=True)
    assert gen.stats["graph_steps"] > 0
    assert dynamo_graphs() == gen.graphs.graphs_at_start      # no recompile after start-up
    assert_identical(model, gen, prompts, got, 5)


def test_chunked_prefill_keeps_each_step_within_the_token_budget(models):
    """A long prompt is computed over several steps, at most `prefill_budget` prompt tokens a
    step, while the other requests keep decoding; a chunk gives no token until the last one."""
    model = models["llama"]
    rng = random.Random(9)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 30, 4)]
    gen = PagedGenerator(model, page_size=4, num_pages=64, max_running=4, prefill_budget=8)
    steps = []
    got = gen.generate(prompts, max_new_tokens=6, output_logits=True, on_step=steps.append)
    assert_identical(model, gen, prompts, got, 6)
    assert all(s.tokens - len(s.decode) <= 8 for s in steps)
    chunked = [s for s in steps if s.chunks]
    assert chunked and all(s.chunks == [1] for s in chunked)
    assert any(s.decode for s in chunked), "no request decoded while the long prompt was chunked"
    # the 30-token prompt: 5 tokens beside prompt 0's 3, then 8, 8, 8 and its last 1 (with prompt 2)
    assert [s.tokens - len(s.decode) for s in steps[:5]] == [8, 8, 8, 8, 5]
    assert gen.stats["chunks"] == 4 and [s.prefill for s in steps[:5]] == [[0, 1], [], [], [], [2]]


def test_padded_lanes_write_only_the_dummy_page(models):
    """Every slot of the pool starts as NaN. Real requests read only what they wrote (so the
    tokens are still generate's), every slot written belongs to a computed token, and padded
    lanes wrote only the dummy page's first slot."""
    model = models["qwen2"]
    P = 4
    gen = PagedGenerator(model, page_size=P, num_pages=64, max_running=8)   # 5 lanes pad to 8
    gen.pool.k.fill_(float("nan"))
    gen.pool.v.fill_(float("nan"))
    prompts = shared_prefix_prompts(seed=2)
    got = gen.generate(prompts, max_new_tokens=5, output_logits=True)
    assert_identical(model, gen, prompts, got, 5)
    assert gen.stats["graph_steps"] > 0 and gen.graphs.padded_size(5) == 8
    written = ~gen.pool.k[0].isnan().flatten(1).all(1)          # slots layer 0 wrote
    dummy = gen.num_pages * P                                   # the dummy page's first slot
    assert bool(written[dummy]) and not bool(written[dummy + 1:].any())
    assert int(written[:dummy].sum()) == gen.stats["prefill_computed"] + gen.stats["decode_tokens"]
    assert bool((gen.page_table[gen.dummy_row] // P == gen.num_pages).all())  # the dummy page only
    assert int(gen.page_table[gen.dummy_row, 0]) == dummy


def test_pad_decode_batch_pads_to_the_next_captured_size_with_the_dummy_row():
    from kvlab.serving.hf import graph_batch_sizes, pad_decode_batch

    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16] and graph_batch_sizes(3) == [1, 2]
    table = torch.arange(6 * 8, dtype=torch.int32).view(6, 8)
    table[5] = 99                                               # the dummy row
    rows, positions = torch.tensor([3, 0, 2, 1, 4]), torch.tensor([7, 1, 0, 5, 2])
    r, p, s = pad_decode_batch(rows, positions, table, [1, 2, 4, 8], 5)
    assert r.tolist() == [3, 0, 2, 1, 4, 5, 5, 5] and p.tolist() == [7, 1, 0, 5, 2, 0, 0, 0]
    assert s.tolist() == [31, 1, 16, 13, 34, 99, 99, 99]
    r, p, s = pad_decode_batch(rows, positions, table, [1, 2, 4], 5)   # no size holds 5
    assert r.tolist() == rows.tolist() and len(s) == 5


def test_the_decode_graphs_pad_their_entries_as_pad_decode_batch_does(models):
    """DecodeGraphs.run pads on the host, in the one copy of a step's inputs: the rows and
    positions its step reads are pad_decode_batch's."""
    from kvlab.serving.hf import pad_decode_batch

    gen = PagedGenerator(models["llama"], page_size=4, num_pages=32, max_running=8, decode_graphs="eager")
    graphs = gen.graphs
    rows, positions = [3, 0, 5, 1, 6], [2, 0, 1, 3, 2]
    gen.page_table[rows] = torch.arange(gen.page_table.shape[1], dtype=gen.page_table.dtype,
                                        device=gen.page_table.device)            # every position mapped
    with kvlab.serving.hf.plugin.paged_attention_active(gen.model), torch.inference_mode():
        graphs.run([1, 2, 3, 4, 5], rows, positions)
    want_rows, want_positions, _ = pad_decode_batch(torch.tensor(rows), torch.tensor(positions),
                                                    gen.page_table.cpu(), graphs.sizes, graphs.dummy_row)
    bs = len(want_rows)
    assert bs == graphs.padded_size(5) == 8
    assert graphs.rows[:bs].tolist() == want_rows.tolist()
    assert graphs.positions[:bs].tolist() == want_positions.tolist()
    assert graphs.ids[:bs].tolist() == [1, 2, 3, 4, 5, 0, 0, 0]


def test_clear_prefix_cache_makes_the_next_call_cold(models):
    gen = PagedGenerator(models["llama"], page_size=4, num_pages=64)
    prompts = shared_prefix_prompts(seed=4)
    first = gen.generate(prompts, max_new_tokens=3)
    assert gen.generate(prompts[:1], max_new_tokens=3) == first[:1] and gen.requests[0].cached > 0
    gen.clear_prefix_cache()
    assert gen.generate(prompts[:1], max_new_tokens=3) == first[:1] and gen.requests[0].cached == 0
    assert gen.manager.num_free_pages + gen.manager.prefix_cache.size_info.total_size // 4 == 64


@pytest.mark.parametrize("kw, argument", [
    (dict(decode_graphs="sometimes"), "decode_graphs"),
    (dict(graph_sizes=[1, 2, 64]), "graph_sizes"),
    (dict(prefill_budget=0), "prefill_budget"),
    (dict(chunked_prefill=1), "chunked_prefill"),
    (dict(attention="flash"), "attention"),
    (dict(compile_decode="yes"), "compile_decode"),
    (dict(compile_decode=True, decode_graphs="off"), "compile_decode"),
])
def test_bad_serving_options_are_refused(models, kw, argument):
    with pytest.raises(InvalidArgument) as err:
        PagedGenerator(models["llama"], page_size=4, num_pages=16, max_running=8, **kw)
    assert err.value.argument == argument


@pytest.mark.skipif(kvlab.DEVICE.type == "cuda", reason="needs a machine without CUDA (make test): "
                    "the refusal for a model on the CPU")
def test_capturing_graphs_without_cuda_is_refused(models):
    with pytest.raises(InvalidArgument, match="CUDA") as err:
        PagedGenerator(models["llama"], page_size=4, num_pages=16, decode_graphs="capture")
    assert err.value.argument == "decode_graphs"


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_serving_compiles_nothing_after_start_up(models, page_size):
    """Construction compiles the decode kernels (both variants of the fast one, and capturing
    the graphs), the decode step with torch.compile, and the page-table kernel (writing the
    dummy row); then batches of 1, 16, 17 and 40 requests, prompts in chunks, compile no
    variant of any, and torch.compile builds no graph."""
    from kvlab.attention.decode_kernels import paged_decode_attention_kernel
    from kvlab.attention.split_kernels import merge_splits_kernel, split_decode_kernel
    from kvlab.alloc.paging_kernels import write_page_table_kernel

    def compiled():
        return [sum(len(c[0]) for c in k.device_caches.values())
                for k in (paged_decode_attention_kernel, split_decode_kernel, merge_splits_kernel,
                          write_page_table_kernel)]

    from kvlab.serving.hf.graphs import dynamo_graphs

    gen = PagedGenerator(models["llama"], page_size=page_size, num_pages=4096 // page_size,
                         max_running=64, prefill_budget=64)
    assert gen.graphs.compiled            # torch.compile of the decode step, on by default here
    before = compiled(), dynamo_graphs()
    rng = random.Random(page_size)
    for n in (1, 16, 17, 40):
        gen.generate([[rng.randrange(VOCAB) for _ in range(rng.randint(1, 90))] for _ in range(n)],
                     max_new_tokens=5)
    assert (compiled(), dynamo_graphs()) == before


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["fast", "teaching"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_gpu_same_tokens_as_generate_with_compiled_triton(models, arch, page_size, attention):
    """On CUDA, compiled Triton: the models run on the GPU in float32 and must match
    generate() token for token, logits within 1e-4, with cache hits and eviction."""
    model = models[arch]
    assert model.device.type == "cuda", f"model on {model.device}, expected cuda"
    prompts = shared_prefix_prompts(seed=11 + page_size, system_len=40, suffixes=(5, 17, 1, 30, 8))
    gen = PagedGenerator(model, page_size=page_size, num_pages=160 // page_size + 2, max_running=3,
                         attention=attention)
    got = gen.generate(prompts, max_new_tokens=24, output_logits=True)
    assert_identical(model, gen, prompts, got, 24)
    assert gen.stats["prefill_cached"] > 0, f"no cache hits: {gen.stats}"
    rng = random.Random(page_size)
    more = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))] for _ in range(6)]
    got = gen.generate(more, max_new_tokens=24, output_logits=True)   # evicts the first round
    assert_identical(model, gen, more, got, 24)
    gen.manager.check_integrity()
