"""A GGUF tensor decoded on the execution device: a GPU run copies its quantized blocks as the file holds them (an
eighth to a quarter of float32's bytes for the 4- and 8-bit types) and dequantizes them there with the same kernels,
bit for bit, a pass of at most :data:`DEVICE_PASS` elements at a time through fixed scratch (then rounded to a bf16
or fp16 run's dtype there, as transformers' load rounds the float32 values)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from offload_core.storage.gguf.dequant import block_shape, buffers_in, dequantize_into, has_kernel

#: the most elements one pass dequantizes on the device (a model whose largest offloaded tensor is smaller passes that
#: many): bounds the scratch (:func:`scratch_bytes`: 68 MiB at most) while keeping the kernel launches few (each pass
#: launches ten or so: a 4096 x 4096 tensor takes four passes)
DEVICE_PASS = 2**22
#: the kernels' own buffers and temporaries, in bytes per element of a pass, every type's held at once: 7.95 (Q6_K
#: run after the others) on the fake accelerator, which counts every device allocation, and one more for what a
#: change of kernel may add (tests/storage/test_gguf_device.py holds the kernels to it)
KERNEL_BYTES = 9


def pass_elements(largest: int | None) -> int:
    """Elements a pass takes where the largest offloaded tensor has ``largest`` (None: not known)."""
    return DEVICE_PASS if largest is None else max(min(DEVICE_PASS, largest), 1)


def scratch_bytes(largest: int | None = None) -> int:
    """Device bytes of a :class:`DeviceScratch` once every type has run (passes of :func:`pass_elements`): a pass's
    blocks (float32's 4 bytes an element the widest), its values to un-permute or round (4), the kernels' buffers."""
    return pass_elements(largest) * (4 + 4 + KERNEL_BYTES)


class DeviceScratch:
    """Fixed buffers on one device that every GGUF tensor of a run decodes through, a pass of ``elements`` at most."""

    def __init__(self, device: torch.device, elements: int) -> None:
        self.elements = elements
        with torch.inference_mode(False):  # written in place by every pass: never inference tensors
            self.raw = torch.empty(elements * 4, dtype=torch.uint8, device=device)
            self.values = torch.empty(elements, dtype=torch.float32, device=device)
        self.kernels: dict = {}  # the dequantization kernels' buffers on this device

    @property
    def nbytes(self) -> int:
        held = sum(b.numel() * b.element_size() for b in self.kernels.values())
        return self.raw.numel() + 4 * self.values.numel() + held

    def blocks(self, part: torch.Tensor) -> torch.Tensor:
        """``part`` (host blocks, ``(n, block bytes)`` uint8) copied into the scratch (queued on the current stream)."""
        out = self.raw[: part.numel()].view(part.shape)
        out.copy_(part, non_blocking=True)
        return out


def decodes_on_device(kind: int, shape: tuple[int, ...], heads: int | None, elements: int) -> bool:
    """Whether a tensor of GGML type ``kind`` and ``shape`` (un-permuted by ``heads`` where llama's processor does)
    can be dequantized on a device in passes of ``elements``: a type with a torch kernel, whole blocks per row where
    rows move (two rows a pass at least)."""
    if not has_kernel(kind) or block_shape(kind)[0] > elements:
        return False
    if heads is None:
        return True
    per_block, _ = block_shape(kind)
    rows = shape[0] if shape else 0
    return len(shape) == 2 and rows % (2 * heads) == 0 and shape[1] % per_block == 0 and 2 * shape[1] <= elements


def device_form(checkpoint: Any, key: str, dtype: torch.dtype, elements: int) -> tuple[int, tuple, int | None] | None:
    """``(GGML type, shape, heads)`` of GGUF tensor ``key`` where a run in ``dtype`` can dequantize it on a device in
    passes of ``elements`` and get what the checkpoint's ``read_into`` gives (blocks dequantized as they lie, or
    llama's q and k un-permuted); None for the others (a tensor packed for a quantized kernel, another processor's,
    a type without a torch kernel)."""
    if not dtype.is_floating_point or checkpoint.computes_quantized(key):
        return None
    in_place = checkpoint.converted_in_place(key)
    heads = None if in_place else checkpoint.permuted_heads(key)
    if heads is None and not in_place:
        return None
    kind, shape = checkpoint.ggml_type(key), tuple(checkpoint.shape(key))
    return (kind, shape, heads) if decodes_on_device(kind, shape, heads, elements) else None


@dataclass
class DeviceBlocks:
    """A GGUF tensor's quantized blocks in host memory (the mapped file, or held), to decode on a device."""

    raw: torch.Tensor  # uint8, the tensor's blocks
    ggml: int  # the GGML type
    shape: tuple[int, ...]  # the tensor's shape, as the model takes it
    heads: int | None  # llama's q and k: un-permuted by this many heads, as transformers' processor does
    dtype: torch.dtype = torch.float32  # the run's: another is the float32 values rounded, as transformers' load does
    elements: int = DEVICE_PASS  # a pass's (the store's: the same for all its tensors, which share one scratch)
    kind: ClassVar[str] = "gguf"

    def new_scratch(self, device: torch.device) -> DeviceScratch:
        return DeviceScratch(device, self.elements)

    def decode_on_device(self, out: torch.Tensor, scratch: DeviceScratch, name: str) -> None:
        values = out.view(self.dtype).view(-1)
        elements, nbytes = block_shape(self.ggml)
        blocks = self.raw.reshape(-1, nbytes)
        with torch.inference_mode(False), buffers_in(scratch.kernels):
            if self.heads is None:
                step = max(self.elements // elements, 1)
                for start in range(0, blocks.shape[0], step):
                    part = blocks[start : start + step]
                    target = values[start * elements : (start + part.shape[0]) * elements]
                    if self.dtype == torch.float32:
                        dequantize_into(scratch.blocks(part), self.ggml, target)
                    else:  # dequantized into the scratch, then rounded into place
                        target.copy_(self._values(scratch.blocks(part), target.numel(), scratch))
                return
            self._unpermuted(values, blocks, elements, scratch)

    def _values(self, part: torch.Tensor, count: int, scratch: DeviceScratch) -> torch.Tensor:
        """``part``'s ``count`` values dequantized into the scratch (float32)."""
        return dequantize_into(part, self.ggml, scratch.values[:count])

    def _unpermuted(self, values: torch.Tensor, blocks: torch.Tensor, elements: int, scratch: DeviceScratch) -> None:
        """Llama's q or k: each pass whole heads' rows (or an even run of one head's), dequantized into the scratch
        and moved to where transformers' processor puts them (``out[h, j, i] = source[h, 2 i + j]``)."""
        rows, cols = self.shape
        heads = int(self.heads)
        per_head, per_row = rows // heads, cols // elements
        step = max(self.elements // cols // 2 * 2, 2)  # rows a pass holds
        out = values.view(heads, 2, per_head // 2, cols)
        if step >= per_head:  # whole heads a pass
            group = step // per_head
            for head in range(0, heads, group):
                last = min(head + group, heads)
                chunk = self._pass(blocks, head * per_head, (last - head) * per_head, per_row, cols, scratch)
                out[head:last].copy_(chunk.view(last - head, per_head // 2, 2, cols).transpose(1, 2))
            return
        for head in range(heads):  # a head's rows in even runs
            for first in range(0, per_head, step):
                last = min(first + step, per_head)
                chunk = self._pass(blocks, head * per_head + first, last - first, per_row, cols, scratch)
                out[head, :, first // 2 : last // 2].copy_(chunk.view((last - first) // 2, 2, cols).transpose(0, 1))

    def _pass(
        self, blocks: torch.Tensor, row: int, count: int, per_row: int, cols: int, scratch: DeviceScratch
    ) -> torch.Tensor:
        """Rows ``row`` to ``row + count`` dequantized into the scratch's values."""
        return self._values(scratch.blocks(blocks[row * per_row : (row + count) * per_row]), count * cols, scratch)


def experts_form(checkpoint: Any, key: str, dtype: torch.dtype, elements: int) -> list[tuple[int, int, int]] | None:
    """``[(GGML type, rows, columns)]`` per GGUF part of a fused expert tensor ``key`` whose experts a run in
    ``dtype`` can dequantize on a device one at a time, in passes of ``elements``, and get what the checkpoint's
    ``read_expert_into`` gives (each part's expert rows one after another); None for the others."""
    if not dtype.is_floating_point or checkpoint.computes_quantized(key) or not checkpoint.reads_experts(key):
        return None
    form = []
    for kind, rows, cols in checkpoint.expert_parts(key):
        if not decodes_on_device(kind, (rows, cols), None, elements) or cols % block_shape(kind)[0] or cols > elements:
            return None
        form.append((kind, rows, cols))
    return form


@dataclass
class ExpertBlocks:
    """A fused expert tensor's quantized blocks (experts first) in one GGUF part, or in two whose rows each expert
    concatenates (gate and up, as transformers' MoE processor merges them), decoded on a device whole (a block read
    whole) or one expert at a time (:meth:`decode_expert`: a routed expert's rows)."""

    parts: list[tuple[torch.Tensor, int, int]]  # each part's blocks (uint8, experts first), GGML type, rows an expert
    experts: int
    cols: int
    dtype: torch.dtype = torch.float32
    elements: int = DEVICE_PASS
    kind: ClassVar[str] = "gguf"

    def new_scratch(self, device: torch.device, elements: int | None = None) -> DeviceScratch:
        """Scratch on ``device`` for passes of ``elements`` (default: the store's pass; an expert's rows of a part at
        the least where smaller: the passes take what the scratch holds)."""
        return DeviceScratch(device, elements or self.elements)

    def expert_nbytes(self) -> int:
        """The quantized bytes of one expert (what crossing to the device moves for it)."""
        return sum(raw.numel() for raw, _, _ in self.parts) // self.experts

    def decode_on_device(self, out: torch.Tensor, scratch: DeviceScratch, name: str) -> None:
        self._decode(out.view(self.dtype).view(self.experts, -1, self.cols), 0, self.experts, scratch)

    def decode_expert(self, expert: int, out: torch.Tensor, scratch: DeviceScratch) -> None:
        """Expert ``expert``'s rows into ``out`` (its rows of every part, on the scratch's device), queued on the
        current stream."""
        self._decode(out.view(1, -1, self.cols), expert, expert + 1, scratch)

    def _decode(self, values: torch.Tensor, first: int, end: int, scratch: DeviceScratch) -> None:
        """Experts ``first`` to ``end`` into ``values`` (``(end - first, rows of all parts, cols)``): each pass
        dequantizes whole experts' rows of a part into the scratch (or a run of one expert's rows, for an expert
        larger than a pass), then moves them into place, rounded to the run's dtype."""
        start, elements = 0, scratch.elements
        with torch.inference_mode(False), buffers_in(scratch.kernels):
            for raw, ggml, rows in self.parts:
                per_block, nbytes = block_shape(ggml)
                blocks = raw.reshape(self.experts, -1, nbytes)
                size = rows * self.cols
                if size <= elements:
                    group = elements // size
                    for at in range(first, end, group):
                        last = min(at + group, end)
                        chunk = self._pass(blocks[at:last].reshape(-1, nbytes), (last - at) * size, ggml, scratch)
                        values[at - first : last - first, start : start + rows].copy_(chunk.view(-1, rows, self.cols))
                else:
                    step, per_row = max(elements // self.cols, 1), self.cols // per_block
                    for expert in range(first, end):
                        for row in range(0, rows, step):
                            count = min(step, rows - row)
                            part = blocks[expert, row * per_row : (row + count) * per_row]
                            chunk = self._pass(part, count * self.cols, ggml, scratch)
                            values[expert - first, start + row : start + row + count].copy_(chunk.view(count, -1))
                start += rows

    @staticmethod
    def _pass(blocks: torch.Tensor, count: int, ggml: int, scratch: DeviceScratch) -> torch.Tensor:
        return dequantize_into(scratch.blocks(blocks), ggml, scratch.values[:count])
