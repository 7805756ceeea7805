"""The plugin registry: one plugin manager, the strategy contracts, and the strategies registered by kind and name."""

from offload_core.registry.contracts import Placement, Policy, Storage
from offload_core.registry.manager import (
    BUILTIN_PLUGINS,
    DISABLE_ENV,
    KINDS,
    Registry,
    Strategy,
    build_registry,
    get_registry,
)

__all__ = [
    "BUILTIN_PLUGINS",
    "DISABLE_ENV",
    "KINDS",
    "Placement",
    "Policy",
    "Registry",
    "Storage",
    "Strategy",
    "build_registry",
    "get_registry",
]
