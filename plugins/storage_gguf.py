"""Built-in storage ``gguf``: offloaded tensors' quantized blocks read in place from the GGUF file and dequantized just
before use (bit for bit transformers' own GGUF load)."""

from __future__ import annotations

from dataclasses import dataclass

from offload_core.hookspecs import hookimpl
from offload_core.registry.contracts import Storage
from offload_core.storage import StoreContext
from offload_core.storage.gguf.store import GGUFStore


@dataclass
class GGUFConfig:
    name: str = "gguf"


class GGUFStorage(Storage):
    #: auto=true ranks it against the converted stores for a GGUF model (left out for any other); the dispatched probe
    #: times its policy on safetensors' read path (the probe's model is no GGUF file), the dequantization priced apart
    auto = True
    #: every read dequantizes into new memory (the planner holds room for the copies in flight)
    converts_on_read = True
    #: offloaded tensors are read in place from the checkpoint's file
    reads_from = "checkpoint"
    #: a GGUF model path reaches this store as the file itself (not converted)
    reads_gguf = True

    config: GGUFConfig

    def open(self, context: StoreContext) -> GGUFStore:
        return GGUFStore(context)


@hookimpl
def offload_register_storages(register):
    register("gguf", GGUFStorage, GGUFConfig)
