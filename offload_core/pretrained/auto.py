"""``from_pretrained(..., offload={"auto": True})``: the store, policy and page-cache rule ``run.py``'s ``auto=true``
would pick for the same request, by the same ranking (:func:`offload_core.plan.auto.rank`): the request is composed as
``run.py``'s config, each configuration planned and predicted, nothing loaded."""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from offload_core import defaults
from offload_core.errors import ConfigError
from offload_core.options import Offload, named_options
from offload_core.plan.auto import rank, settings_of
from offload_core.planning import get_max_memory
from offload_core.planning.generation import Generation
from offload_core.runner.config import CONF_DIR, GROUPS, register_configs
from offload_core.runner.settings import build_strategies, read_settings

log = logging.getLogger(__name__)

#: the options of :class:`Offload` ``auto`` chooses, as ``run.py``'s command line names them
CHOSEN = {**{field: GROUPS[field] for field in ("storage", "policy")}, "page_cache": "page_cache"}


def choose_offload(
    path: Path,
    max_memory: Mapping[Any, int | str] | None,
    offload: Offload,
    model: tuple[torch.dtype | None, str | None],
    generation: Generation,
) -> tuple[Offload, list[dict[str, Any]]]:
    """``offload`` with the store, policy and page-cache rule predicted fastest for ``path`` (its ``model`` dtype and
    task as given: None is the checkpoint's) within ``max_memory`` (those ``offload`` gives stay as given), and the
    ranked table (``auto.json``'s rows); ``offload`` as given where no configuration could be predicted."""
    given = {CHOSEN[name] for name in offload.given() if name in CHOSEN} | {"batch_size"}
    with tempfile.TemporaryDirectory(prefix="offload-core-auto-") as work:
        settings = read_settings(compose(request_overrides(path, max_memory, offload, model, generation, work)), work)
        ranked = rank(settings, given)
    table = [candidate.row(place) for place, candidate in enumerate(ranked, 1)]
    if not ranked or ranked[0].problem:
        log.warning("auto: no configuration could be predicted; loading the one given")
        return dataclasses.replace(offload, auto=False), table
    best = ranked[0]
    log.info("auto: %s predicted fastest of %d configurations", best.label, len(ranked))
    strategies = build_strategies(settings_of(settings, best))
    chosen = dataclasses.replace(
        offload, storage=strategies.storage, policy=strategies.policy, page_cache=best.page_cache, auto=False
    )
    return chosen, table


def request_overrides(
    path: Path,
    max_memory: Mapping[Any, int | str] | None,
    offload: Offload,
    model: tuple[torch.dtype | None, str | None],
    generation: Generation,
    work: str,
) -> list[str]:
    """``run.py``'s overrides for the same request: the model, the budgets, the strategies named, the generation (a
    prompt of ``generation.prompt_tokens`` ids, one per byte; a batch as a prompts file in ``work``)."""
    given: list[str] = []  # a strategy given as a dict of its name and options: its group and keys
    for name, group in (("placement", "placement"), ("storage", "storage"), ("policy", "hook")):
        named = named_options(getattr(offload, name))
        if named is not None:
            offload = dataclasses.replace(offload, **{name: named[0]})
            given += [f"{group}.{key}={option}" for key, option in named[1].items()]
    for name in ("placement", "storage", "policy", "speculative"):
        value = getattr(offload, name)
        if value is not None and not isinstance(value, str):
            raise ConfigError(
                f"auto=True ranks plugins by name; {name}={value!r} is a built object: give its name, or drop auto"
            )
    if offload.device_map is not None:
        raise ConfigError("auto=True plans with a placement; device_map replaces it: drop one of them")
    overrides = ["model=local", f"model.path={path}", "model.tokenizer=bytes", "model.chat_template=false"]
    overrides += [f"{key}={value}" for key, value in budget_overrides(max_memory)]
    overrides += [f"placement={offload.placement}", f"storage={offload.storage}"]
    overrides += [f"hook={offload.policy or defaults.POLICY}", f"page_cache={offload.page_cache or 'lru'}", *given]
    overrides += [f"headroom={offload.headroom}", f"over_budget={offload.over_budget}"]
    dtype, task = model
    overrides += [f"dtype={str(dtype).removeprefix('torch.') if dtype else 'auto'}", "progress=false", "auto=true"]
    if task is not None:
        overrides.append(f"model.task={task}")
    overrides += [f"max_new_tokens={generation.max_new_tokens}", f"graphs={str(offload.graphs).lower()}"]
    overrides.append(f"hybrid={str(offload.hybrid).lower()}")
    if offload.execution_device is not None:
        overrides.append(f"execution_device={torch.device(offload.execution_device)}")
    if offload.speculative not in (None, "none"):
        overrides.append(f"speculative={offload.speculative}")
    if offload.offload_folder is not None:
        overrides.append(f"offload_folder={offload.offload_folder}")
    prompt = "x" * max(generation.prompt_tokens, 1)
    if generation.batch_size > 1:
        prompts = Path(work) / "prompts.txt"
        prompts.write_text((prompt + "\n") * generation.batch_size)
        overrides += [f"prompts={prompts}", f"batch_size={generation.batch_size}"]
    else:
        overrides.append(f"prompt={prompt}")
    return overrides


def budget_overrides(max_memory: Mapping[Any, int | str] | None) -> list[tuple[str, Any]]:
    """``max_memory`` (None: this machine's free memory) as ``run.py``'s budget keys, in bytes."""
    budgets = get_max_memory(max_memory, check_devices=False)
    pairs: list[tuple[str, Any]] = [("max_memory.cpu", budgets.get("cpu", "null"))]
    pairs += [(f"+max_memory.{key}", size) for key, size in budgets.items() if isinstance(key, int)]
    if "disk" in budgets:
        pairs.append(("max_memory.disk", budgets["disk"]))
    return pairs


def compose(overrides: list[str]) -> Any:
    """The config ``run.py`` composes from ``overrides``."""
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return hydra_compose(config_name="config", overrides=overrides)
