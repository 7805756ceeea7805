"""The plugin registry: one plugin manager, and the strategies it registered by kind and name."""

from offload_core.registry.manager import BUILTIN_PLUGINS, DISABLE_ENV, KINDS, Registry, Strategy, build_registry, get_registry

__all__ = ["BUILTIN_PLUGINS", "DISABLE_ENV", "KINDS", "Registry", "Strategy", "build_registry", "get_registry"]
