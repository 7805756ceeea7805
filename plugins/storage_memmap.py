"""Built-in storage ``memmap``: an offload folder (accelerate's index layout) read back through memory maps."""

from __future__ import annotations

from dataclasses import dataclass

from offload_core.hookspecs import hookimpl
from offload_core.registry.contracts import Storage
from offload_core.storage import StoreContext
from offload_core.storage.folder import FolderStore


@dataclass
class MemmapConfig:
    name: str = "memmap"
    #: check every offloaded file against its checksum before reusing a folder (false: sizes only; a file
    #: changed in place would then be used as it is)
    verify: bool = True


class MemmapStorage(Storage):
    auto = True  # the time prediction reads reads_from and pinned; auto=true may pick it
    config: MemmapConfig

    def open(self, context: StoreContext) -> FolderStore:
        return FolderStore(context, verify=self.config.verify)


@hookimpl
def offload_register_storages(register):
    register("memmap", MemmapStorage, MemmapConfig)
