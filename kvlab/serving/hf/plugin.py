"""Where kvlab plugs into a transformers model: its attention-interface registry (chapter 10).

transformers lets a model's attention layers call any function registered under a name in
``transformers.AttentionInterface`` and selected with ``attn_implementation``. The layer still
does everything else itself -- projections, RoPE, norms, the MLP -- and hands the function the
queries, keys and values of the tokens of this forward call::

    LlamaAttention.forward (the model's own code)          kvlab (this package)
    ─────────────────────────────────────────────          ──────────────────────────────
    q, k, v = q_proj(x), k_proj(x), v_proj(x)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    attention_interface = ALL_ATTENTION_FUNCTIONS[...]  →  kvlab_attention(module, q, k, v, ...,
                                                              kvlab_step=<this step's batch>)
                                                             stores k, v in the pool at the
                                                             page table's slots, attends
    o_proj(attn_output)                                 ←  through the rows

Keyword arguments given to the model's ``forward`` travel down to the attention function
(transformers documents this); kvlab passes the step's batch description as ``kvlab_step``.
No custom mask function is registered, so transformers builds no mask: causality comes from
the page table (each query reads only the positions before it).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from ...base.errors import InvalidArgument

__all__ = ["ATTENTION_NAME", "SUPPORTED", "MIN_TRANSFORMERS", "require_transformers",
           "check_model", "check_generation_config", "eos_token_ids", "register_attention",
           "kvlab_attention", "paged_attention_active"]

#: the name kvlab's attention function is registered under in transformers' AttentionInterface
ATTENTION_NAME = "kvlab_paged"
#: config.model_type -> the causal-LM class kvlab serves (RoPE, grouped-query attention). Qwen3
#: normalises each head's query and key (RMSNorm, ``q_norm`` / ``k_norm``) inside its attention
#: layer, before RoPE: the layer's own code, which runs before kvlab's function is called
SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
#: oldest transformers with everything used here (AttentionInterface, set_attn_implementation,
#: logits_to_keep as a tensor, kwargs forwarded to the attention function)
MIN_TRANSFORMERS = (4, 56)

# generation_config fields that change greedy decoding, with their neutral values: kvlab's loop
# is plain greedy (argmax) with EOS, so it refuses a model whose generate() would do more
_NEUTRAL_GENERATION = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "min_length": 0, "min_new_tokens": 0, "bad_words_ids": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "sequence_bias": None,
}


def require_transformers():
    """Import transformers, or say how to install it (the ``hf`` extra) and which version."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("kvlab.serving.hf serves Hugging Face models and needs transformers >= "
                          f"{'.'.join(map(str, MIN_TRANSFORMERS))}: pip install "
                          f"'transformers>={'.'.join(map(str, MIN_TRANSFORMERS))}'") from e
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_TRANSFORMERS:
        raise ImportError(f"kvlab.serving.hf needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))}, "
                          f"found {transformers.__version__}: pip install -U "
                          f"'transformers>={'.'.join(map(str, MIN_TRANSFORMERS))}'")
    return transformers


def check_model(model) -> None:
    """Refuse, naming what is supported, any model kvlab cannot serve token for token."""
    transformers = require_transformers()
    classes = tuple(getattr(transformers, name) for name in SUPPORTED.values())
    if not isinstance(model, classes):
        config = getattr(model, "config", None)
        kind = getattr(config, "model_type", None)
        raise InvalidArgument(
            "model", "a transformers causal LM of the Llama family (LlamaForCausalLM, e.g. SmolLM2), "
            "Qwen2 (Qwen2ForCausalLM) or Qwen3 (Qwen3ForCausalLM): config.model_type in "
            + str(sorted(SUPPORTED)),
            f"got {type(model).__name__} (model_type {kind!r})")
    if getattr(model.config, "use_sliding_window", False):
        raise InvalidArgument("model.config.use_sliding_window", "False: kvlab's paged attention "
                              "reads every earlier position of a request", "got True")
    if not hasattr(model, "set_attn_implementation"):
        raise InvalidArgument("model", "a model that can switch attention at run time "
                              "(set_attn_implementation)", f"{type(model).__name__} cannot")


def check_generation_config(model) -> None:
    """Refuse a generation config whose ``generate`` would not be plain greedy + EOS."""
    config = getattr(model, "generation_config", None)
    for name, neutral in _NEUTRAL_GENERATION.items():
        value = getattr(config, name, None)
        if value is not None and value != neutral and value != [] and value != {}:
            raise InvalidArgument(f"model.generation_config.{name}",
                                  f"{neutral!r}: kvlab's loop decodes greedily (argmax, stop at EOS) "
                                  "with no other logits processors", f"got {value!r}")


def eos_token_ids(model) -> frozenset[int]:
    """The token ids that end a request, as ``generate`` reads them: the generation config's
    ``eos_token_id`` (an int, a list, or None for none)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset(int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos]))


@torch.compiler.disable
def kvlab_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    kvlab_step=None, **kwargs):
    """The function registered as ``attn_implementation="kvlab_paged"``.

    ``query``: ``[1, heads, N, head_dim]``, ``key``/``value``: ``[1, kv_heads, N, head_dim]``
    for the ``N`` tokens of this step, all requests packed in one row. Returns
    ``([1, N, heads, head_dim], None)`` as every attention function of transformers does.

    ``torch.compile`` does not look inside (a graph break where a layer calls it): the K/V
    store and the Triton kernels run as they are, and one compiled piece of the layer serves
    every layer (chapter 09, :class:`kvlab.serving.hf.graphs.DecodeGraphs`).
    """
    if kvlab_step is None:
        raise RuntimeError(f"attn_implementation={ATTENTION_NAME!r} runs only inside "
                           "kvlab.serving.hf.PagedGenerator: it needs the step's page-table rows")
    if kwargs.get("sliding_window") is not None:
        raise InvalidArgument("sliding_window", "None (kvlab's attention reads the whole prefix)",
                              f"got {kwargs['sliding_window']}")
    return kvlab_step.attend(module.layer_idx, query, key, value, scaling), None


def register_attention() -> None:
    """Register :func:`kvlab_attention` with transformers (idempotent)."""
    transformers = require_transformers()
    transformers.AttentionInterface.register(ATTENTION_NAME, kvlab_attention)


@contextmanager
def paged_attention_active(model) -> Iterator[None]:
    """Inside: the model's attention layers call kvlab; afterwards, what they called before."""
    register_attention()
    before = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(before)
