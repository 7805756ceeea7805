"""The run's inputs as the model reads them: prompts from a file, a prompt or texts as token ids (a model without a
tokenizer gets one id per byte), and token ids back as text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from offload_core.errors import ConfigError


def byte_ids(text: str, vocab_size: int) -> list[int]:
    """``text`` as ids for a model without a tokenizer (a synthetic one): a deterministic id per UTF-8 byte."""
    return [1 + b % (vocab_size - 1) for b in text.encode()]


def prompt_ids(tokenizer: Any, prompt: str, chat: bool, vocab_size: int) -> torch.Tensor:
    """``prompt`` as a (1, n) tensor of token ids (with the chat template where asked and present)."""
    if tokenizer is None:
        return torch.tensor([byte_ids(prompt, vocab_size)], dtype=torch.long)
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
        )
        return ids if torch.is_tensor(ids) else ids["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


def encode_all(run_model: Any, prompts: list[str], chat: bool) -> list[list[int]]:
    """Each prompt as token ids (the chat template where asked; a deterministic id per byte for a synthetic model)."""
    vocab = run_model.model.config.vocab_size
    return [prompt_ids(run_model.tokenizer, p, chat, vocab)[0].tolist() for p in prompts]


def decode(tokenizer: Any, tokens: list[int], skip_special_tokens: bool = True) -> str:
    """Token ids as text (ids joined by spaces for a model without a tokenizer)."""
    if tokenizer is None:
        return " ".join(map(str, tokens))
    return tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)


def read_prompts(path: str | Path) -> list[str]:
    """The prompts in ``path``: one per line, or JSON lines each holding a ``prompt`` string; blank lines are
    skipped."""
    file = Path(path).expanduser()
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(
            f"prompts={str(path)!r} cannot be read ({exc.strerror}); give a text file with one prompt per line"
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"prompts={str(path)!r} is not UTF-8 text (byte {exc.start} cannot be decoded); give a text file "
            "with one prompt per line"
        ) from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ConfigError(
                    f'prompts file {str(path)!r} line {number} is not a JSON object with a "prompt" string; '
                    "fix that line"
                )
            prompts.append(record["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise ConfigError(f"prompts file {str(path)!r} holds no prompt; write one prompt per line")
    return prompts


def run_texts(texts: list[str] | None, prompt: str) -> list[str]:
    """The texts an encoder run reads: ``texts``, else the one ``prompt``."""
    texts = list(texts) if texts else [prompt]
    if not all(texts):
        raise ConfigError("texts holds an empty text: give non-empty texts, e.g. texts='[first text,second text]'")
    return texts


def encode_texts(run_model: Any, texts: list[str]) -> dict[str, torch.Tensor]:
    """``texts`` as a padded batch (``input_ids``, ``attention_mask``); a model without a tokenizer gets one id per
    byte."""
    tokenizer = run_model.tokenizer
    if tokenizer is not None:
        return dict(tokenizer(texts, padding=True, return_tensors="pt"))
    rows = [byte_ids(text, run_model.model.config.vocab_size) for text in texts]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask}
