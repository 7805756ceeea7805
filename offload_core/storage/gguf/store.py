"""A store that reads offloaded tensors' quantized blocks in place from the GGUF file and dequantizes them on every
read, into the buffer the module hook holds where it hands one (nothing is written to disk, nothing upcast is kept)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator, Sequence

import torch

from offload_core import devices
from offload_core.errors import StorageError
from offload_core.storage.base import Store, StoreContext
from offload_core.storage.checkpoint import Checkpoint
from offload_core.storage.gguf.buffers import BufferPool
from offload_core.storage.gguf.device import DeviceBlocks, ExpertBlocks, device_form, experts_form, pass_elements
from offload_core.storage.pagecache import drop_named, span_of, will_need


class NotGGUFError(StorageError):
    """storage=gguf given a checkpoint that is not a GGUF file."""


def check_gguf(checkpoint: Checkpoint | None) -> None:
    """Refuse a checkpoint that is not a GGUF file, in one line (as the plan starts, and as the store opens)."""
    if checkpoint is None or not checkpoint.is_gguf:
        raise NotGGUFError(
            "storage=gguf reads offloaded tensors in place from a GGUF file, and this model's checkpoint is "
            "not one; give model.path=<file.gguf> (or a folder holding one), or use storage=safetensors"
        )


class GGUFStore(Store):
    """``store[name]`` is ``name`` dequantized (and converted as transformers' GGUF load converts it) into a buffer
    of the store's pool that nothing uses any more; :meth:`read_into` writes it into a buffer the caller holds
    (``hook=prefetch``'s block buffers). With ``hold`` the quantized blocks are copied into memory at load and read
    from there. The checkpoint must be a GGUF one
    (:class:`offload_core.loading.gguf_checkpoint.GGUFCheckpoint`, read through its methods ``read_into``,
    ``raw``, ``stored_nbytes``, ``byte_range``, ``shape``)."""

    reads_into = True  # dequantizes into the caller's buffer
    packs = True  # a GPU run may copy a tensor's quantized blocks and dequantize them there (:meth:`packed`)

    def __init__(self, context: StoreContext, hold: bool = False) -> None:
        checkpoint = context.checkpoint
        check_gguf(checkpoint)
        self.checkpoint = checkpoint
        self.dtype = context.dtype or torch.float32
        self._refs: dict[str, str] = {}
        self.bytes_written = 0
        #: what ``store[name]`` dequantizes into: a buffer handed out before and dropped since by everything it was
        #: handed to (no allocation, nor the page faults of new memory, per read)
        self.buffers = BufferPool()
        #: with ``hold``: each tensor's quantized blocks copied into memory at load, read from there (no disk reads);
        #: page-locked on a GPU run, whose copies of them to the device (:meth:`packed`) then run asynchronously
        self.hold = hold
        self._held: dict[str, list[torch.Tensor]] = {}  # the blocks of each of a tensor's parts (one but a merged one)
        self._sources: dict[tuple, list[torch.Tensor]] = {}  # the held blocks by where they lie in the file
        self._packed: dict[str, DeviceBlocks | ExpertBlocks | None] = {}
        #: a device pass's elements: the largest tensor's where smaller than a pass (the plan's scratch is as large)
        largest = max((math.prod(checkpoint.shape(key)) for key in context.names if key in checkpoint), default=0)
        self.pass_elements = pass_elements(largest)
        accelerator = devices.active()
        pinned = hold and context.pin_memory and accelerator.available()
        size = sum(checkpoint.stored_nbytes(key) for key in context.names if key in checkpoint) if pinned else 0
        self.arena = devices.PinnedArena(accelerator, size) if pinned else None

    def add_from_checkpoint(self, name: str, checkpoint: Checkpoint, key: str, dtype: torch.dtype | None) -> None:
        self._refs[name] = key  # only the header is consulted: the blocks are read as the model runs
        if self.hold:  # the quantized bytes copied into memory once a source (a packed weight's two parts share
            source = self.checkpoint.byte_ranges(key)  # its blocks): read from there from now on
            held = self._sources.get(source)
            if held is None:
                held = [self._keep(raw) for raw in self.checkpoint.blocks(key)]
                self._sources[source] = held
            self._held[name] = held

    def _keep(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.clone() if self.arena is None else self.arena.take(tuple(raw.shape), raw.dtype).copy_(raw)

    def _raw(self, name: str) -> torch.Tensor | None:
        """``name``'s held blocks where it is one GGUF tensor (None where not held)."""
        held = self._held.get(name)
        return None if held is None else held[0]

    def put(self, name: str, tensor: torch.Tensor, owned: bool = False) -> None:
        raise StorageError(
            f"storage=gguf cannot hold {name!r}: it only reads the GGUF file's own tensors; "
            "use storage=memmap or pinned_cpu for tensors that are not in the file"
        )

    def spec(self, name: str) -> tuple[torch.Size, torch.dtype]:
        """Shape and dtype of ``store[name]`` (from the header: nothing is read; a packed tensor keeps its integer
        dtype)."""
        key = self._refs[name]
        stored = self.checkpoint.dtype(key)
        return torch.Size(self.checkpoint.shape(key)), self.dtype if stored.is_floating_point else stored

    def __getitem__(self, name: str) -> torch.Tensor:
        shape, dtype = self.spec(name)
        out = self.buffers.take(shape.numel(), dtype).view(shape)
        self.read_into(name, out)
        return out

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Dequantize ``name`` into ``out`` (the caller's buffer, its shape and the run's dtype)."""
        with torch.inference_mode(False):
            self.checkpoint.read_into(self._refs[name], out, self._held.get(name))

    def packed(self, name: str) -> DeviceBlocks | ExpertBlocks | None:
        """``name``'s quantized blocks, for a GPU run to dequantize on the device, where that gives what
        :meth:`read_into` gives: a type with a torch kernel, a tensor transformers' processor leaves
        as it is or un-permutes (llama's q and k), or a fused expert tensor it merges from parts (decoded expert by
        expert, :meth:`packed_experts`); None for the others (dequantized on the host). Worked out once a tensor."""
        if name not in self._packed:
            self._packed[name] = self._device_blocks(name)
        return self._packed[name]

    def _device_blocks(self, name: str) -> DeviceBlocks | ExpertBlocks | None:
        key = self._refs[name]
        if key in self.checkpoint.merged:  # decoded expert by expert, each one's parts in turn
            return self.packed_experts(name)
        form = device_form(self.checkpoint, key, self.dtype, self.pass_elements)
        if form is None:
            return None
        raw = self._raw(name)
        raw = self.checkpoint.raw(key) if raw is None else raw
        return DeviceBlocks(raw, *form, dtype=self.dtype, elements=self.pass_elements)

    def packed_experts(self, name: str) -> ExpertBlocks | None:
        """A fused expert tensor's quantized blocks, for a GPU run to dequantize routed experts (or the whole tensor) on
        the device, where that gives what :meth:`read_expert` gives; None for the others."""
        key = self._refs[name]
        form = experts_form(self.checkpoint, key, self.dtype, self.pass_elements)
        if form is None:
            return None
        held = self._held.get(name) or self.checkpoint.blocks(key)
        parts = [(raw, kind, rows) for raw, (kind, rows, _) in zip(held, form, strict=True)]
        experts = self.checkpoint.shape(key)[0]
        return ExpertBlocks(parts, experts, form[0][2], dtype=self.dtype, elements=self.pass_elements)

    def held_nbytes(self) -> int:
        """Bytes of quantized blocks held in memory (0 unless ``hold``)."""
        return sum(raw.numel() for held in self._sources.values() for raw in held)

    def moved_nbytes(self, name: str) -> int:
        """A read of ``name`` moves its quantized blocks (what lies in the file), not the dequantized tensor."""
        return int(self.checkpoint.stored_nbytes(self._refs[name]))

    def offset(self, name: str) -> int:
        return 0  # every read is a buffer of its own (aligned), as transformers' load dequantizes into new memory

    def warm(self, name: str) -> bool:
        if name in self._held:
            return False
        for raw in self.checkpoint.blocks(self._refs[name]):  # start reading them; the caller dequantizes ahead
            will_need(raw)
        return False

    def read_expert(self, name: str, expert: int, out: torch.Tensor) -> None:
        """Dequantize one expert of a fused expert tensor from that expert's blocks alone (where the checkpoint can:
        a tensor as it lies in the file, or a merged one), else from the whole tensor's."""
        key = self._refs[name]
        if not self.checkpoint.reads_experts(key):
            out.copy_(self[name][expert])
            return
        with torch.inference_mode(False):
            self.checkpoint.read_expert_into(key, expert, out, self._held.get(name))

    def advise_expert(self, name: str, expert: int) -> None:
        if name in self._held:
            return
        key = self._refs[name]
        blocks = self.checkpoint.expert_blocks(key, expert) if self.checkpoint.reads_experts(key) else None
        for raw in blocks or self.checkpoint.blocks(key):
            will_need(raw)

    def drop(self, name: str) -> bool:
        return bool(self.drop_all([name]))

    def drop_all(self, names: Sequence[str]) -> list[str]:
        def spans(key: str) -> list:  # held in memory: nothing of the file to drop
            ranges = self.checkpoint.byte_ranges(key)
            return [span_of(raw, path, at) for raw, (path, at, _) in zip(self.checkpoint.blocks(key), ranges)]

        return drop_named({name: spans(self._refs[name]) for name in names if name not in self._held})

    def file_ranges(self, name: str, start: int, end: int) -> list[tuple[Path, int, int]]:
        return []  # handed out as a copy: nothing of it is computed on where it lies

    def close(self) -> None:
        self._held.clear()
        self._sources.clear()
        self._packed.clear()
        if self.arena is not None:
            self.arena.close()

    def __iter__(self) -> Iterator[str]:
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)
