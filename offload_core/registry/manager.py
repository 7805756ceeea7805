"""Builds the one plugin manager: specs, built-in plugins, entry points, then a registry of strategies by name."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Iterable

import pluggy

from offload_core import hookspecs
from offload_core.errors import PluginError
from offload_core.registry.contracts import CONTRACTS, member_fault

ENTRY_POINT_GROUP = "offload_core"
DISABLE_ENV = "OFFLOAD_CORE_DISABLE_PLUGINS"

KINDS = {
    "placement": "offload_register_placements",
    "storage": "offload_register_storages",
    "policy": "offload_register_module_hook_policies",
}

BUILTIN_PLUGINS = (
    "offload_core_plugins.placement_sequential",
    "offload_core_plugins.placement_balanced",
    "offload_core_plugins.placement_balanced_low_0",
    "offload_core_plugins.storage_pinned_cpu",
    "offload_core_plugins.storage_memmap",
    "offload_core_plugins.storage_safetensors",
    "offload_core_plugins.storage_gguf",
    "offload_core_plugins.hook_align_per_call",
    "offload_core_plugins.hook_chained",
    "offload_core_plugins.hook_functional_call",
    "offload_core_plugins.hook_prefetch",
    "offload_core_plugins.hook_experts",
)


@dataclass(frozen=True)
class Strategy:
    """One registered strategy: its kind, name, factory class (a subclass of the kind's contract), config
    dataclass and the plugin it came from."""

    kind: str
    name: str
    factory: type
    config: type
    plugin: str
    version: str

    def build(self, config: Any = None) -> Any:
        """Instantiate the strategy with ``config`` (a dataclass, a mapping, or ``None`` for defaults)."""
        if config is None:
            config = self.config()
        elif not isinstance(config, self.config):
            values = {k: v for k, v in dict(config).items() if k != "_target_"}
            known = {f.name for f in dataclasses.fields(self.config)}
            unknown = sorted(set(values) - known)
            if unknown:
                raise PluginError(
                    f"{self.kind} {self.name!r} has no option(s) {', '.join(unknown)}: "
                    f"its options are {', '.join(sorted(known))}"
                )
            config = self.config(**values)
        return self.factory(config)


@dataclass
class Registry:
    """Strategies by kind and name, plus what was loaded and what failed to load."""

    strategies: dict[str, dict[str, Strategy]] = field(default_factory=lambda: {k: {} for k in KINDS})
    plugins: dict[str, str] = field(default_factory=dict)  # plugin name -> version
    failed: dict[str, str] = field(default_factory=dict)  # plugin name -> one-line reason
    #: (kind, strategy name) -> the third-party plugin whose registration of it was refused (its reason in ``failed``)
    refused: dict[tuple[str, str], str] = field(default_factory=dict)

    def get(self, kind: str, name: str) -> Strategy:
        """Return the strategy ``name`` of ``kind``; an unknown name lists the available ones (and why a plugin
        that failed to load is missing)."""
        if kind not in self.strategies:
            raise PluginError(f"unknown strategy kind {kind!r}: expected one of {', '.join(KINDS)}")
        found = self.strategies[kind].get(name)
        if found is None:
            available = ", ".join(sorted(self.strategies[kind])) or "none"
            raise PluginError(f"unknown {kind} {name!r}: available are {available}{self.missing_note(kind, name)}")
        return found

    def missing_note(self, kind: str, name: str) -> str:
        """Why ``name`` of ``kind`` may be missing: ``"; plugin 'x' failed to load (why): ..."`` naming the plugin
        that offered it and could not register it, else every plugin that failed to load; "" when none failed."""
        plugin = self.refused.get((kind, name))
        failed = {plugin: self.failed[plugin]} if plugin in self.failed else self.failed
        return "".join(
            f"; plugin {p!r} failed to load ({why}), so {f'its {kind} {name!r}' if plugin else 'what it provides'} is "
            f"missing: {disable_hint(p)}"
            for p, why in failed.items()
        )

    def create(self, kind: str, name: str, config: Any = None) -> Any:
        """Build the strategy ``name`` of ``kind`` with ``config``."""
        return self.get(kind, name).build(config)

    def names(self, kind: str) -> list[str]:
        return sorted(self.strategies[kind])

    def name_of(self, kind: str, built: Any) -> str:
        """The name the built strategy ``built`` of ``kind`` is registered under (its class's name if none)."""
        found = (name for name, strategy in self.strategies[kind].items() if type(built) is strategy.factory)
        return next(found, type(built).__name__)


def _version_of(module: Any, dist: importlib.metadata.Distribution | None) -> str:
    if dist is not None:
        return dist.version
    try:
        return importlib.metadata.version("offload_core")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0+unknown"


def disable_hint(plugin: str) -> str:
    """What to do about a third-party plugin that failed to load."""
    return f"fix, update or uninstall it, or skip it with {DISABLE_ENV}={plugin}"


def _disabled() -> set[str]:
    return {name.strip() for name in os.environ.get(DISABLE_ENV, "").split(",") if name.strip()}


def build_registry(
    extra_plugins: Iterable[Any] = (),
    load_entry_points: bool = True,
    builtins: Iterable[str] = BUILTIN_PLUGINS,
) -> Registry:
    """Build a fresh plugin manager and registry.

    Built-ins are registered exactly like third-party plugins; entry points of group ``offload_core``
    are loaded next; ``extra_plugins`` (modules or objects) last. An entry point that fails to import, implements a
    plugin hook the specs lack, raises while registering or registers a strategy that breaks its contract is recorded
    in ``failed`` (its faulty strategies left out), never fatal: the built-ins and every other plugin stay usable.
    Plugins named in ``$OFFLOAD_CORE_DISABLE_PLUGINS`` (comma-separated) are skipped.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    registry = Registry()
    disabled = _disabled()
    sources: dict[Any, tuple[str, str]] = {}
    third_party: set[str] = set()  # entry-point plugins: their faults are recorded, not raised

    def add(plugin: Any, name: str, version: str) -> None:
        if name in disabled:
            return
        pm.register(plugin, name=name)
        sources[plugin] = (name, version)
        registry.plugins[name] = version

    for module_name in builtins:
        module = importlib.import_module(module_name)
        add(module, module_name, _version_of(module, None))
    if load_entry_points:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in disabled:
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken third-party plugin must not take the tool down
                registry.failed[ep.name] = f"{type(exc).__name__}: {exc}"
                continue
            add(plugin, ep.name, ep.dist.version if ep.dist else "unknown")
            third_party.add(ep.name)
    for plugin in extra_plugins:
        add(plugin, getattr(plugin, "__name__", type(plugin).__name__), "local")
    _check_pending(pm, registry, sources, third_party)

    def fault(plugin_name: str, why: str) -> None:
        registry.failed[plugin_name] = "; ".join(filter(None, (registry.failed.get(plugin_name), why)))

    for kind, hook_name in KINDS.items():
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            plugin_name, version = sources[impl.plugin]

            def register(name: str, factory: type, config: type, *, _k=kind, _p=plugin_name, _v=version) -> None:
                try:
                    _check_config(_k, name, config)
                    adapted = as_contract(_k, name, factory)
                except PluginError as error:
                    if _p not in third_party:
                        raise
                    fault(_p, str(error))
                    registry.refused[(_k, name)] = _p
                    return
                existing = registry.strategies[_k].get(name)
                if existing is not None:
                    raise PluginError(
                        f"{_k} {name!r} is registered twice: by plugin {existing.plugin!r} and by plugin "
                        f"{_p!r}; disable one with {DISABLE_ENV}={_p}"
                    )
                registry.strategies[_k][name] = Strategy(_k, name, adapted, config, _p, _v)

            try:
                impl.function(register=register)
            except Exception as exc:
                if plugin_name not in third_party or isinstance(exc, PluginError):  # a name registered twice
                    raise
                fault(plugin_name, f"its {hook_name} raised {type(exc).__name__}: {exc}")
    return registry


def _check_pending(pm: pluggy.PluginManager, registry: Registry, sources: dict, third_party: set[str]) -> None:
    """pluggy's check that every plugin hook implemented is one of the specs; a third-party plugin failing it is
    unregistered and recorded in ``registry.failed``, any other raises."""
    while True:
        try:
            pm.check_pending()
            return
        except pluggy.PluginValidationError as error:
            name = sources.get(error.plugin, (None,))[0]
            if name not in third_party:
                raise
            pm.unregister(error.plugin)
            registry.plugins.pop(name, None)
            registry.failed[name] = " ".join(str(error).split())


def as_contract(kind: str, name: str, factory: Any) -> type:
    """``factory`` as a subclass of ``kind``'s contract: taken as is when it already is one; a class with
    the contract's required methods but no base class (a plugin class with no base class) gets the
    contract's defaults for everything else; anything else is a one-line error naming what it lacks."""
    contract = CONTRACTS[kind]
    if not isinstance(factory, type):
        raise PluginError(f"{kind} {name!r}: its factory must be a class built from its config, got {factory!r}")
    fault = member_fault(contract, factory)
    if fault is not None:
        raise PluginError(
            f"{kind} {name!r}: {fault}; see offload_core.registry.contracts.{contract.__name__} for what it takes"
        )
    if issubclass(factory, contract):
        return factory
    missing = sorted(m for m in contract.__abstractmethods__ if not callable(getattr(factory, m, None)))
    if missing:
        raise PluginError(
            f"{kind} {name!r}: {factory.__name__} lacks {', '.join(m + '()' for m in missing)}; "
            f"subclass offload_core.registry.contracts.{contract.__name__} and define it"
        )
    return type(
        factory.__name__,
        (factory, contract),
        {"__module__": factory.__module__, "__qualname__": factory.__qualname__, "__doc__": factory.__doc__},
    )


def as_strategy(kind: str, strategy: Any) -> Any:
    """A built strategy object as an instance of ``kind``'s contract: as is when it already is one; an object
    of a class written without the contract shares its state with an instance of the adapted class."""
    if isinstance(strategy, CONTRACTS[kind]):
        return strategy
    cls = as_contract(kind, type(strategy).__name__, type(strategy))
    adapted = cls.__new__(cls)
    adapted.__dict__ = strategy.__dict__
    return adapted


def _check_config(kind: str, name: str, config: type) -> None:
    if not dataclasses.is_dataclass(config):
        raise PluginError(f"{kind} {name!r}: its config must be a dataclass, got {config!r}")
    fields = {f.name: f for f in dataclasses.fields(config)}
    if "name" not in fields or fields["name"].default != name:
        raise PluginError(f"{kind} {name!r}: its config dataclass needs a field `name: str = {name!r}`")


@lru_cache(maxsize=1)
def get_registry() -> Registry:
    """The process-wide registry, built on first use (never on import)."""
    return build_registry()
