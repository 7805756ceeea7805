"""The memory a batch of a state-space model (mamba: no attention heads) needs beside its weights: its recurrent state
per layer and sequence, whatever the length, instead of a KV cache."""

from __future__ import annotations

import torch
from transformers import MambaConfig

from offload_core.planning.batch_memory import batch_memory


def test_a_mamba_batch_holds_its_state_not_a_kv_cache():
    config = MambaConfig(hidden_size=64, num_hidden_layers=3, vocab_size=100, state_size=8, conv_kernel=4, expand=2)
    one = batch_memory(config, batch=1, prompt_tokens=10, new_tokens=6, dtype=torch.bfloat16)
    # 3 layers x 128 inner channels x (8 state + 4 conv window) x 2 bytes, as long for any number of tokens
    assert one.kv_cache == 3 * 128 * 12 * 2
    assert batch_memory(config, 1, 100, 60, torch.bfloat16).kv_cache == one.kv_cache
    assert batch_memory(config, 4, 10, 6, torch.bfloat16).kv_cache == 4 * one.kv_cache
    # per prompt token: hidden in and out 128, three times the inner size 384 (no q/k/v, no scores): x 10 x 2 bytes
    assert one.activations == 512 * 10 * 2 + 2 * 100 * 4
