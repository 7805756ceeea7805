"""Tiny checkpoints for the speculative tests, written with transformers' own classes: a 4-layer Llama target, a
1-layer draft of the same vocabulary, a 2-layer Mixtral; and the device maps that offload their parts."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig

VOCAB = 160
#: a prompt that repeats, so prompt lookup finds drafts (random weights repeat themselves too)
PROMPT = torch.tensor([[5, 9, 17, 33, 5, 9, 17, 33, 5, 9, 17, 33, 5, 9]])


def _save(config, folder: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    return folder


def target(folder: Path, seed: int = 0) -> Path:
    return _save(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            eos_token_id=None,
        ),
        folder,
        seed,
    )


def draft(folder: Path, seed: int = 1) -> Path:
    return _save(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=VOCAB,
            eos_token_id=None,
        ),
        folder,
        seed,
    )


def mixtral(folder: Path, seed: int = 2) -> Path:
    return _save(
        MixtralConfig(
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            num_local_experts=4,
            num_experts_per_tok=2,
            eos_token_id=None,
        ),
        folder,
        seed,
    )


#: every layer but the first streamed from disk; the self draft's parts (embedding, layer 0, norm, head) resident
SELF_MAP = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "disk",
    "model.layers.3": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "cpu",
}
#: the embedding, the head and every other layer on disk
STREAM_MAP = {
    "model.embed_tokens": "disk",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.layers.3": "disk",
    "model.norm": "disk",
    "model.rotary_emb": "cpu",
    "lm_head": "disk",
}
