"""The run's inputs as the model reads them: the tokenizer that reads them, prompts from a file, a prompt or texts as
token ids (one id per byte where the run asks for that), and token ids back as text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from offload_core.errors import ConfigError


#: ``model.tokenizer=bytes``: text read one id per UTF-8 byte (a model built without a tokenizer, for tests)
BYTES = "bytes"
#: the files a folder's tokenizer is read from (any one of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def read_tokenizer(checkpoint: Path, source: str | None = None) -> Any:
    """The tokenizer a run reads text with: ``source`` (``model.tokenizer``: a folder or repo id) when given, else the
    one in ``checkpoint``; None for ``bytes`` and for a model the project generated without one (``synthetic.json``).
    A folder holding no tokenizer is one line saying what to do, never a prompt silently read one id per byte."""
    from offload_core.loading.gguf_sources import made_from_gguf
    from offload_core.loading.sources import load_tokenizer

    if source == BYTES:
        return None
    if source:
        return _named_tokenizer(source)
    tokenizer = load_tokenizer(checkpoint)
    if tokenizer is None and (checkpoint.is_file() or made_from_gguf(checkpoint)):
        raise ConfigError(  # a GGUF file read in place, or converted into the model cache (not the user's folder)
            "the model's GGUF file carries no tokenizer (no tokenizer.ggml.* metadata), so the prompt cannot be read "
            "as text: give model.tokenizer=<a folder or Hub repo id holding the model's tokenizer> (from Python, "
            "pass token ids)"
        )
    if tokenizer is None and not (checkpoint / "synthetic.json").is_file():
        raise ConfigError(
            f"the checkpoint folder {str(checkpoint)!r} holds no tokenizer ({', '.join(TOKENIZER_FILES)}), so the "
            "prompt cannot be read as text: copy the model's tokenizer files into that folder, or give "
            "model.tokenizer=<a folder or Hub repo id holding them> (model.tokenizer=bytes reads one id per byte, "
            "for test models only; from Python, pass token ids)"
        )
    return tokenizer


def _named_tokenizer(source: str) -> Any:
    """The tokenizer in folder ``source``, else of Hub repo id ``source`` (as transformers finds it: its cache,
    ``HF_HUB_OFFLINE``)."""
    from offload_core.loading.sources import load_tokenizer

    folder = Path(source).expanduser()
    if folder.is_dir():
        tokenizer = load_tokenizer(folder)
        if tokenizer is None:
            raise ConfigError(
                f"model.tokenizer={source!r} holds no tokenizer ({', '.join(TOKENIZER_FILES)}): give the folder "
                "or Hub repo id of the model's tokenizer"
            )
        return tokenizer
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise ConfigError(
            f"model.tokenizer={source!r} is neither a folder nor a Hub repo id whose tokenizer can be loaded "
            f"({reason}): give the folder or repo id of the model's tokenizer"
        ) from None


def byte_ids(text: str, vocab_size: int) -> list[int]:
    """``text`` as ids for a model read without a tokenizer (synthetic, ``model.tokenizer=bytes``): a deterministic id
    per UTF-8 byte."""
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
    skipped, and a byte-order mark before the first (as Windows editors save UTF-8)."""
    file = Path(path).expanduser()
    try:
        lines = file.read_text(encoding="utf-8-sig").splitlines()
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
            if not record["prompt"].strip():
                raise ConfigError(f"prompts file {str(path)!r} line {number} holds an empty prompt; give it some text")
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
