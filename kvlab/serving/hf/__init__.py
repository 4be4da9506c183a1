"""Serve a real Hugging Face model through kvlab's memory manager (chapter 10).

    from kvlab.serving.hf import PagedGenerator
    gen = PagedGenerator(model, page_size=16, num_pages=256)   # a transformers Llama / Qwen2 / Qwen3
    new_tokens = gen.generate(prompts, max_new_tokens=32)      # greedy, = model.generate's
    gen.stats                                                  # prefill_computed, prefill_cached, ...

Modules: :mod:`~kvlab.serving.hf.attention_steps` (grouped-query paged attention in torch and Triton; needs
no transformers), :mod:`~kvlab.serving.hf.plugin` (the attention function registered with
transformers, model checks), :mod:`~kvlab.serving.hf.step` (one step as the attention calls read it),
:mod:`~kvlab.serving.hf.prefill` (admission by memory, chunked prefill), :mod:`~kvlab.serving.hf.graphs`
(decode steps replayed from CUDA graphs, padded with the dummy row; :mod:`~kvlab.serving.hf.fuse`
computes their q/k/v and gate/up projections as one product each),
:mod:`~kvlab.serving.hf.generator` (the generator), :mod:`~kvlab.serving.hf.loop` (its serving loop, with or
without overlap scheduling), :mod:`~kvlab.serving.hf.overlap` (where a step's device work runs: a CUDA
stream, or a worker thread on a CPU), :mod:`~kvlab.serving.hf.models` (small random models saved and
loaded like real ones); chapter 12's :mod:`~kvlab.serving.hf.room` and :mod:`~kvlab.serving.hf.swap`.
transformers itself is optional: ``pip install 'transformers>=4.56'`` (in a checkout, the ``hf``
extra: ``pip install -e '.[hf]'``).
"""
from __future__ import annotations

from .attention_steps import (check_paged_attention_inputs, paged_attention_reference,  # noqa: F401
                        paged_attention_step, paged_decode_attention, prefill_attention)
from .generator import PagedGenerator, RequestStats, StepInfo, StepTimes  # noqa: F401
from .graphs import graph_batch_sizes, pad_decode_batch  # noqa: F401
from .models import tiny_config, tiny_model  # noqa: F401
from .plugin import ATTENTION_NAME, SUPPORTED, check_model  # noqa: F401

__all__ = ["PagedGenerator", "RequestStats", "StepInfo", "StepTimes", "pad_decode_batch", "graph_batch_sizes",
           "paged_attention_step",
           "paged_decode_attention", "paged_attention_reference", "prefill_attention",
           "check_paged_attention_inputs", "tiny_config", "tiny_model", "ATTENTION_NAME",
           "SUPPORTED", "check_model"]
