"""kvlab.serving.hf.fuse: q/k/v and gate/up computed as one product each, the same numbers, the same
memory, transformers' own forward outside the context and wherever a KV cache is passed."""
from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip(
    "transformers", minversion="4.56",
    reason="kvlab.serving.hf needs transformers >= 4.56: pip install 'transformers>=4.56'")

ARCHS = ("llama", "qwen2", "qwen3")


def _model(arch):
    from kvlab.serving.hf.models import tiny_model

    return tiny_model(arch, seed=3).float().eval()


def _ids():
    return torch.randint(0, 100, (1, 11), generator=torch.Generator().manual_seed(0))


def _counting_own_forwards(monkeypatch, model):
    """Count calls of transformers' own attention and MLP forwards."""
    calls = {"attn": 0, "mlp": 0}
    layer = model.model.layers[0]
    for key, cls in (("attn", type(layer.self_attn)), ("mlp", type(layer.mlp))):
        own = cls.forward

        def counted(self, *a, _own=own, _key=key, **k):
            calls[_key] += 1
            return _own(self, *a, **k)
        monkeypatch.setattr(cls, "forward", counted)
    return calls


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_products_give_the_same_logits_and_replace_the_separate_ones(arch, monkeypatch):
    from kvlab.serving.hf.fuse import fused_forwards

    model = _model(arch)
    ids = _ids()
    with torch.no_grad():
        before = model(ids, use_cache=False).logits
        calls = _counting_own_forwards(monkeypatch, model)
        with fused_forwards(model) as groups:
            fused = model(ids, use_cache=False).logits
        assert groups == 2 * model.config.num_hidden_layers, "a q/k/v and a gate/up group per layer"
        assert calls == {"attn": 0, "mlp": 0}, f"transformers' own forwards ran inside: {calls}"
        after = model(ids, use_cache=False).logits
    assert calls["attn"] == model.config.num_hidden_layers, "outside, transformers' own forward again"
    torch.testing.assert_close(fused, before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_become_views_of_the_fused_tensor_nothing_duplicated(arch):
    from kvlab.serving.hf.fuse import fuse_projections

    model = _model(arch)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q, k, v = (p.weight.detach().clone() for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    bias = attn.q_proj.bias is not None
    params = sum(p.numel() for p in model.parameters())
    fuse_projections(model)
    fused = attn._kvlab_qkv
    assert fused.weight.shape[0] == q.shape[0] + k.shape[0] + v.shape[0]
    base = fused.weight.untyped_storage().data_ptr()
    for lin, want in ((attn.q_proj, q), (attn.k_proj, k), (attn.v_proj, v)):
        assert lin.weight.untyped_storage().data_ptr() == base, "each weight a view of the fused one"
        assert torch.equal(lin.weight, want)
    assert (fused.bias is not None) == bias
    assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp._kvlab_gate_up.weight.untyped_storage().data_ptr()
    assert sum(p.numel() for p in model.parameters()) == params
    # idempotent: a second call fuses nothing again
    fuse_projections(model)
    assert attn._kvlab_qkv.weight.data_ptr() == fused.weight.data_ptr()
    # a weight reassigned since is fused again, with its new values
    with torch.no_grad():
        attn.k_proj.weight = nn.Parameter(torch.ones_like(attn.k_proj.weight))
    fuse_projections(model)
    assert attn._kvlab_qkv.weight.data_ptr() != fused.weight.data_ptr()
    assert torch.equal(attn._kvlab_qkv.weight[q.shape[0]:q.shape[0] + k.shape[0]], torch.ones_like(k))


def test_a_kv_cache_or_a_wrapped_projection_keeps_transformers_own_code(monkeypatch):
    from kvlab.serving.hf.fuse import fuse_projections, fused_forwards

    model = _model("qwen3")
    ids = _ids()
    with torch.no_grad():
        before = model(ids).logits                       # generate's way: with a cache
        calls = _counting_own_forwards(monkeypatch, model)
        with fused_forwards(model):
            cached = model(ids).logits
    assert calls["attn"] == model.config.num_hidden_layers, "a cache passed: transformers' own forward"
    torch.testing.assert_close(cached, before, rtol=1e-5, atol=1e-5)

    class Wrapped(nn.Linear):
        pass

    other = _model("llama")
    layer = other.model.layers[0]
    wrapped = Wrapped(layer.self_attn.q_proj.in_features, layer.self_attn.q_proj.out_features, bias=False)
    layer.self_attn.q_proj = wrapped
    assert fuse_projections(other) == 2 * other.config.num_hidden_layers - 1
    assert layer.self_attn._kvlab_qkv is None and layer.self_attn.q_proj is wrapped


def test_nested_contexts_and_inference_mode_leave_the_model_usable():
    from kvlab.serving.hf.fuse import fused_forwards

    model = _model("llama")
    attn = model.model.layers[0].self_attn
    with torch.inference_mode():
        with fused_forwards(model):
            with fused_forwards(model):
                pass
            assert "forward" in attn.__dict__, "the inner context left the outer one's forward"
    assert "forward" not in attn.__dict__
    assert not attn.q_proj.weight.is_inference(), "fused in inference mode, usable outside it"
    model(_ids(), use_cache=False).logits.sum().backward()   # autograd still works


def test_the_generators_decode_step_runs_fused():
    from kvlab.base import runtime
    from kvlab.serving.hf import PagedGenerator

    model = _model("qwen3").to(runtime.DEVICE)       # compiled Triton wants the model on the GPU
    gen = PagedGenerator(model, page_size=4, num_pages=64, decode_graphs="eager")
    assert gen.graphs.fused_groups == 2 * model.config.num_hidden_layers
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3]]
    got = gen.generate(prompts, max_new_tokens=6)
    with torch.no_grad():
        for p, g in zip(prompts, got):
            want = model.generate(torch.tensor([p], device=model.device), max_new_tokens=6,
                                  do_sample=False)[0, len(p):].tolist()
            assert g == want
