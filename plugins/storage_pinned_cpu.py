"""Built-in storage ``pinned_cpu``: offloaded tensors held in host memory, page-locked when an accelerator is
present; with ``codec=exponent``, bf16 tensors held in a lossless code that a GPU run copies and decodes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from offload_core.hookspecs import hookimpl
from offload_core.registry.contracts import Storage
from offload_core.storage import StoreContext
from offload_core.storage.memory import HostMemoryStore

#: the values of ``storage.codec``
CODECS = ("none", "exponent")


@dataclass
class PinnedCpuConfig:
    name: str = "pinned_cpu"
    #: page-lock the memory when an accelerator is present (faster, non-blocking copies)
    pin: bool = True
    #: ``exponent``: hold bf16 tensors losslessly packed (about 0.75 of their bytes: each high byte as a 4-bit index
    #: into the tensor's 15 most frequent values), copied packed and decoded on the GPU by ``hook=prefetch``;
    #: other dtypes and tensors under 4096 elements stay raw. ``none``: every tensor as it is
    codec: str = "none"
    #: with a codec: elements decoded at a time (the GPU scratch is about 2.5 bytes per element, planned)
    codec_chunk: int = 2**23


class PinnedCpuStorage(Storage):
    auto = True
    #: offloaded tensors are held in host memory
    reads_from = "memory"

    config: PinnedCpuConfig

    def __init__(self, config: PinnedCpuConfig) -> None:
        from offload_core.errors import ConfigError

        if config.codec not in CODECS:
            raise ConfigError(
                f"storage.codec={config.codec} is not a codec of pinned_cpu: give one of {', '.join(CODECS)}"
            )
        if config.codec_chunk < 2:
            raise ConfigError(
                f"storage.codec_chunk={config.codec_chunk} is below 2: give elements decoded at a time, e.g. 4194304"
            )
        super().__init__(config)

    @property
    def pinned(self) -> bool:
        """Page-locked memory: a GPU run copies from it directly, with no staging buffers."""
        return self.config.pin

    @property
    def decode_scratch(self) -> int:
        from offload_core.storage import codec

        return codec.scratch_bytes(self.config.codec_chunk) if self.config.codec != "none" else 0

    def predicted_stored(self, checkpoint: Any, dtype: torch.dtype | None) -> dict[str, int]:
        """With a codec: each bf16 tensor's packed bytes, estimated from its first million elements."""
        if self.config.codec == "none":
            return {}
        from offload_core.storage.packed import predicted_packed

        return predicted_packed(checkpoint, dtype)

    def open(self, context: StoreContext) -> HostMemoryStore:
        if self.config.codec != "none":
            from offload_core.storage.packed import PackedMemoryStore

            return PackedMemoryStore(context, pin=self.config.pin, chunk=self.config.codec_chunk)
        return HostMemoryStore(context, pin=self.config.pin)


@hookimpl
def offload_register_storages(register):
    register("pinned_cpu", PinnedCpuStorage, PinnedCpuConfig)
