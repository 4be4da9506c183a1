"""Where a decode step's time goes, kernel by kernel, against each kernel's own floor (chapter 09).

A CUDA-graph replay of the decode step is a few hundred kernels. ``torch.profiler`` gives each
kernel's GPU time; this module sorts them into the kinds of work a learner can name and puts
beside each kind the bytes it must move and so its floor (bytes / measured bandwidth)::

    kind                      what it must read and write                      kernels per step
    attention                 every K/V row of the contexts, the page-table rows   1-2 per layer
    K/V store                 the new K and V rows                              (0: stored by attention)
    matrix products           every weight once (the output projection too)     4 per layer + 1
    norms, rotary, activation the activations between the products              a few per layer
    greedy choice             the logits                                        1
    copies and gathers        the step's small inputs                           a few

Kernel names are matched by pattern (:data:`KINDS`); one that matches none is ``other``.
"""
from __future__ import annotations

import re

#: (kind, pattern of kernel names), first match wins
KINDS: list[tuple[str, str]] = [
    ("attention", r"split_decode_kernel|merge_splits_kernel|paged_decode_attention_kernel"),
    ("K/V store", r"index_put"),
    ("greedy choice", r"argmax|ArgMax"),
    ("matrix products", r"nvjet|gemm|cutlass|cublas|splitKreduce|xmma|sm90_|sm80_"),
    ("norms, rotary, activation", r"^triton_"),
    ("copies and gathers", r"memcpy|Memset|copy|gather|index|elementwise|CatArray|fill"),
]
ORDER = [k for k, _ in KINDS] + ["other"]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def kind_bytes(model, batch: int, contexts: list[int]) -> dict[str, int]:
    """The bytes each kind must move in one decode step of ``batch`` requests (floors)."""
    c = model.config
    elem = model.dtype.itemsize
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    layers, hidden, inter = c.num_hidden_layers, c.hidden_size, c.intermediate_size
    per_token = layers * kv_heads * head_dim * 2 * elem
    q_dim = c.num_attention_heads * head_dim
    kv_dim = kv_heads * head_dim
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if "embed_tokens" not in n and "norm" not in n)
    head = model.get_output_embeddings().weight
    if head is model.get_input_embeddings().weight:
        weights += head.numel() * head.element_size()
    # between the products, per layer and token: two norms (read, write), the q/k norms and
    # rotary (q and k read, written), the activation (gate and up read, one written), two
    # residual adds (two read, one written)
    activations = batch * elem * layers * (4 * hidden + 2 * (q_dim + kv_dim) + 3 * inter + 6 * hidden)
    return {"attention": sum(contexts) * (per_token + layers * 4) + batch * layers * 2 * q_dim * elem,
            "K/V store": 2 * batch * per_token,
            "matrix products": weights,
            "norms, rotary, activation": activations,
            "greedy choice": batch * c.vocab_size * elem,
            "copies and gathers": 0, "other": 0}


def profile_replay(replay, steps: int = 5) -> list[dict]:
    """Each kernel's GPU time per step over ``steps`` calls of ``replay`` (a CUDA graph's
    replay), from ``torch.profiler``: ``[{name, count, us_per_step}]``, longest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
        torch.cuda.synchronize()
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us and e.count:
            kernels.append(dict(name=e.key[:160], count=e.count // steps, us_per_step=us / steps))
    return sorted(kernels, key=lambda k: -k["us_per_step"])


def by_kind(kernels: list[dict], nbytes: dict[str, int], gb_per_s: float) -> list[dict]:
    """The profile's kernels summed per kind, with each kind's bytes and floor (µs)."""
    rows = {kind: dict(kind=kind, kernels=0, us=0.0, bytes=nbytes.get(kind, 0)) for kind in ORDER}
    for k in kernels:
        row = rows[kind_of(k["name"])]
        row["kernels"] += k["count"]
        row["us"] += k["us_per_step"]
    out = []
    for kind in ORDER:
        row = rows[kind]
        if row["kernels"] or row["bytes"]:
            row["floor_us"] = row["bytes"] / gb_per_s / 1e3
            out.append(row)
    return out
