"""Built-in storage ``pinned_cpu``: offloaded tensors held in host memory, page-locked when an accelerator is
present."""

from __future__ import annotations

from dataclasses import dataclass

from offload_core.hookspecs import hookimpl
from offload_core.registry.contracts import Storage
from offload_core.storage import StoreContext
from offload_core.storage.memory import HostMemoryStore


@dataclass
class PinnedCpuConfig:
    name: str = "pinned_cpu"
    #: page-lock the memory when an accelerator is present (faster, non-blocking copies)
    pin: bool = True


class PinnedCpuStorage(Storage):
    auto = True
    #: offloaded tensors are held in host memory
    reads_from = "memory"

    config: PinnedCpuConfig

    @property
    def pinned(self) -> bool:
        """Page-locked memory: a GPU run copies from it directly, with no staging buffers."""
        return self.config.pin

    def open(self, context: StoreContext) -> HostMemoryStore:
        return HostMemoryStore(context, pin=self.config.pin)


@hookimpl
def offload_register_storages(register):
    register("pinned_cpu", PinnedCpuStorage, PinnedCpuConfig)
