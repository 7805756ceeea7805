"""Plugin hook specifications: how a plugin adds placements, stores and module-hook policies to offload_core.

Every plugin, built-in or third-party, implements one or more of these with ``@hookimpl``. Each hook
is handed a ``register`` callback instead of returning values:

    register(name: str, factory: type, config: type) -> None

``factory`` is the strategy class, built as ``factory(config_instance)``; ``config`` is a dataclass
whose fields are the strategy's options and whose ``name`` field defaults to ``name``. The dataclass
becomes a Hydra option of the matching config group (``placement``, ``storage``, ``hook``) with no YAML.
Registering a name twice is an error naming both plugins.
"""

from __future__ import annotations

from typing import Callable

import pluggy

PROJECT = "offload_core"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[[str, type, type], None]


@hookspec
def offload_register_placements(register: Register) -> None:
    """Register placement strategies (config group ``placement``).

    Called once when the plugin manager is built, for every plugin. A placement's factory builds an
    object with ``make_device_map(request: PlacementRequest) -> dict[str, int | str]``.
    All implementations are called; results are ignored (use ``register``).
    """


@hookspec
def offload_register_storages(register: Register) -> None:
    """Register storage backends (config group ``storage``).

    Called once when the plugin manager is built, for every plugin. A storage's factory builds an
    object with ``open(context: StoreContext) -> Store``; see :mod:`offload_core.storage`. It may
    declare ``converts_on_read = True`` (a tensor stored in another dtype is converted on every read:
    the planner holds room for the copies in flight) and ``pinned = True`` (page-locked memory: a GPU
    run copies from it without staging). All implementations are called; results are ignored.
    """


@hookspec
def offload_register_module_hook_policies(register: Register) -> None:
    """Register module-hook policies (config group ``hook``).

    Called once when the plugin manager is built, for every plugin. A policy's factory builds an
    object with ``attach(model, plan: DispatchPlan) -> PolicyHandle``; see
    :mod:`offload_core.module_hooks`. It may define ``reserve(need: InFlight) -> dict[device, int]``:
    the bytes its units in flight take on each device, which the placement holds back from the
    budgets (without it: one block on the execution device; ``reserve_units`` builds the usual answer).
    For the plan's predicted bytes per token it may say its ``granularity`` ("module" or "block", the
    default) and, if it keeps units loaded across calls, ``predict_moved(unit_bytes: list[int]) -> int``
    (without it: every offloaded unit is read once per forward). A policy that decides the map itself
    (``functional_call`` with ``cpu_offload``) defines ``own_device_map(model, execution_device)``,
    returning ``{name: device}`` or None to leave it to the placement; a user's ``device_map`` file
    still comes first. All implementations are called; results are ignored.
    """
