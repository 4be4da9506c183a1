"""One matrix product where a transformers layer does three, and one where it does two (chapter 09).

At 64 running requests a decode step of a small model is latency-bound in its matrix products:
each reads a few megabytes of weights, and each costs a launch's worth of microseconds however
little it reads. A Llama / Qwen2 / Qwen3 layer computes its query, key and value projections
as three products of the same input, and its MLP's gate and up projections as two. Serving
engines load those weights side by side and compute each group in one product (vLLM's
``QKVParallelLinear`` and ``MergedColumnParallelLinear``, SGLang's the same): the same bytes
read, fewer launches. On an H200, the whole decode step of the serving model (Qwen3-0.6B's
configuration) at 64 running requests spent about 1 ms of its 2.6 ms in 196 such products
(``python -m kvlab.bench --attention`` measures the step).

:func:`fuse_projections` does that to a model kvlab serves, in place and for good: the weights
of each group are copied once into one tensor, and each projection's weight becomes a view of
its rows, so the model keeps its modules, its numbers and its memory (nothing is duplicated).
Inside :func:`fused_forwards` its attention and MLP modules compute each group in one product;
outside, they run transformers' own code as before. :class:`~kvlab.serving.hf.graphs.DecodeGraphs`
captures (and compiles) its decode step inside it::

    q_proj.weight   [heads*d,    hidden] ─┐
    k_proj.weight   [kv_heads*d, hidden]  ├─ views of qkv  [(heads + 2 kv_heads)*d, hidden]
    v_proj.weight   [kv_heads*d, hidden] ─┘
    gate_proj.weight [inter, hidden] ─┬─ views of gate_up [2*inter, hidden]
    up_proj.weight   [inter, hidden] ─┘
"""
from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from typing import Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FusedLinear", "fuse_projections", "fused_forwards"]

#: keyword arguments under which transformers versions pass a KV cache to an attention layer:
#: a layer that gets one runs transformers' own forward (kvlab's decode step passes none)
_CACHE_KWARGS = ("cache", "past_key_value", "past_key_values")


class FusedLinear(NamedTuple):
    """A group of projections of one input computed as one product: the group's weights side by
    side (each projection's weight a view of its rows), its biases (or ``None``) and each
    projection's number of outputs, in order."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]


def _fuse(linears: list[nn.Linear]) -> FusedLinear:
    """Copy the group's weights into one tensor and make each weight (and bias) a view of it
    (ordinary tensors even when called in inference mode: the model stays usable outside it)."""
    with torch.inference_mode(False), torch.no_grad():
        weight = torch.cat([lin.weight for lin in linears])
        has_bias = [lin.bias is not None for lin in linears]
        bias = torch.cat([lin.bias for lin in linears]) if all(has_bias) else None
        sizes = tuple(lin.out_features for lin in linears)
        for lin, w in zip(linears, weight.split(sizes)):
            lin.weight = nn.Parameter(w, requires_grad=lin.weight.requires_grad)
        if bias is not None:
            for lin, b in zip(linears, bias.split(sizes)):
                lin.bias = nn.Parameter(b, requires_grad=lin.bias.requires_grad)
    return FusedLinear(weight, bias, sizes)


def _plain(*linears) -> bool:
    """Fusable: plain ``nn.Linear`` modules (not quantised or wrapped), one dtype and device,
    all with a bias or none."""
    return (all(type(lin) is nn.Linear for lin in linears)
            and len({(lin.weight.dtype, lin.weight.device) for lin in linears}) == 1
            and len({lin.bias is None for lin in linears}) == 1)


def _still_views(fused: FusedLinear, linears) -> bool:
    """The projections' weights are still the fused tensor's rows (nothing reassigned them)."""
    base = fused.weight.untyped_storage().data_ptr()
    return all(lin.weight.untyped_storage().data_ptr() == base for lin in linears)


def _layers(model):
    inner = getattr(model, "model", None)
    return list(getattr(inner, "layers", None) or [])


def fuse_projections(model) -> int:
    """Fuse every layer's q/k/v and gate/up weights (idempotent); returns the number of groups
    that compute as one product inside :func:`fused_forwards`. A layer whose modules are not
    plain ``nn.Linear`` (quantised, for example) is left as it is."""
    groups = 0
    for layer in _layers(model):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is not None and all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            lins = [attn.q_proj, attn.k_proj, attn.v_proj]
            fused = getattr(attn, "_kvlab_qkv", None)
            if fused is None or not _still_views(fused, lins):
                fused = _fuse(lins) if _plain(*lins) else None
                attn._kvlab_qkv = fused
            groups += fused is not None
        if mlp is not None and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            lins = [mlp.gate_proj, mlp.up_proj]
            fused = getattr(mlp, "_kvlab_gate_up", None)
            if fused is None or not _still_views(fused, lins):
                fused = _fuse(lins) if _plain(*lins) else None
                mlp._kvlab_gate_up = fused
            groups += fused is not None
    return groups


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
    """A Llama / Qwen2 / Qwen3 attention layer's forward with q, k and v from one product; the
    rest as transformers writes it (q/k norms of Qwen3, rotary embeddings, the attention
    function the config names, the output projection)."""
    if args or position_embeddings is None or any(kwargs.get(k) is not None for k in _CACHE_KWARGS):
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    for k in _CACHE_KWARGS:
        kwargs.pop(k, None)
    modeling = sys.modules[type(self).__module__]   # the model's own modeling file
    fused = self._kvlab_qkv
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q, k, v = F.linear(hidden_states, fused.weight, fused.bias).split(fused.sizes, dim=-1)
    q, k, v = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape)
    if hasattr(self, "q_norm"):                       # Qwen3: RMSNorm of each head's q and k
        q, k = self.q_norm(q), self.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = position_embeddings
    q, k = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    impl = self.config._attn_implementation
    attend = (modeling.eager_attention_forward if impl in (None, "eager")
              else modeling.ALL_ATTENTION_FUNCTIONS[impl])
    out, weights = attend(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                          sliding_window=getattr(self, "sliding_window", None), **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _mlp_forward(self, x):
    """``down(act(gate(x)) * up(x))`` with gate and up from one product."""
    fused = self._kvlab_gate_up
    gate, up = F.linear(x, fused.weight, fused.bias).split(fused.sizes, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


@contextmanager
def fused_forwards(model) -> Iterator[int]:
    """Inside: every fused group of ``model`` (see :func:`fuse_projections`, called here) computes
    as one product; yields the number of groups. Afterwards the modules run their own forward
    again. A CUDA graph captured inside replays the fused products for good. Reentrant: an
    inner ``with`` leaves the outer one's modules as they are."""
    groups = fuse_projections(model)
    patched = []
    try:
        for layer in _layers(model):
            for name, attr, forward in (("self_attn", "_kvlab_qkv", _attention_forward),
                                        ("mlp", "_kvlab_gate_up", _mlp_forward)):
                module = getattr(layer, name, None)
                if (module is not None and getattr(module, attr, None) is not None
                        and "forward" not in module.__dict__):     # not already inside
                    module.forward = types.MethodType(forward, module)
                    patched.append(module)
        yield groups
    finally:
        for module in patched:
            module.__dict__.pop("forward", None)
