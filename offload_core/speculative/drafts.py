"""The draft models: a small checkpoint sharing the target's vocabulary, kept resident; or the target's own first
layers, its final norm and its head (self-speculative / layer-skip), sharing the target's resident weights."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload_core.errors import ConfigError


def self_layers(target: nn.Module, layers: int) -> int:
    """The number of first layers a self draft runs: ``layers``, or a quarter of the target's (at least 1)."""
    total = int(target.config.get_text_config().num_hidden_layers)
    k = layers or max(1, total // 4)
    if k >= total:
        raise ConfigError(
            f"speculative.layers={k} is not fewer than the target's {total} layers: a self draft runs "
            f"fewer (try {max(1, total // 4)})"
        )
    return k


def self_draft_modules(target: nn.Module, layers: int) -> list[str]:
    """The module names (as the device map names them) a self draft of the first ``layers`` layers runs."""
    prefix = target.base_model_prefix
    base = getattr(target, prefix, None)
    if base is None or not isinstance(getattr(base, "layers", None), nn.ModuleList):
        raise ConfigError(
            f"speculative=self needs a decoder whose layers are {prefix}.layers ({type(target).__name__} has "
            "none): use speculative=prompt_lookup or a draft checkpoint"
        )
    names = [f"{prefix}.{name}" for name, _ in base.named_children() if name != "layers"]
    names += [f"{prefix}.layers.{i}" for i in range(layers)]
    names += [name for name, _ in target.named_children() if name != prefix]
    return names


def offloaded_draft_module(
    names: list[str], device_map: dict, execution_device: torch.device
) -> tuple[str, Any] | None:
    """The first entry of ``device_map`` that offloads one of the modules ``names`` (or a parent of one), or None."""
    from offload_core.values import is_offloaded

    for key, dev in device_map.items():
        if is_offloaded(dev, execution_device) and any(
            key in ("", n) or key.startswith(n + ".") or n.startswith(key + ".") for n in names
        ):
            return key, dev
    return None


def check_self_resident(
    target: nn.Module, layers: int, device_map: dict, execution_device: torch.device, option: str, remedy: str
) -> None:
    """A self draft runs the target's first ``layers`` layers, final norm and head between passes: none may be
    offloaded by ``device_map``, else one line naming the first offloaded one (``option``: how the caller spells the
    setting; ``remedy``: what to change)."""
    k = self_layers(target, layers)
    found = offloaded_draft_module(self_draft_modules(target, k), device_map, execution_device)
    if found:
        raise ConfigError(
            f"{option} drafts with the first {k} layers, the final norm and the head, and the plan "
            f"offloads {found[0] or 'the model'} ({found[1]}): {remedy}"
        )


def hold_draft(budgets: dict, key: Any, held: dict[str, int], what: str, option: str, headroom: int = 0) -> dict:
    """``budgets`` with the draft's resident bytes (``held``: its ``weights`` and ``kv_cache``) taken from ``key``'s
    budget before the target is placed (``headroom`` stays held back too); one line when that budget cannot hold
    them beside the target (``what``: the draft as the caller names it; ``option``: how the caller spells the
    budget)."""
    from offload_core.values import format_size

    if key not in budgets:
        return budgets
    need = held["weights"] + held["kv_cache"]
    if budgets[key] - need - headroom <= 0:
        raise ConfigError(
            f"{what} needs {format_size(need)} resident (weights {format_size(held['weights'])}, KV cache "
            f"{format_size(held['kv_cache'])}), more than {option}={format_size(budgets[key])} holds beside "
            f"the target; raise {option} or set speculative=none"
        )
    return {**budgets, key: budgets[key] - need}


def draft_memory(
    spec: Any, target: nn.Module, dtype: torch.dtype, prompt_tokens: int, new_tokens: int
) -> dict[str, int]:
    """Bytes the draft of ``spec`` keeps resident beside ``target``: its weights (none for self: they are the
    target's) and its KV cache for the prompt, the new tokens and one pass of drafts."""
    from offload_core.planning.batch_memory import batch_memory

    if spec.name == "self":
        config = copy.deepcopy(target.config)
        config.get_text_config().num_hidden_layers = self_layers(target, spec.layers)
        weights = 0
    else:
        config, weights = draft_config(spec.path), draft_bytes(spec.path, dtype)
    kv = batch_memory(config, 1, prompt_tokens, new_tokens + int(spec.tokens), dtype).kv_cache
    return {"weights": weights, "kv_cache": kv}


def hold_speculation(
    spec: Any, target: nn.Module, dtype: torch.dtype, key: Any, max_memory: dict, headroom: int, generation: Any
) -> tuple[dict, dict[str, int]]:
    """``max_memory`` with what the draft of ``spec`` keeps resident (:func:`draft_memory`, for ``generation``'s
    prompt and new tokens) taken from the budget of ``key`` (the device that computes) before the target is placed,
    and those bytes (none without a draft); a budget that cannot hold it is one line. ``headroom``: what the cpu
    budget already holds back on a CPU run. The rule of every door."""
    if spec.name not in ("draft", "self"):
        return max_memory, {}
    held = draft_memory(spec, target, dtype, generation.prompt_tokens, generation.max_new_tokens)
    what = (
        f"speculative=draft: the draft {spec.path!r}"
        if spec.name == "draft"
        else "speculative=self: the self draft's KV cache"
    )
    budgets = hold_draft(max_memory, key, held, what, f"max_memory.{key}", headroom if key == "cpu" else 0)
    return budgets, held


def self_draft(target: nn.Module, layers: int) -> nn.Module:
    """A model of the target's class with ``layers`` layers whose every module is the target's own (no copy): its
    embedding, first layers, final norm, rotary embedding and head. Its forward is a separate call of the top
    module, so the target's own hooks and pass count see only the target's passes."""
    self_draft_modules(target, layers)  # the shape check
    config = copy.deepcopy(target.config)
    text = config.get_text_config()
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types)[:layers]
    with torch.device("meta"):
        draft = type(target)(config)
    prefix = target.base_model_prefix
    base, draft_base = getattr(target, prefix), getattr(draft, prefix)
    for name, module in base.named_children():
        setattr(draft_base, name, nn.ModuleList(list(module)[:layers]) if name == "layers" else module)
    for name, module in target.named_children():
        if name != prefix:
            setattr(draft, name, module)
    left = [name for name, t in list(draft.named_parameters()) + list(draft.named_buffers()) if t.is_meta]
    if left:
        raise ConfigError(
            f"speculative=self cannot share {left[0]} of {type(target).__name__} with its draft: use "
            "speculative=prompt_lookup or a draft checkpoint"
        )
    # a dispatched target's class answers ``device`` from the execution device it is told: the draft runs there too
    for name, value in vars(target).items():
        if name.startswith("_offload_core_"):
            setattr(draft, name, value)
    draft.generation_config = copy.deepcopy(target.generation_config)
    draft.eval()
    return draft


def draft_config(path: str | Path) -> Any:
    """The draft checkpoint's config; a folder that holds none is one line."""
    from transformers import AutoConfig

    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"speculative.path={str(folder)!r} holds no config.json: give a local checkpoint folder of a "
            "small causal LM sharing the target's tokenizer"
        )
    return AutoConfig.from_pretrained(folder)


def draft_bytes(path: str | Path, dtype: torch.dtype) -> int:
    """Bytes the draft checkpoint's weights take resident in ``dtype`` (counted on an empty model; tied weights
    once)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(draft_config(path), dtype=dtype)
    item = torch.empty((), dtype=dtype).element_size()
    seen = {id(p): p.numel() for p in model.parameters()}  # named_parameters drops tied duplicates: id() does too
    return sum(seen.values()) * item


def check_vocab(target: nn.Module, draft: nn.Module, path: str | Path) -> None:
    """A draft must score the target's vocabulary: the same size (transformers' same-tokenizer assisted generation)."""
    ours, theirs = target.config.get_text_config().vocab_size, draft.config.get_text_config().vocab_size
    if ours != theirs:
        raise ConfigError(
            f"speculative.path={str(path)!r} has a vocabulary of {theirs} tokens, the target {ours}: a draft "
            "must share the target's tokenizer"
        )


def load_draft(path: str | Path, target: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The draft checkpoint loaded whole on ``device`` in ``dtype`` (it stays resident), checked against the target."""
    from transformers import AutoModelForCausalLM

    draft_config(path)
    draft = AutoModelForCausalLM.from_pretrained(Path(path).expanduser(), dtype=dtype).to(device)
    check_vocab(target, draft, path)
    draft.eval()
    return draft
