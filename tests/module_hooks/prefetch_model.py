"""A tiny tied Llama of four blocks and a map that offloads three of them: the prefetch tests' model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from offload_core import dispatch_model


def tiny_llama():
    config = LlamaConfig(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


#: blocks 0, 1 and 3 on disk, the rest on the cpu
DISK = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "disk",
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.layers.3": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "cpu",
}


def dispatched(model: torch.nn.Module, device_map: dict, policy: Any, folder: Path, storage: str = "memmap"):
    """``model`` dispatched by ``device_map`` with ``policy`` and ``storage`` (an offload folder under ``folder``),
    its decoder layers kept whole."""
    dispatch_model(
        model,
        device_map,
        storage=storage,
        policy=policy,
        offload_folder=folder / "off",
        no_split_module_classes=["LlamaDecoderLayer"],
    )
    return model
