"""Plugin hook specifications: how a plugin adds placements, stores and module-hook policies to offload_core.

Every plugin, built-in or third-party, implements one or more of these with ``@hookimpl``. Each hook
is handed a ``register`` callback instead of returning values:

    register(name: str, factory: type, config: type) -> None

``factory`` is the strategy class, built as ``factory(config_instance)``: a subclass of the kind's
contract in :mod:`offload_core.registry.contracts` (``Placement``, ``Storage``, ``Policy``), which
declares every optional capability with its default. A class written without the base class but with
the contract's required method is adapted once, at registration (it gets the defaults); one without it
is a one-line error naming the missing method. ``config`` is a dataclass whose fields are the strategy's
options and whose ``name`` field defaults to ``name``. The dataclass becomes a Hydra option of the
matching config group (``placement``, ``storage``, and ``hook`` for policies) with no YAML.
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

    Called once when the plugin manager is built, for every plugin. A placement's factory subclasses
    :class:`~offload_core.registry.contracts.Placement`, whose members say what each does and its default:
    ``make_device_map``. ``register(name, factory, config)`` adds one placement. All implementations are
    called; results are ignored (use ``register``).
    """


@hookspec
def offload_register_storages(register: Register) -> None:
    """Register storage backends (config group ``storage``).

    Called once when the plugin manager is built, for every plugin. A storage's factory subclasses
    :class:`~offload_core.registry.contracts.Storage`, whose members say what each does and its default:
    ``open`` (required), ``converts_on_read``, ``pinned``, ``reads_from``, ``reads_gguf``, ``quantized_compute``,
    ``decode_scratch``, ``decode_scratch_for``, ``decodes_experts``, ``predicted_stored``, ``holds_stored``,
    ``pools_copies``.
    ``register(name, factory, config)`` adds one storage. All implementations are called; results are ignored
    (use ``register``).
    """


@hookspec
def offload_register_module_hook_policies(register: Register) -> None:
    """Register module-hook policies (config group ``hook``).

    Called once when the plugin manager is built, for every plugin. A policy's factory subclasses
    :class:`~offload_core.registry.contracts.Policy`, whose members say what each does and its default:
    ``attach`` (required), ``granularity``, ``offload_buffers``, ``keeps_page_cache``, ``overlaps_io``,
    ``decodes_on_device``, ``reserve``, ``lighter``, ``predict_moved``, ``read_shares``, ``takes_part_in``,
    ``plan_lines``, ``own_device_map``, ``own_map_remedy``. Its handle reports counters through
    ``PolicyHandle.counters()`` (none by default), which the runner prints and writes to ``metrics.json``.
    ``register(name, factory, config)`` adds one policy. All implementations are called; results are ignored
    (use ``register``).
    """
