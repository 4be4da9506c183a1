"""Small randomly initialised Llama and Qwen2 models, saved and loaded the way real ones are.

Tests and chapter 10 need a real transformers model without a download: :func:`tiny_model`
builds one from a config (2 layers, 4 query heads sharing 2 K/V heads, RoPE), writes it with
``save_pretrained`` and loads it back with ``from_pretrained`` -- the loading path a
downloaded checkpoint takes. Only the model's *size* is chosen here; its code is
transformers' own.
"""
from __future__ import annotations

import tempfile

import torch

from .plugin import SUPPORTED, require_transformers

__all__ = ["tiny_config", "tiny_model"]


def tiny_config(arch: str = "llama", *, vocab_size: int = 128, hidden_size: int = 64,
                num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                intermediate_size: int = 128, max_positions: int = 1024,
                eos_token_id: int | None = None, initializer_range: float = 0.2):
    """A ``LlamaConfig`` or ``Qwen2Config`` of a model small enough for the interpreter.

    ``initializer_range`` is larger than a trained model's 0.02 so that a random model's
    logits are well apart: greedy choices then never hinge on float rounding (a near tie
    could go either way between two correct implementations). ``eos_token_id=None``: a random
    model has no end of text unless a test picks one.
    """
    transformers = require_transformers()
    if arch not in SUPPORTED:
        raise ValueError(f"arch must be one of {sorted(SUPPORTED)}, got {arch!r}")
    cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
    return cls(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
               num_hidden_layers=num_layers, num_attention_heads=num_heads,
               num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
               initializer_range=initializer_range, tie_word_embeddings=False,
               bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None)


def tiny_model(arch: str = "llama", path: str | None = None, *, seed: int = 0, device=None,
               **config):
    """Build a random ``arch`` model (seeded), ``save_pretrained(path)``, ``from_pretrained(path)``.

    ``path`` defaults to a fresh temporary folder; ``model.name_or_path`` says where it went.
    Returns the loaded model in eval mode (float32), on ``device`` if given.
    """
    transformers = require_transformers()
    cfg = tiny_config(arch, **config)
    with torch.random.fork_rng(devices=[]):   # seeded weights, the caller's RNG untouched
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    path = path or tempfile.mkdtemp(prefix=f"kvlab-tiny-{arch}-")
    logging = transformers.utils.logging
    bars = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()            # no progress bars for a model this small
    try:
        model.save_pretrained(path)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(path)
    finally:
        if bars:
            logging.enable_progress_bar()
    loaded.eval()
    return loaded.to(device) if device is not None else loaded
