"""The architectures the tests write tiny GGUF files of (:func:`tests.gguf_files.write_gguf`): each one's transformers
classes, gguf-py's architecture, its header's name and the config numbers of its tiny model."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Arch:
    """A transformers architecture the tests write GGUF files of: its classes, gguf-py's architecture, the name in
    the header, the config's own numbers beside the common ones."""

    config: str
    model: str
    gguf: str
    header: str
    numbers: dict = field(default_factory=dict)
    name: str | None = None  # the header's general.name (``tiny <arch>`` unless given)
    mapping: str | None = None  # transformers' GGUF config mapping of the header (the key's unless given)


#: the architectures :func:`write_gguf` writes (the MoE ones with transformers' defaults for the expert sizes it does
#: not read from a GGUF header)
ARCHS = {
    "llama": Arch("LlamaConfig", "LlamaForCausalLM", "LLAMA", "llama"),
    "qwen2": Arch("Qwen2Config", "Qwen2ForCausalLM", "QWEN2", "qwen2"),
    "qwen3": Arch("Qwen3Config", "Qwen3ForCausalLM", "QWEN3", "qwen3", {"head_dim": 128}),
    "phi3": Arch("Phi3Config", "Phi3ForCausalLM", "PHI3", "phi3", {"pad_token_id": 257}),
    "gemma2": Arch(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        "GEMMA2",
        "gemma2",
        {"head_dim": 64, "sliding_window": 64, "tie_word_embeddings": True},  # no output tensor in its GGUF files
    ),
    "gemma3": Arch(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        "GEMMA3",
        "gemma3",
        {"head_dim": 64, "sliding_window": 64, "tie_word_embeddings": True},
    ),
    "starcoder2": Arch("Starcoder2Config", "Starcoder2ForCausalLM", "STARCODER2", "starcoder2"),
    "stablelm": Arch("StableLmConfig", "StableLmForCausalLM", "STABLELM", "stablelm"),
    "qwen3_moe": Arch(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        "QWEN3MOE",
        "qwen3moe",
        {"head_dim": 64, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 768},
    ),
    "qwen2_moe": Arch(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        "QWEN2MOE",
        "qwen2moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632,
        },
    ),
    # a Mistral file as llama.cpp writes it: llama's architecture, told apart by its name alone
    "mistral": Arch(
        "MistralConfig", "MistralForCausalLM", "LLAMA", "llama", {"sliding_window": None}, "Mistral 7B Instruct v0.3"
    ),
    # Conv1D weights (transposed in the file), learned positions (as many as transformers' default context)
    "gpt2": Arch("GPT2Config", "GPT2LMHeadModel", "GPT2", "gpt2", {"max_position_embeddings": 1024}),
    # fused q/k/v interleaved per head (regrouped in the file); LM head tied, the file holds a copy as output
    "bloom": Arch("BloomConfig", "BloomForCausalLM", "BLOOM", "bloom", {"tie_word_embeddings": True}),
    "falcon": Arch("FalconConfig", "FalconForCausalLM", "FALCON", "falcon", {"tie_word_embeddings": True}),
    # Falcon-40B's and -180B's grouped q/k/v, which transformers does not tell from falcon-7b's in a GGUF header
    "falcon_40b": Arch(
        "FalconConfig",
        "FalconForCausalLM",
        "FALCON",
        "falcon",
        {"tie_word_embeddings": True, "new_decoder_architecture": True, "num_kv_heads": 2, "num_key_value_heads": 2},
        mapping="falcon",
    ),
    "nemotron": Arch("NemotronConfig", "NemotronForCausalLM", "NEMOTRON", "nemotron", {"norm_eps": 1e-5}),
    "mamba": Arch("MambaConfig", "MambaForCausalLM", "MAMBA", "mamba", {"state_size": 16}),
    "lfm2": Arch(
        "Lfm2Config",
        "Lfm2ForCausalLM",
        "LFM2",
        "lfm2",
        {"full_attn_idxs": [1], "norm_eps": 1e-5, "conv_L_cache": 3, "block_auto_adjust_ff_dim": False},
    ),
    "minimax_m2": Arch(
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        "MINIMAXM2",
        "minimax-m2",
        {"head_dim": 64, "rotary_dim": 32, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "gpt_oss": Arch(
        "GptOssConfig",
        "GptOssForCausalLM",
        "GPT_OSS",
        "gpt-oss",
        {
            "head_dim": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 64,
            "intermediate_size": 256,
        },
    ),
    # an encoder-decoder (transformers builds T5ForConditionalGeneration of it): gated feed-forward, as flan-t5's
    "t5": Arch(
        "T5Config",
        "T5ForConditionalGeneration",
        "T5",
        "t5",
        {"d_ff": 512, "d_kv": 64, "feed_forward_proj": "gated-gelu", "decoder_start_token_id": 0},
    ),
    # a relative attention bias in every layer; a t5 file transformers tells apart by "umt5" in its name
    "umt5": Arch(
        "UMT5Config",
        "UMT5ForConditionalGeneration",
        "T5",
        "t5",
        {"d_ff": 512, "d_kv": 64, "feed_forward_proj": "gated-gelu", "decoder_start_token_id": 0},
        "tiny umt5",
    ),
    # DeciLM (Nemotron-NAS): a llama-like file transformers reads the config of, but has no model class for
    "deci": Arch("LlamaConfig", "LlamaForCausalLM", "DECI", "deci"),
}

#: the architectures whose LM head transformers ties to the embedding whatever the file holds, and of which llama.cpp
#: writes the embedding twice (as ``output.weight`` too)
HEAD_COPIED = ("bloom", "falcon", "falcon_40b")


def tiny_config(arch: str, layers: int = 3, hidden: int = 256):
    import transformers

    numbers = {
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 260,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 256,
        "eos_token_id": 257,
    }
    if arch in ("t5", "umt5"):  # as many decoder layers as encoder ones (its default, taken before the name maps to it)
        numbers.update(num_layers=layers, num_decoder_layers=layers)
    return getattr(transformers, ARCHS[arch].config)(**{**numbers, **ARCHS[arch].numbers})
