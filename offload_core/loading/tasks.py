"""The kinds of model a checkpoint runs as (causal LM, seq2seq LM, masked LM, sequence classification, embeddings):
the transformers Auto class of each, the task a checkpoint's config implies, and its model built empty."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload_core.errors import CheckpointError, ConfigError
from offload_core.storage.checkpoint import Checkpoint
from offload_core.values import parse_dtype

#: task -> (transformers Auto class, the name of its architecture table in transformers' auto module)
TASKS: dict[str, tuple[str, str]] = {
    "causal_lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "seq2seq_lm": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "masked_lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "sequence_classification": (
        "AutoModelForSequenceClassification",
        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    ),
    "embeddings": ("AutoModel", "MODEL_MAPPING_NAMES"),
}

#: tasks that generate tokens (the others run one forward over their texts)
GENERATIVE = frozenset({"causal_lm", "seq2seq_lm"})


class TaskError(ConfigError):
    """A task that is unknown or does not fit the checkpoint."""


def _table(task: str) -> dict[str, Any]:
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, TASKS[task][1])


def check_task(task: str, what: str = "model.task") -> str:
    """``task`` when it is one of :data:`TASKS`; else a :class:`TaskError` listing them."""
    if task not in TASKS:
        raise TaskError(f"{what}={task!r} is not a task: use one of {', '.join(TASKS)}")
    return task


def auto_class(task: str) -> type:
    """The transformers Auto class that builds a model for ``task`` (``AutoModel`` for embeddings)."""
    import transformers

    return getattr(transformers, TASKS[check_task(task)][0])


def read_config(checkpoint: str | Path, what: str = "model.path") -> Any:
    """The transformers config in ``checkpoint``; one line naming ``model_type`` when transformers does not know it
    (``what`` names the argument that gave the folder)."""
    from transformers import AutoConfig, CONFIG_MAPPING

    from offload_core.loading.gguf_checkpoint import find_gguf

    checkpoint = Path(checkpoint)
    gguf = find_gguf(checkpoint)
    if gguf is not None:  # as transformers builds it from the file (kept in the cache once built)
        from offload_core.loading.gguf_checkpoint import read_meta_config
        from offload_core.loading.gguf_sources import gguf_meta_folder

        return read_meta_config(gguf_meta_folder(gguf))
    try:
        return AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        try:
            model_type = json.loads((checkpoint / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            model_type = None
        if model_type is not None and model_type not in CONFIG_MAPPING:
            import transformers

            raise CheckpointError(
                f"{checkpoint} has model_type {model_type!r}, "
                f"an architecture transformers {transformers.__version__} does not know; "
                "upgrade transformers (pip install -U transformers) or use a checkpoint of a supported architecture"
            ) from None
        raise ConfigError(
            f"{checkpoint} has no usable config.json ({reason}); point {what} at a Hugging Face checkpoint folder"
        ) from None


def _names(task: str) -> set[str]:
    names: set[str] = set()
    for value in _table(task).values():
        names.update(value if isinstance(value, (tuple, list)) else [value])
    return names


def infer_task(config: Any) -> str:
    """The task ``config.architectures`` names (a ``…ForCausalLM`` is ``causal_lm``, a ``BertModel`` ``embeddings``);
    without architectures, the first task whose table knows ``config.model_type``."""
    for architecture in getattr(config, "architectures", None) or []:
        for task in TASKS:
            if architecture in _names(task):
                return task
    for task in TASKS:
        if config.model_type in _table(task):
            return task
    raise TaskError(
        f"cannot tell which kind of model {config.model_type!r} is; set the task to one of {', '.join(TASKS)}"
    )


def config_dtype(config: Any) -> torch.dtype:
    """The dtype the checkpoint's config declares (float32 when it declares none)."""
    # transformers 5 names it ``dtype`` (reading ``torch_dtype`` there warns that it is deprecated, even for a config
    # that declares neither); older ones name it ``torch_dtype`` only
    stored = config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    return parse_dtype(str(stored)) if stored is not None else torch.float32


def build_empty(
    config: Any, task: str, dtype: torch.dtype, what: str = "model.task", checkpoint: str | Path | None = None
) -> nn.Module:
    """The ``task`` model of ``config`` with every weight on the meta device, in eval mode; with the ``checkpoint``
    folder of a quantized model, its quantized layers hold the checkpoint's packed tensors
    (:func:`~offload_core.loading.quantized.pack_quantized`)."""
    from offload_core.loading.empty import init_empty_weights
    from offload_core.loading.quantized import pack_quantized

    cls = auto_class(check_task(task, what))
    try:
        with init_empty_weights():
            model = cls.from_config(config, dtype=dtype)
    except ValueError:
        raise TaskError(
            f"{what}={task!r} does not fit this checkpoint: transformers has no {cls.__name__} for model_type "
            f"{config.model_type!r}; use {what}={infer_task(config)} or leave {what} out"
        ) from None
    if checkpoint is not None:
        with init_empty_weights():
            pack_quantized(model, config, checkpoint, dtype)
    return model.eval()


def check_task_fits(model: nn.Module, checkpoint: Checkpoint, task: str, what: str = "model.task") -> None:
    """A :class:`TaskError` naming ``task`` when ``checkpoint`` (opened or a folder) lacks weights its model needs
    (a classification head on a masked-LM checkpoint); a tensor tied to another counts as present when either is."""
    from offload_core.loading.converted import convert_checkpoint

    keys = set(convert_checkpoint(model, checkpoint).keys())
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    missing = sorted(names[0] for names in groups.values() if not keys.intersection(names))
    if missing:
        saved_as = infer_task(model.config)
        advice = (
            f"use {what}={saved_as} (what its config.architectures names) or leave {what} out"
            if saved_as != task
            else "check that the checkpoint is complete"
        )
        raise TaskError(
            f"{what}={task!r} does not fit this checkpoint: it lacks {len(missing)} weight(s) that task needs, "
            f"such as {missing[0]!r}; {advice}"
        )
