"""How a Python caller asks for a model to be offloaded: :class:`Offload`, one typed object with ``run.py``'s keys
and defaults (:mod:`offload_core.defaults`), taken as is or from a dict of its fields by
:func:`offload_core.from_pretrained`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

import torch

from offload_core import defaults
from offload_core.values import read_fields


@dataclass(frozen=True)
class Offload:
    """The strategies and rules of an offloaded model, named as ``run.py``'s keys (``hook`` is ``policy`` here).

    ``placement``, ``storage``, ``policy`` and ``speculative`` are plugin names (or built strategies; a
    ``SpeculativeConfig`` or a dict such as ``{"name": "draft", "path": ...}`` for ``speculative``); ``policy`` None is
    ``align_per_call`` (``prefetch`` with ``graphs`` or ``hybrid``). ``device_map`` (a dict) replaces the placement.
    ``page_cache``: the kept set's size (``"auto"``, a size, ``0``), or None/``"lru"`` for the kernel's cache.
    ``headroom``: what is held back beside the weights (``"auto"`` plans it, or a size). ``over_budget``: a budget the
    plan cannot hold (a block larger than it) is ``"refuse"``d in one line, or run over with ``"warn"``.
    ``execution_device`` defaults to ``cuda:0`` when present, else ``cpu``. ``auto`` picks the store and policy
    predicted fastest (those given stay as given). ``progress`` shows loading progress bars.
    """

    placement: str | Any = defaults.PLACEMENT
    storage: str | Any = defaults.STORAGE
    policy: str | Any | None = None
    speculative: Any = None
    page_cache: int | str | None = defaults.PAGE_CACHE
    headroom: int | str | None = defaults.HEADROOM
    over_budget: str = defaults.OVER_BUDGET
    offload_folder: str | Path | None = None
    device_map: Mapping[str, int | str] | None = None
    execution_device: torch.device | str | None = None
    no_split_module_classes: list[str] | None = None
    graphs: bool = False
    hybrid: bool = False
    auto: bool = False
    progress: bool = False

    def given(self) -> set[str]:
        """The fields set to something other than their default (what ``auto`` keeps as given)."""
        return {f.name for f in fields(self) if getattr(self, f.name) != f.default}


def read_offload(value: Offload | Mapping[str, Any] | None, what: str = "offload") -> Offload:
    """``value`` as an :class:`Offload`: itself, the defaults for None, or a dict of its fields."""
    return read_fields(Offload, value, what, "{'storage': 'memmap', 'policy': 'prefetch'}")


def named_options(value: Any) -> tuple[str, dict[str, Any]] | None:
    """A strategy given as a dict of its name and options (``{"name": "gguf", "resident": "quantized"}``): its name
    and the options; None for any other value (a dict naming none too)."""
    if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
        return None
    return value["name"], {key: option for key, option in value.items() if key != "name"}
