"""The offline run against its own floor (chapter 10): what the GPU must do for these steps.

A serving run is a sequence of steps, each one forward pass. Whatever the engine, a step must
at least read every weight once (the output projection's too), read the K/V of every position
its decoding requests attend to, write its logits, and do the arithmetic of its prompt tokens.
So each step has a floor, the larger of

    bytes / measured bandwidth        bytes = weights + K/V read by the decode tokens + logits
    FLOPs / the GPU's dense peak      FLOPs = 2 x weights' parameters x tokens
                                              + the prompts' attention (2 x L x q_dim x p^2)

and the run's floor is their sum over the steps the run took (:class:`FloorTracker` follows
them through :meth:`kvlab.serving.hf.PagedGenerator.generate`'s ``on_step``). A request in a decode step
reads its prompt and every token it produced so far, the new one included.
"""
from __future__ import annotations

#: dense bfloat16 tensor-core peak (FLOP/s, no sparsity), from NVIDIA's data sheets, by a
#: substring of the device name; the first that matches wins
DENSE_BF16_PEAK = [("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12),
                   ("L40S", 362e12), ("L4", 121e12), ("A10", 125e12), ("T4", 65e12)]


def dense_peak(device_name: str) -> float | None:
    """The GPU's dense bfloat16 peak in FLOP/s, or None for a GPU not in the table."""
    for key, flops in DENSE_BF16_PEAK:
        if key in device_name:
            return flops
    return None


class FloorTracker:
    """``on_step`` for :meth:`~kvlab.serving.hf.PagedGenerator.generate`: each step's bytes and FLOPs.

    ``prompt_lens[i]``: the tokens of prompt ``i``. Counts per step; :meth:`floor` sums them."""

    def __init__(self, model, prompt_lens: list[int]):
        c = model.config
        elem = model.dtype.itemsize
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.layers, self.q_dim = c.num_hidden_layers, c.num_attention_heads * head_dim
        self.kv_per_token = c.num_hidden_layers * kv_heads * head_dim * 2 * elem
        params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
        head = model.get_output_embeddings().weight
        if head is model.get_input_embeddings().weight:
            params += head.numel()
        self.params, self.weight_bytes = params, params * elem
        self.logit_bytes = c.vocab_size * elem
        self.prompt_lens = list(prompt_lens)
        self.decoded = [0] * len(prompt_lens)
        self.steps: list[tuple[int, int]] = []     # (bytes, FLOPs) per step
        self.prompt_tokens = 0

    def __call__(self, info) -> None:
        kv = 0
        for i in info.decode:
            self.decoded[i] += 1
            kv += (self.prompt_lens[i] + self.decoded[i]) * self.kv_per_token
        prompt_tokens = info.tokens - len(info.decode)
        produced = len(info.decode) + len(info.prefill) + len(info.chunks)
        flops = 2 * self.params * info.tokens
        flops += sum(2 * self.layers * self.q_dim * self.prompt_lens[i] ** 2 for i in info.prefill)
        nbytes = self.weight_bytes + kv + produced * self.logit_bytes
        self.steps.append((nbytes, flops))
        self.prompt_tokens += prompt_tokens

    def floor(self, gb_per_s: float, peak_flops: float | None) -> dict:
        """The run's floor (seconds) and what it is made of."""
        bw = gb_per_s * 1e9
        seconds = sum(max(b / bw, f / peak_flops if peak_flops else 0.0) for b, f in self.steps)
        return dict(seconds=seconds, steps=len(self.steps), prompt_tokens=self.prompt_tokens,
                    bytes=sum(b for b, _ in self.steps),
                    flops=sum(f for _, f in self.steps), bytes_s=sum(b for b, _ in self.steps) / bw,
                    flops_s=sum(f for _, f in self.steps) / peak_flops if peak_flops else None,
                    gb_per_s=gb_per_s, peak_flops=peak_flops)
