"""Small randomly initialised Llama, Qwen2 and Qwen3 models, saved and loaded the way real ones are.

Tests and chapter 10 need a real transformers model without a download: :func:`tiny_model`
builds one from a config (2 layers, 4 query heads sharing 2 K/V heads, RoPE), writes it with
``save_pretrained`` and loads it back with ``from_pretrained`` -- the loading path a
downloaded checkpoint takes. Only the model's *size* is chosen here; its code is
transformers' own.
"""
from __future__ import annotations

import inspect
import os
import tempfile

import torch

from ...base.args import check_int
from ...base.errors import InvalidArgument
from .plugin import SUPPORTED, require_transformers

__all__ = ["tiny_config", "tiny_model"]


def tiny_config(arch: str = "llama", *, vocab_size: int = 128, hidden_size: int = 64,
                num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                intermediate_size: int = 128, max_positions: int = 1024,
                eos_token_id: int | None = None, initializer_range: float = 0.2,
                head_dim: int | None = None):
    """A ``LlamaConfig``, ``Qwen2Config`` or ``Qwen3Config`` of a model small enough for the
    interpreter. ``head_dim`` (default ``hidden_size // num_heads``) need not divide the hidden
    size: Qwen3-0.6B has 16 heads of 128 on a hidden size of 1024.

    ``initializer_range`` is larger than a trained model's 0.02 so that a random model's
    logits are well apart: greedy choices then never hinge on float rounding (a near tie
    could go either way between two correct implementations). ``eos_token_id=None``: a random
    model has no end of text unless a test picks one.
    """
    transformers = require_transformers()
    if not isinstance(arch, str) or arch not in SUPPORTED:
        raise InvalidArgument("arch", f"one of {sorted(SUPPORTED)}", f"got {arch!r}")
    sizes = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                 num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                 max_positions=max_positions)
    for name, value in sizes.items():
        check_int(name, value, minimum=1)
    if num_heads % num_kv_heads:
        raise InvalidArgument("num_heads", f"a multiple of num_kv_heads={num_kv_heads}", f"got {num_heads}")
    if head_dim is None:
        if hidden_size % num_heads:
            raise InvalidArgument("hidden_size", f"a multiple of num_heads={num_heads} (or give head_dim)",
                                  f"got {hidden_size}")
        head_dim = hidden_size // num_heads
    head_dim = check_int("head_dim", head_dim, minimum=2)
    if eos_token_id is not None:
        check_int("eos_token_id", eos_token_id, minimum=0)
    if isinstance(initializer_range, bool) or not isinstance(initializer_range, (int, float)) \
            or not initializer_range > 0:
        raise InvalidArgument("initializer_range", "a number > 0", f"got {initializer_range!r}")
    if arch == "qwen2" and head_dim != hidden_size // num_heads:
        raise InvalidArgument("head_dim", f"hidden_size // num_heads = {hidden_size // num_heads} "
                              "(Qwen2's heads split the hidden size)", f"got {head_dim}")
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[arch]
    extra = {} if arch == "qwen2" else dict(head_dim=head_dim)
    return cls(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
               num_hidden_layers=num_layers, num_attention_heads=num_heads,
               num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
               initializer_range=initializer_range, tie_word_embeddings=False,
               bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None, **extra)


def tiny_model(arch: str = "llama", path: str | None = None, *, seed: int = 0, device=None,
               **config):
    """Build a random ``arch`` model (seeded), ``save_pretrained(path)``, ``from_pretrained(path)``.

    ``path`` defaults to a fresh temporary folder; ``model.name_or_path`` says where it went.
    Returns the loaded model in eval mode (float32), on ``device`` if given.
    """
    transformers = require_transformers()
    unknown = sorted(set(config) - set(inspect.signature(tiny_config).parameters) - {"arch"})
    if unknown:
        raise InvalidArgument(unknown[0], "a parameter of kvlab.serving.hf.tiny_config", "got an unknown name")
    seed = check_int("seed", seed)
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise InvalidArgument("path", "a folder (str or os.PathLike) or None", f"got {type(path).__name__}")
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise InvalidArgument("device", "a torch device (e.g. 'cpu', 'cuda')", f"got {device!r}") from e
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
