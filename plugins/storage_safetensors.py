"""Built-in storage ``safetensors``: zero copy, offloaded tensors read in place from the checkpoint's shards."""

from __future__ import annotations

from dataclasses import dataclass

from offload_core.hookspecs import hookimpl
from offload_core.registry.contracts import Storage
from offload_core.storage import StoreContext
from offload_core.storage.inplace import InPlaceStore


@dataclass
class SafetensorsConfig:
    name: str = "safetensors"


class SafetensorsStorage(Storage):
    auto = True
    #: a tensor stored in another dtype than the run's is converted on every read (the planner holds
    #: room for those copies)
    converts_on_read = True
    #: offloaded tensors are read in place from the checkpoint's files
    reads_from = "checkpoint"

    config: SafetensorsConfig

    def open(self, context: StoreContext) -> InPlaceStore:
        return InPlaceStore(context)


@hookimpl
def offload_register_storages(register):
    register("safetensors", SafetensorsStorage, SafetensorsConfig)
