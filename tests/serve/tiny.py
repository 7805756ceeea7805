"""A tiny chat model for the server's tests: a seeded Llama of a few kilobytes and a byte-level BPE tokenizer trained
here on a few sentences (with a ChatML chat template), saved by transformers; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "What is the capital of France? Paris is the capital of France.",
    "The quick brown fox jumps over the lazy dog.",
    "Offloaded weights are streamed around each module's forward, once per pass for every request.",
]


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of about 300 tokens with ChatML's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(CORPUS * 4, trainer)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tiny_chat_model(folder: Path, seed: int = 0) -> Path:
    """Save the tiny model and its tokenizer in ``folder`` (float32, three layers, context of 128)."""
    tok = tokenizer()
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tok),
        max_position_embeddings=128,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
