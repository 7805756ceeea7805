"""A host-memory store that holds bf16 tensors in the lossless code of :mod:`offload_core.storage.codec` (about 0.75
of their bytes), so a GPU run copies fewer bytes and decodes them on the device; other tensors are held raw."""

from __future__ import annotations

import logging
from typing import Iterator

import torch

from offload_core.storage import codec
from offload_core.storage.base import StoreContext, converts, read_tensor
from offload_core.storage.checkpoint import Checkpoint
from offload_core.storage.memory import HostMemoryStore

log = logging.getLogger(__name__)


class PackedMemoryStore(HostMemoryStore):
    """:class:`HostMemoryStore` with each bf16 tensor of at least :data:`codec.MIN_ELEMENTS` elements packed as it
    is stored (kept raw where the code would not take fewer bytes); ``store[name]`` decodes a packed tensor on the
    host, its checksums checked, and :meth:`packed` hands a module hook the code to decode on its device."""

    packs = True
    reads_into = True  # decodes into the caller's buffer

    def __init__(self, context: StoreContext, pin: bool = True, chunk: int = codec.CHUNK_ELEMENTS) -> None:
        super().__init__(context, pin=pin)
        if self.arena is not None:  # the pinned arena sized for the packed bytes, not the raw ones
            self.arena.expected = expected_nbytes(context)
        if not context.pin_memory:
            log.warning(
                "storage.codec: a run on the CPU decodes each packed tensor on the host at every read (slower than "
                "storage.codec=none); the code pays on a GPU run, where fewer bytes cross to the device"
            )
        self.chunk = chunk
        self._packed: dict[str, codec.Packed] = {}
        self.raw_nbytes = 0  # bytes of the tensors it packed, as they were

    # -- writing ---------------------------------------------------------------------------------
    def put(self, name: str, tensor: torch.Tensor, owned: bool = False) -> None:
        if not self._pack(name, tensor):
            super().put(name, tensor, owned)

    def add_from_checkpoint(self, name: str, checkpoint: Checkpoint, key: str, dtype: torch.dtype | None) -> None:
        stored = checkpoint.dtype(key)
        final = dtype if converts(stored, dtype) else stored
        if not codec.applies(final, torch.Size(checkpoint.shape(key)).numel()):
            super().add_from_checkpoint(name, checkpoint, key, dtype)
            return
        tensor = read_tensor(checkpoint, key, dtype, False, lambda shape, dt, offset: torch.empty(shape, dtype=dt))
        if not self._pack(name, tensor):
            super().add_from_checkpoint(name, checkpoint, key, dtype)

    def _pack(self, name: str, tensor: torch.Tensor) -> bool:
        if not codec.applies(tensor.dtype, tensor.numel()):
            return False
        packed = codec.encode(tensor.to("cpu"), self.chunk, self._blob)
        if packed is None:
            return False
        self._tensors.pop(name, None)
        self._packed[name] = packed
        self.bytes_written += packed.nbytes
        self.raw_nbytes += packed.raw_nbytes
        return True

    def _blob(self, nbytes: int) -> torch.Tensor:
        if self.arena is not None:
            return self.arena.take((nbytes,), torch.uint8)
        return torch.empty(nbytes, dtype=torch.uint8)

    def finalize(self) -> None:
        """Every tensor is in: each packed one says the largest chunk of the store, so that a device's decoding
        scratch (sized from the first it decodes) is as large as the store needs and no larger."""
        if self._tensors and not self._packed:
            kinds = sorted({str(t.dtype).removeprefix("torch.") for t in self._tensors.values()})
            log.warning(
                "storage.codec=exponent packed nothing: it applies to bf16 tensors of %d elements or more, and the "
                "offloaded tensors are %s (dtype=bfloat16 runs the model in bf16)",
                codec.MIN_ELEMENTS,
                ", ".join(kinds),
            )
        largest = max((c.count for p in self._packed.values() for c in p.chunks), default=0)
        for packed in self._packed.values():
            packed.chunk = largest
        super().finalize()

    # -- reading ---------------------------------------------------------------------------------
    def packed(self, name: str) -> codec.Packed | None:
        return self._packed.get(name)

    def spec(self, name: str) -> tuple[torch.Size, torch.dtype]:
        packed = self._packed.get(name)
        if packed is not None:
            return packed.shape, packed.dtype
        tensor = self._tensors[name]
        return tensor.shape, tensor.dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        packed = self._packed.get(name)
        return codec.decode(packed, name) if packed is not None else self._tensors[name]

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """``name`` written into ``out`` (a buffer the caller holds, on the host): decoded, or copied."""
        packed = self._packed.get(name)
        if packed is not None:
            codec.decode_into(packed, out, name=name)
        else:
            out.copy_(self._tensors[name])

    def moved_nbytes(self, name: str) -> int | None:
        packed = self._packed.get(name)
        return packed.nbytes if packed is not None else None

    def offset(self, name: str) -> int:
        return 0 if name in self._packed else super().offset(name)

    def warm(self, name: str) -> bool:
        return False if name in self._packed else super().warm(name)

    def mapped_view(self, name: str) -> torch.Tensor | None:
        return None if name in self._packed else super().mapped_view(name)

    def verify(self) -> None:
        """Check every packed tensor's checksums (:class:`~offload_core.errors.StorageError` where one fails)."""
        for name, packed in self._packed.items():
            packed.verify(name)

    def __iter__(self) -> Iterator[str]:
        yield from self._tensors
        yield from self._packed

    def __len__(self) -> int:
        return len(self._tensors) + len(self._packed)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors or name in self._packed

    def close(self) -> None:
        self._packed.clear()
        super().close()


def predicted_packed(checkpoint: Checkpoint, dtype: torch.dtype | None, sample: int = 2**20) -> dict[str, int]:
    """The packed bytes of each checkpoint tensor the code applies to in ``dtype``, estimated from its first
    ``sample`` elements (:func:`codec.estimate`); the other tensors are left out (read as they are)."""
    out = {}
    for key in checkpoint.keys():
        stored = checkpoint.dtype(key)
        final = dtype if converts(stored, dtype) else stored
        numel = torch.Size(checkpoint.shape(key)).numel()
        if not codec.applies(final, numel):
            continue
        head = checkpoint.get(key).reshape(-1)[:sample].to(final)
        out[key] = int(codec.estimate(head) * numel * final.itemsize)
    return out


#: the packed share of their bytes the pinned arena is sized for (weights take 0.75-0.76: the rest is margin, as a
#: store that outgrows its arena takes a second one)
ARENA_SHARE = 0.8


def expected_nbytes(context: StoreContext) -> int:
    """The bytes the store will hold: ``context.nbytes`` with the checkpoint tensors the code applies to (in the run's
    dtype) counted at :data:`ARENA_SHARE` of their size."""
    checkpoint = context.checkpoint
    if checkpoint is None or not context.nbytes:
        return context.nbytes
    keys = set(checkpoint.keys())
    coded = 0
    for name in context.names:
        if name in keys:
            final = context.dtype if converts(checkpoint.dtype(name), context.dtype) else checkpoint.dtype(name)
            numel = torch.Size(checkpoint.shape(name)).numel()
            coded += numel * final.itemsize if codec.applies(final, numel) else 0
    return context.nbytes - coded + int(coded * ARENA_SHARE)
