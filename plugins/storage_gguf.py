"""Built-in storage ``gguf``: offloaded tensors' quantized blocks read in place from the GGUF file, or held quantized in
memory (``storage.resident=quantized``), and dequantized just before use (bit for bit transformers' own GGUF load)."""

from __future__ import annotations

from dataclasses import dataclass

from offload_core.errors import ConfigError
from offload_core.hookspecs import hookimpl
from offload_core.registry.contracts import Storage
from offload_core.storage import StoreContext
from offload_core.storage.gguf.device import scratch_bytes as device_scratch_bytes
from offload_core.storage.gguf.store import GGUFStore

#: what ``storage.resident`` takes
RESIDENT = ("dequantized", "quantized")


#: what ``storage.compute`` takes: ``exact`` (the default: every tensor dequantized, bit for bit transformers') or
#: ``quantized`` (linear layers of a type with a packed kernel compute on their packed blocks)
COMPUTE_MODES = ("exact", "quantized")


@dataclass
class GGUFConfig:
    name: str = "gguf"
    #: exact (dequantize before use, bit for bit transformers' model) or quantized (Q4_0, Q4_1, Q4_K and Q8_0 linear
    #: layers compute on their packed weights with PyTorch's int4 / int8 kernels: close to, not equal to, exact)
    compute: str = "exact"
    #: what the cpu budget holds: ``dequantized`` (the tensors it fits, dequantized once at load; the others read from
    #: the file on every use) or ``quantized`` (every offloaded tensor's quantized blocks held in memory, and the
    #: dequantized tensors that fit beside them: no reads from the disk, more of the model within the same budget)
    resident: str = "dequantized"


class GGUFStorage(Storage):
    #: auto=true ranks it against the converted stores for a GGUF model (left out for any other); the dispatched probe
    #: times its policy on safetensors' read path (the probe's model is no GGUF file), the dequantization priced apart
    auto = True
    #: every read dequantizes into new memory (the planner holds room for the copies in flight)
    converts_on_read = True
    #: ``store[name]`` dequantizes into buffers kept for reuse by size (``offload_core.storage.gguf.buffers``)
    pools_copies = True
    #: a GGUF model path reaches this store as the file itself (not converted)
    reads_gguf = True

    config: GGUFConfig

    def __init__(self, config: GGUFConfig) -> None:
        super().__init__(config)
        if config.compute not in COMPUTE_MODES:
            raise ConfigError(
                f"storage.compute={config.compute!r} is not one of {', '.join(COMPUTE_MODES)}; "
                "storage.compute=quantized computes linear layers on their packed GGUF weights"
            )
        if config.resident not in RESIDENT:
            raise ConfigError(
                f"storage.resident={config.resident!r} is not one of {', '.join(RESIDENT)}: give dequantized (read "
                "offloaded tensors from the file) or quantized (hold them quantized in memory)"
            )

    @property
    def quantized_compute(self) -> bool:
        return self.config.compute == "quantized"

    @classmethod
    def auto_variants(cls) -> list[dict]:
        """auto=true weighs both: the quantized blocks read from the file, or held in memory."""
        return [{"resident": resident} for resident in RESIDENT]

    @property
    def holds_stored(self) -> bool:  # type: ignore[override]
        """Whether the store holds the offloaded tensors' quantized blocks in memory (out of the cpu budget)."""
        return self.config.resident == "quantized"

    @property
    def reads_from(self) -> str:  # type: ignore[override]
        """Offloaded tensors are read from the checkpoint's file in place, or from memory where held."""
        return "memory" if self.holds_stored else "checkpoint"

    decodes_experts = True  # a routed expert's quantized blocks (GGUFStore.packed_experts)

    @property
    def decode_scratch(self) -> int:  # type: ignore[override]
        """A GPU run copies the offloaded tensors' quantized blocks and dequantizes them on the device, through
        fixed scratch there (at most this much)."""
        return device_scratch_bytes()

    def decode_scratch_for(self, largest: int | None) -> int:
        """The scratch passes as large as the largest offloaded tensor where it is smaller than a pass."""
        return device_scratch_bytes(largest)

    def open(self, context: StoreContext) -> GGUFStore:
        return GGUFStore(context, hold=self.holds_stored)


@hookimpl
def offload_register_storages(register):
    register("gguf", GGUFStorage, GGUFConfig)
