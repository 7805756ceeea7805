"""The model a run names: its local checkpoint folder, and the model of its config built with every weight on the meta device."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload_core.errors import ConfigError
from offload_core.values import parse_dtype


@dataclass
class RunModel:
    """An empty (meta) model, the dtype it runs in, its no-split classes, checkpoint folder and tokenizer."""

    model: nn.Module
    dtype: torch.dtype
    no_split: list[str]
    checkpoint_dir: Path

    @cached_property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer, read on first use; None for a model without one (synthetic)."""
        from offload_core.loading import sources

        return sources.load_tokenizer(self.checkpoint_dir)


def resolve_checkpoint(model_cfg: dict) -> Path:
    """The local checkpoint folder the model config names (converting/creating it once if needed)."""
    from offload_core.loading import sources

    if model_cfg.get("path"):
        path = Path(model_cfg["path"]).expanduser()
        if not path.exists():
            raise ConfigError(f"model.path={str(path)!r} does not exist: give a local Hugging Face checkpoint folder")
        return path
    name = model_cfg.get("name")
    if name == "smollm2":
        return sources.smollm2_checkpoint()
    if name == "synthetic":
        return sources.synthetic_checkpoint(**sources.synthetic_preset(model_cfg.get("preset", "tiny")))
    raise ConfigError(f"model.name={name!r} needs model.path=<a local checkpoint folder> (known names: smollm2, synthetic)")


def build_empty_model(checkpoint: Path, dtype: torch.dtype | None):
    """The model of ``checkpoint``'s config with every weight on the meta device; returns (model, dtype)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from offload_core.loading.empty import init_empty_weights

    try:
        config = AutoConfig.from_pretrained(checkpoint)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{checkpoint} has no usable config.json ({str(exc).splitlines()[0]}); point model.path at a Hugging Face checkpoint folder") from None
    if dtype is None:
        stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype = parse_dtype(str(stored)) if stored is not None else torch.float32
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return model, dtype


def open_model(model_cfg: dict, dtype: torch.dtype | None) -> RunModel:
    """The run's model section as an empty model, ready to plan and load (``dtype`` None: the checkpoint's)."""
    checkpoint_dir = resolve_checkpoint(model_cfg)
    model, dtype = build_empty_model(checkpoint_dir, dtype)
    no_split = model_cfg.get("no_split_module_classes") or list(getattr(model, "_no_split_modules", None) or [])
    return RunModel(model, dtype, list(no_split), checkpoint_dir)
