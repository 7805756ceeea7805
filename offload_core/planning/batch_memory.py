"""Memory a batch of sequences needs beside the weights: the KV cache and the activations of the widest step,
estimated from a transformers model config, and the largest batch that fits a budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class BatchMemory:
    """Bytes a batch of ``batch`` sequences of ``prompt_tokens + new_tokens`` needs.

    Counted: the KV cache (2 x layers x kv heads x head dim x batch x all tokens, in the run's dtype; a state-space
    model's recurrent state instead, layers x batch x inner size x (state size + conv window));
    the prefill activations of one decoder layer (the hidden state in and out, q/k/v, the attention
    output and the MLP's gate, up and activation over every prompt token), the eager attention scores
    of one layer (heads x prompt x prompt) and the float32 logits of one position (plus the softmax
    copy). Not counted: allocator slack and the weights themselves (the placement plans those).
    """

    kv_cache: int
    activations: int

    @property
    def total(self) -> int:
        return self.kv_cache + self.activations


def _dims(config: Any) -> tuple[int, int, int, int, int, int, int]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(text.hidden_size)
    heads = int(getattr(text, "num_attention_heads", None) or 0)  # none: a state-space model's (mamba)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or (hidden // heads if heads else 0))
    intermediate = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    return int(text.num_hidden_layers), hidden, heads, kv_heads, head_dim, intermediate, int(text.vocab_size)


def batch_memory(
    config: Any, batch: int, prompt_tokens: int, new_tokens: int, dtype: torch.dtype, prefill_rows: int | None = None
) -> BatchMemory:
    """The :class:`BatchMemory` of ``batch`` sequences for a model of ``config`` running in ``dtype``; the prompt's
    activations are counted for ``prefill_rows`` of them (default all: a server prefills its newcomers apart)."""
    layers, hidden, heads, kv_heads, head_dim, intermediate, vocab = _dims(config)
    item = torch.empty((), dtype=dtype).element_size()
    tokens = prompt_tokens + new_tokens
    kv = 2 * layers * kv_heads * head_dim * batch * tokens * item
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not heads:  # a state-space model: a state per layer of each sequence, whatever its length (its conv window too)
        kv = (
            layers * batch * intermediate * (int(getattr(text, "state_size", 0)) + int(getattr(text, "conv_kernel", 0)))
        )
        kv *= item
    per_token = 2 * hidden + (heads + 2 * kv_heads) * head_dim + heads * head_dim + 3 * intermediate
    rows = batch if prefill_rows is None else prefill_rows
    activations = rows * prompt_tokens * per_token * item
    activations += rows * heads * prompt_tokens * tokens * item
    activations += 2 * batch * vocab * 4
    return BatchMemory(kv, activations)


def largest_batch(config: Any, budget: int, prompt_tokens: int, new_tokens: int, dtype: torch.dtype, upto: int) -> int:
    """The largest batch (at most ``upto``) whose :class:`BatchMemory` fits in ``budget`` bytes; 0 when none does."""
    low, high = 0, upto
    while low < high:
        mid = (low + high + 1) // 2
        if batch_memory(config, mid, prompt_tokens, new_tokens, dtype).total <= budget:
            low = mid
        else:
            high = mid - 1
    return low
