"""The contract between loading and module hooks: a store of offloaded tensors, written while loading, read by name."""

from __future__ import annotations

from abc import abstractmethod

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Protocol

import torch

from offload_core.alignment import address_offset, misplaced, reference_offset
from offload_core.storage.checkpoint import Checkpoint
from offload_core.storage.filecopy import Slices
from offload_core.storage.pagecache import populate, will_need
from offload_core.strategy import StrategyBase


@dataclass
class StoreContext:
    """What a storage backend needs to open its store for one run.

    ``fingerprint`` identifies what the offloaded tensors depend on (checkpoint files, dtype, device map):
    a persistent store whose fingerprint matches may be reused as is. ``checkpoint`` is the
    :class:`offload_core.loading.checkpoint.Checkpoint` being loaded (stores that read in place use it).
    ``maps_checkpoint``: the model's in-memory load uses the checkpoint's tensors in place, at their offsets
    in the mapped shards (:func:`offload_core.alignment.maps_checkpoint`); otherwise every checkpoint
    tensor's reference offset is 0. ``nbytes``: the bytes the store will hold, where the loader knows them
    (0: unknown); a store in pinned memory sizes its one arena from it.
    """

    names: list[str]
    dtype: torch.dtype | None = None
    offload_folder: Path | None = None
    checkpoint: Checkpoint | None = None
    fingerprint: dict = field(default_factory=dict)
    pin_memory: bool = False
    maps_checkpoint: bool = True
    nbytes: int = 0


def converts(stored: torch.dtype, dtype: torch.dtype | None) -> bool:
    """Whether a tensor stored as ``stored`` changes when run in ``dtype`` (only floating tensors are cast)."""
    return dtype is not None and stored.is_floating_point and stored != dtype


def convert_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Cast floating tensors to ``dtype`` (integers and bools keep theirs); no copy when nothing changes."""
    return tensor.to(dtype) if converts(tensor.dtype, dtype) else tensor


def read_tensor(
    checkpoint: Checkpoint,
    key: str,
    dtype: torch.dtype | None,
    in_place: bool,
    allocate: Callable[[tuple[int, ...], torch.dtype, int], torch.Tensor],
) -> torch.Tensor:
    """Checkpoint tensor ``key`` in ``dtype``, copied into ``allocate(shape, dtype, offset)`` (``offset``: its
    reference offset; ``in_place``: the model's in-memory load uses the checkpoint's tensors where they lie). A
    converted tensor whose parts are placed in it (per-expert tensors fused) is filled part by part: never built
    whole beside the memory that holds it, which would take its bytes twice while it loads."""
    parts = checkpoint.parts(key)
    if parts:  # built by the conversion, it would lie in a new allocation: reference offset 0
        stored = checkpoint.dtype(key)
        held = allocate(tuple(checkpoint.shape(key)), dtype if converts(stored, dtype) else stored, 0)
        for index, source in parts:
            held[index].copy_(source)
        return held
    stored = checkpoint.dtype(key)
    if checkpoint.fills(key) and not converts(stored, dtype):  # dequantized or packed into the memory that holds it,
        held = allocate(tuple(checkpoint.shape(key)), stored, 0)  # never whole beside it; a new allocation: offset 0
        if held.device.type == "cpu":  # the kernels run where the blocks lie
            return checkpoint.read_into(key, held)
        return held.copy_(checkpoint.get(key))  # resident on a GPU: built in host memory, then copied there
    value = checkpoint.get(key)
    if converts(value.dtype, dtype):  # cast in the copy (never a converted copy beside it); a new allocation: offset 0
        return allocate(tuple(value.shape), dtype, 0).copy_(value)
    return allocate(tuple(value.shape), value.dtype, reference_offset(value, in_place)).copy_(value)


#: bytes of a tensor cast to another dtype at a time while a store writes it to a file (:func:`written`; the slice
#: written and the next: two at once): a whole converted copy of a large tensor (an embedding, an LM head) beside the
#: weights already loaded would take its size over the budget while loading
CONVERT_SLICE = 2**20


def written(
    tensor: torch.Tensor, dtype: torch.dtype | None, in_place: bool
) -> tuple[memoryview | Slices, torch.dtype, int]:
    """A checkpoint tensor as a store writes it to a file for a run in ``dtype``: its bytes (cast to ``dtype`` a slice
    of :data:`CONVERT_SLICE` bytes at a time where it converts), its dtype there and its reference offset (a
    converted tensor lies in a new allocation, aligned: 0; ``in_place``: as :func:`reference_offset`)."""
    if not converts(tensor.dtype, dtype):
        return (
            memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()),
            tensor.dtype,
            reference_offset(tensor, in_place),
        )
    flat, step = tensor.reshape(-1), max(1, CONVERT_SLICE // dtype.itemsize)

    def slices() -> Iterator[memoryview]:
        for start in range(0, flat.numel(), step):
            yield memoryview(flat[start : start + step].to(dtype).view(torch.uint8).numpy())

    return Slices(flat.numel() * dtype.itemsize, slices), dtype, 0


class DevicePacked(Protocol):
    """A tensor a store holds in a form a module hook copies as it is and decodes on its execution device, into the
    tensor's own bytes (bit for bit what ``store[name]`` returns)."""

    #: tensors of one kind decode in one scratch on the device, made by the first of them
    kind: ClassVar[str]

    def new_scratch(self, device: torch.device) -> Any:
        """Fixed buffers on ``device`` that every tensor of this kind decodes in (its ``nbytes``: their bytes)."""

    def decode_on_device(self, out: torch.Tensor, scratch: Any, name: str) -> None:
        """Queue on the current stream the copies of the held bytes into ``scratch`` and their decoding into ``out``
        (a contiguous tensor of the tensor's bytes on the scratch's device)."""


class Store(Mapping):
    """Offloaded tensors by name.

    Loading calls :meth:`add_from_checkpoint` (or :meth:`put`) for each offloaded tensor unless
    :attr:`reused` is true, then :meth:`finalize`. Module hooks read with ``store[name]``: the
    returned CPU tensor must not be written to; stores hand out views of memory they hold (mapped files,
    pinned buffers) rather than fresh copies wherever they can.
    """

    #: True when a previous run's complete store was found and nothing needs writing.
    reused: bool = False
    #: bytes this store wrote to disk or copied into memory while loading.
    bytes_written: int = 0
    #: True when ``store[name]`` returns memory that is page-locked (fast, non-blocking H2D copies).
    pinned: bool = False
    #: True when some tensors are held packed (:meth:`packed`): a module hook may copy them so and decode them
    packs: bool = False
    #: True when :meth:`read_into` builds the tensor in the caller's buffer itself, in one pass (assembled, converted,
    #: decoded or copied from its mapped file): module hooks then read into their buffers through it rather than copy
    #: ``store[name]``; False (the default): :meth:`read_into` only copies ``store[name]``
    reads_into: bool = False

    def put(self, name: str, tensor: torch.Tensor, owned: bool = False) -> None:
        """Keep ``tensor`` (already converted to the run's dtype) under ``name``.

        ``owned``: the caller hands the tensor over (an in-memory model being dispatched), so a store
        that keeps tensors in memory may keep it as is instead of copying it.
        """
        raise NotImplementedError

    def add_from_checkpoint(self, name: str, checkpoint: Checkpoint, key: str, dtype: torch.dtype | None) -> None:
        """Keep checkpoint tensor ``key`` under ``name``; stores that read in place override this."""
        self.put(name, convert_dtype(checkpoint.get(key), dtype))

    def spec(self, name: str) -> tuple[torch.Size, torch.dtype]:
        """Shape and dtype of ``store[name]``; stores that can tell without reading or converting the tensor override
        this (the default reads ``store[name]``)."""
        tensor = self[name]
        return tensor.shape, tensor.dtype

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Write ``store[name]`` into ``out`` (a buffer the caller holds, of its shape and dtype). The default copies
        ``store[name]``; a store that builds the tensor on read overrides it and sets :attr:`reads_into`."""
        out.copy_(self[name])

    def offset(self, name: str) -> int:
        """``name``'s reference address offset (:mod:`offload_core.alignment`): where the model's in-memory load
        puts it, modulo :data:`~offload_core.alignment.ALIGNMENT`. A copy of it for the model (a buffer
        it is read into) starts there. The default: where ``store[name]`` starts."""
        tensor = self[name]
        return address_offset(tensor) if tensor.device.type == "cpu" else 0

    def warm(self, name: str) -> bool:
        """Bring ``name``'s bytes in ahead of use (for mapped stores: read and map the pages).

        Returns True when reading ``store[name]`` afterwards costs no further I/O and no copy; False
        when the caller should fetch (copy) the tensor ahead itself.
        """
        return populate(self[name])

    def read_expert(self, name: str, expert: int, out: torch.Tensor) -> None:
        """Copy row ``expert`` of ``store[name]`` (one expert of a fused expert tensor) into ``out``, reading
        only that row's bytes: the default reads in the pages of a row of the view ``store[name]`` hands
        out (one read rather than a page fault per page), then copies it."""
        row = self[name][expert]
        populate(row)
        out.copy_(row)

    def advise_expert(self, name: str, expert: int) -> None:
        """Hint that row ``expert`` of ``name`` will be read soon (:meth:`read_expert`): where its bytes are
        on disk, start reading them now without waiting. The default hints the row of the view
        ``store[name]`` hands out (mapped files); for memory it does nothing."""
        will_need(self[name][expert])

    def mapped_view(self, name: str) -> torch.Tensor | None:
        """``store[name]`` where it is a view of mapped file pages at its reference offset, which a CPU run computes
        on in place (only the pages it touches are read); None (the default) where reading it makes a copy."""
        return None

    def file_ranges(self, name: str, start: int, end: int) -> list[tuple[Path, int, int]]:
        """Where bytes ``[start, end)`` of :meth:`mapped_view` lie on disk: ``(file, start, end)`` per piece ([]
        unknown)."""
        return []

    def moved_nbytes(self, name: str) -> int | None:
        """The bytes a read of ``name`` moves from where the store holds it, where they differ from the tensor it
        hands out (a quantized file's blocks); None (the default): the tensor's own bytes."""
        return None

    def packed(self, name: str) -> DevicePacked | None:
        """``name`` as the store holds it, for a module hook to copy as it is and decode on its execution device (a
        lossless code, :class:`offload_core.storage.codec.Packed`; a GGUF tensor's quantized blocks); None (the
        default) where ``store[name]`` is what a read moves."""
        return None

    def packed_experts(self, name: str) -> Any:
        """A fused expert tensor ``name`` as the store holds it, for a module hook to copy routed experts as they are
        and decode them on its execution device (``decode_expert(expert, out, scratch)``, with ``expert_nbytes()`` moved
        an expert, and a ``new_scratch``); None (the default) where a routed expert's rows are what :meth:`read_expert`
        gives."""
        return None

    def drop(self, name: str) -> bool:
        """Drop ``name``'s bytes from memory after use (the page cache included), so that streaming it
        never evicts what is kept. Returns False where the store cannot (the default: nothing is done)."""
        return False

    def drop_all(self, names: Sequence[str]) -> list[str]:
        """:meth:`drop` for the tensors of a unit that has run: those dropped. The default drops each in turn; a
        store over mapped files gives the kernel one call per run of neighbouring pages instead."""
        return [name for name in names if self.drop(name)]

    def finalize(self) -> None:
        """Called once all tensors are in: make the store complete (and durable, for folders)."""

    def close(self) -> None:
        """Release files and memory; temporary data this store created is removed."""

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Mapping: subclasses implement __getitem__, __iter__, __len__.
    def __getitem__(self, name: str) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def __iter__(self) -> Iterator[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def __len__(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError


class MappingStore(Store):
    """A :class:`Store` over a mapping of tensors held elsewhere (a dict built in memory): no reference offset (0: a
    copy for the model starts aligned), nothing to read in ahead (:meth:`warm` says the caller copies), rows copied
    from ``store[name]``."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def offset(self, name: str) -> int:
        return 0

    def warm(self, name: str) -> bool:
        return False

    def read_expert(self, name: str, expert: int, out: torch.Tensor) -> None:
        out.copy_(self[name][expert])


def as_store(store: Mapping[str, torch.Tensor]) -> Store:
    """``store`` as a :class:`Store`: itself when it is one, else a :class:`MappingStore` over it (every capability at
    its "not supported" default)."""
    return store if isinstance(store, Store) else MappingStore(store)


def moved_bytes(store: Any, name: str, tensor_bytes: int) -> int:
    """The bytes reading ``name`` from ``store`` moved: :meth:`Store.moved_nbytes` where the store says, else
    ``tensor_bytes`` (the tensor handed out; any mapping that is not a :class:`Store`)."""
    moved = store.moved_nbytes(name) if isinstance(store, Store) else None
    return tensor_bytes if moved is None else moved


class FileMaps:
    """For a store that maps one file per tensor (``file_of(name)``, its bytes from ``offset(name)`` on, handed out
    by ``_mapped(name)``): the mapped view to compute on, and where its bytes lie."""

    def mapped_view(self, name: str) -> torch.Tensor | None:
        mapped = self._mapped(name)
        return None if misplaced(mapped, self.offset(name)) else mapped

    def file_ranges(self, name: str, start: int, end: int) -> list[tuple[Path, int, int]]:
        return [(self.file_of(name), self.offset(name) + start, self.offset(name) + end)]


class Storage(StrategyBase):
    """Keeps the offloaded tensors: ``open`` gives the :class:`~offload_core.storage.Store` of one run."""

    #: a tensor stored in another dtype than the run's is converted on every read: the planner holds
    #: room for the copies in flight
    converts_on_read: bool = False
    #: the store's memory is page-locked: a GPU run copies from it with no staging
    pinned: bool = False
    #: where offloaded tensors are read from while generating: ``offload_folder`` (written there at load),
    #: ``checkpoint`` (read in place) or ``memory`` (held in host memory); the time prediction reads it
    reads_from: str = "offload_folder"
    #: bytes of device scratch a GPU run that decodes the store's packed tensors on the device takes
    #: (:meth:`Store.packed`; 0: the store packs nothing)
    decode_scratch: int = 0

    #: a GPU run's routed experts cross as the store packs them (:meth:`Store.packed_experts`) and are decoded on the
    #: device, through scratch of ``decode_scratch_for``'s size for each stream that decodes them
    decodes_experts: bool = False

    def decode_scratch_for(self, largest: int | None) -> int:
        """:attr:`decode_scratch` where the largest offloaded tensor has ``largest`` elements (None: not known); the
        default does not depend on it."""
        return self.decode_scratch

    #: reads a GGUF model file in place: a GGUF model path is handed to it as the file (the other stores get the file
    #: converted once into a float32 safetensors folder)
    reads_gguf: bool = False
    #: linear layers compute on their packed GGUF weights (``storage=gguf storage.compute=quantized``)
    quantized_compute: bool = False
    #: holds the offloaded tensors in memory in the bytes a read moves (``predicted_stored``, or a GGUF file's quantized
    #: blocks), out of the cpu budget: the plan fits the resident tensors beside them
    holds_stored: bool = False
    #: ``store[name]`` hands out copies from a pool kept for reuse by size (no allocation per read): the pool keeps a
    #: buffer of every size offloaded, which the planner holds back beside the units in flight
    pools_copies: bool = False

    def predicted_stored(self, checkpoint: Checkpoint, dtype: torch.dtype | None) -> dict[str, int]:
        """The bytes a read of each checkpoint tensor will move, where the store holds it in fewer bytes than the
        tensor the model computes on in ``dtype`` (the plan predicts bytes moved per token from it); {} (the
        default): every read moves the tensor's own bytes."""
        return {}

    @abstractmethod
    def open(self, context: StoreContext) -> Store:
        """The store for the tensors ``context`` names."""
