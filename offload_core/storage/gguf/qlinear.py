"""Quantized compute for GGUF linear layers (``storage.compute=quantized``): Q4_0, Q4_1 and Q4_K blocks repacked, no
float pass, into PyTorch's int4 weight-only layout (group 32, bfloat16 scales and zeros), Q8_0 requantized per output
channel into its int8 one, and :class:`QuantLinear`, which multiplies by them with PyTorch's own packed kernels."""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from torch import nn

from offload_core.storage.gguf.dequant import GRAIN, _halves, _k_factors, block_shape, dequantize_into, one_thread

__all__ = ["QUANT_KINDS", "QuantLinear", "QuantSpec", "leave_exact_reason", "pack_into"]

#: GGML types computed quantized -> the kernel's weight bits (Q4_0, Q4_1, Q8_0, Q4_K)
QUANT_KINDS = {2: 4, 3: 4, 8: 8, 12: 4}
#: elements sharing one scale and zero in the int4 kernels (a GGUF block of 32, or a Q4_K sub-block)
GROUP = 32
#: the packed tensors of one linear layer, by the name they take in place of ``weight``
PARTS = ("qweight", "qscale")


@dataclass(frozen=True)
class QuantSpec:
    """One linear weight computed quantized: its GGML type, ``(out, in)`` features and the row order transformers'
    tensor processor gives the rows (None: as they lie in the file)."""

    kind: int
    out_features: int
    in_features: int
    rows: tuple[int, ...] | None = None

    @property
    def bits(self) -> int:
        return QUANT_KINDS[self.kind]

    def part_spec(self, part: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of packed tensor ``part``: the scales (and zeros) are bfloat16 bits held as int16, so that
        loading, which casts floating tensors to the run's dtype, leaves them as the kernels take them."""
        n, k = self.out_features, self.in_features
        if part == "qweight":
            return ((n, k // 2), torch.uint8) if self.bits == 4 else ((n, k), torch.int8)
        return ((k // GROUP, n, 2), torch.int16) if self.bits == 4 else ((n,), torch.int16)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed tensors (what the layer holds, what an offloaded one brings in)."""
        total = 0
        for part in PARTS:
            shape, kind = self.part_spec(part)
            total += math.prod(shape) * kind.itemsize
        return total


def leave_exact_reason(kind: int, shape: tuple[int, ...]) -> str | None:
    """Why a linear weight of GGML type ``kind`` and ``shape`` keeps the exact (dequantized) path; None if it can be
    computed quantized."""

    if int(kind) not in QUANT_KINDS:
        return "no packed kernel takes its type"
    if len(shape) != 2 or shape[1] % GROUP:
        return f"shape {list(shape)} is not whole groups of {GROUP} along its input"
    if QUANT_KINDS[int(kind)] == 4 and shape[0] % 64:
        return f"the int4 layout takes output rows in multiples of 64, not {shape[0]}"
    return None


#: elements of a weight packed in one pass: the pass's temporaries (1.5 bytes an element for the int4 layout, 12 for
#: Q8_0's float32 values, a quarter as many of those) stay a few MiB beside the packed tensor's own buffer, whatever
#: the weight's size (packed whole, the whole weight's came on top of what the plan holds: the 1B preset's Q4_0 run
#: at 800 MB peaked 42 MB over its budget)
PASS_ELEMENTS = 2**20


def _passes(spec: QuantSpec) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` output rows of each pass: whole groups of 64 rows (the int4 layout's unit) of about
    :data:`PASS_ELEMENTS` elements (a quarter of that for Q8_0's float32 values)."""
    elements = PASS_ELEMENTS // 4 if spec.bits == 8 else PASS_ELEMENTS
    step = max(elements // spec.in_features // 64, 1) * 64
    for start in range(0, spec.out_features, step):
        yield start, min(start + step, spec.out_features)


def _rows(raw: torch.Tensor, spec: QuantSpec, start: int, stop: int) -> torch.Tensor:
    """Output rows ``start:stop`` of ``raw`` as ``(rows, bytes per row)``, in the row order the model computes with
    (those rows alone reordered by one numpy take: torch's ``index_select`` wakes its thread pool)."""
    rows = raw.reshape(spec.out_features, -1)
    if spec.rows is None:
        return rows[start:stop]
    return torch.from_numpy(np.take(rows.numpy(), np.asarray(spec.rows[start:stop]), axis=0))


#: a block's 4-bit values: (byte offset, runs, bytes a run) -- a run's low nibbles are its elements, then its high
_NIBBLES = {2: (2, 1, 16), 3: (4, 1, 16), 12: (16, 4, 32)}


def _int4_weight(rows: torch.Tensor, spec: QuantSpec, out: torch.Tensor) -> None:
    """PyTorch's CPU int4 layout of ``rows`` (whole groups of 64 of the weight's rows) into ``out`` (their ``(n, k/2)``
    uint8): per 64 rows, element k of rows j and j + 32 share a byte (low, high), bytes ordered by k then j (what
    ``torch._convert_weight_to_int4pack_for_cpu`` writes, here without its int32 copy). In numpy, on one thread (torch
    would wake its thread pool for each op, which a loaded machine makes many times slower; a reader thread packs
    beside the compute)."""
    n, k = rows.shape[0], spec.in_features
    at, runs, width = _NIBBLES[spec.kind]
    blocks = rows.numpy().reshape(n, -1, block_shape(spec.kind)[1])
    packed = blocks[:, :, at:].reshape(n, -1, runs, width)
    values = np.empty((n, packed.shape[1], runs, 2, width), dtype=np.uint8)
    np.bitwise_and(packed, 15, out=values[:, :, :, 0])
    np.right_shift(packed, 4, out=values[:, :, :, 1])
    pairs = values.reshape(n // 64, 2, 32, k)
    both = np.left_shift(pairs[:, 1], 4)
    both |= pairs[:, 0]
    out.numpy().reshape(n // 64, k, 32)[:] = both.transpose(0, 2, 1)


def _int4_scales(blocks: torch.Tensor, kind: int, out: torch.Tensor) -> None:
    """Scales and zeros (``out``: ``(in/32, rows, 2)`` float32) of the rows whose blocks are ``blocks``, with which
    the kernel's ``(q - 8) * scale + zero`` is the GGUF value: Q4_0 ``d * (q - 8)`` exactly; Q4_1 ``d * q + m`` with
    zero ``m + 8d`` (rounded once more than gguf-py's); Q4_K ``(d * sc) * q - dmin * m`` per sub-block with zero
    ``8 (d * sc) - dmin * m``."""
    groups, n = out.shape[0], out.shape[1]
    if kind == 12:
        scale, low = _k_factors(blocks)
        zero = scale * 8 - low
    else:
        scale = _halves(blocks, 0)
        zero = _halves(blocks, 2) + scale * 8 if kind == 3 else torch.zeros_like(scale)
    out[..., 0].copy_(scale.reshape(n, groups).t())
    out[..., 1].copy_(zero.reshape(n, groups).t())


def _int4_scale_rows(rows: torch.Tensor, spec: QuantSpec, out: torch.Tensor) -> None:
    """:func:`_int4_scales` of ``rows`` into ``out`` (their ``(in/32, rows, 2)`` int16: bfloat16 bits), a few hundred
    rows at a time."""
    groups = spec.in_features // GROUP
    step = max(GRAIN // (8 * groups), 1)
    for start in range(0, rows.shape[0], step):
        part = rows[start : start + step]
        held = torch.empty((groups, part.shape[0], 2), dtype=torch.float32)
        _int4_scales(part.reshape(-1, block_shape(spec.kind)[1]), spec.kind, held)
        out[:, start : start + part.shape[0]].copy_(held.to(torch.bfloat16).view(torch.int16))


def _int8(rows: torch.Tensor, spec: QuantSpec, part: str, out: torch.Tensor) -> None:
    """Q8_0 (``d * q`` per block of 32) of ``rows`` requantized to one scale per output row into ``out`` (``part`` of
    those rows): the row's largest magnitude over 127 (rounded to bfloat16), each value rounded to the nearest step
    (at most half a step off); in numpy, on one thread (as :func:`_int4_weight`)."""
    k = spec.in_features
    values = dequantize_into(rows, spec.kind, torch.empty(rows.shape[0] * k)).numpy().reshape(-1, k)
    scale = torch.from_numpy(np.abs(values).max(axis=1) / np.float32(127)).to(torch.bfloat16)
    scale[scale == 0] = 1
    if part == "qscale":
        out.copy_(scale.view(torch.int16))
        return
    steps = values / scale.float().numpy()[:, None]
    np.rint(steps, out=steps)
    np.clip(steps, -127, 127, out=steps)
    out.numpy()[:] = steps


def pack_into(raw: torch.Tensor, spec: QuantSpec, part: str, out: torch.Tensor) -> torch.Tensor:
    """Packed tensor ``part`` (``qweight`` or ``qscale``) of the weight whose GGUF blocks are ``raw`` into ``out``
    (:meth:`QuantSpec.part_spec`'s shape and dtype), a pass of rows at a time (:func:`_passes`). Returns ``out``."""
    with torch.inference_mode(False):
        for start, stop in _passes(spec):
            rows = _rows(raw, spec, start, stop)
            if spec.bits == 8:
                _int8(rows, spec, part, out[start:stop])
            elif part == "qweight":
                _int4_weight(rows, spec, out[start:stop])
            else:
                _int4_scale_rows(rows, spec, out[:, start:stop])
        return out


def device_pairs(qweight: torch.Tensor) -> torch.Tensor:
    """The CPU int4 layout ``qweight`` (``(n, k/2)`` uint8, :func:`_int4_weight`) as the CUDA packing takes it: byte
    ``i`` of row ``r`` holds values ``2i`` (high nibble) and ``2i + 1`` (low), on ``qweight``'s device."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    values = torch.empty((n, k), dtype=torch.uint8, device=qweight.device)
    halves = values.view(n // 64, 2, 32, k)
    packed = qweight.view(n // 64, k, 32).transpose(1, 2)
    torch.bitwise_and(packed, 0x0F, out=halves[:, 0])
    torch.bitwise_right_shift(packed, 4, out=halves[:, 1])
    return (values[:, ::2] << 4 | values[:, 1::2]).contiguous()


#: multiply-adds up to which a CPU kernel runs on the calling thread (a decoding step's product): the packed kernels
#: split every call over torch's thread pool, whose wake-ups a loaded machine made a thousand times slower than the
#: product itself (0.02 ms on one thread, 32 ms at the 90th percentile on two, on a shared 2-core machine)
INLINE_MACS = 2**24


def _inline(device: torch.device, macs: int) -> AbstractContextManager[None]:
    """One torch thread inside the block for a small product on the CPU (:func:`one_thread`); a large one as it was."""
    return one_thread(device) if macs <= INLINE_MACS else nullcontext()


class QuantLinear(nn.Module):
    """A linear layer computing on packed weights: ``qweight`` and ``qscale`` (:meth:`QuantSpec.part_spec`) in
    place of ``weight``, through ``torch._weight_int4pack_mm_for_cpu`` / ``torch._weight_int8pack_mm`` on the CPU
    and ``torch._weight_int4pack_mm`` (the weight repacked for it on the device) on a CUDA GPU. The kernels take
    bfloat16 activations (on the CPU their float32 paths are unvectorized, ten to twenty times slower): the input is
    rounded to bfloat16 and the output cast back to the input's dtype."""

    def __init__(self, spec: QuantSpec, bias: bool, dtype: torch.dtype, device: torch.device | str = "meta") -> None:
        super().__init__()
        self.in_features, self.out_features, self.bits = spec.in_features, spec.out_features, spec.bits
        for part in PARTS:
            shape, kind = spec.part_spec(part)
            self.register_parameter(part, nn.Parameter(torch.empty(shape, dtype=kind, device=device), False))
        self.bias = nn.Parameter(torch.empty(spec.out_features, dtype=dtype, device=device), False) if bias else None
        self._device_weight: tuple[tuple[int, int, int], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        scales = self.qscale.view(torch.bfloat16)
        with _inline(flat.device, flat.shape[0] * self.in_features * self.out_features):
            if self.bits == 8:
                y = torch._weight_int8pack_mm(flat, self.qweight, scales)
            elif flat.device.type == "cpu":
                y = torch._weight_int4pack_mm_for_cpu(flat, self.qweight, GROUP, scales)
            else:
                y = torch._weight_int4pack_mm(flat, self._device_packed(), GROUP, scales)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _device_packed(self) -> torch.Tensor:
        """``qweight`` in the CUDA kernel's tiled layout (``torch._convert_weight_to_int4pack``), rebuilt only when
        the tensor it is made from changed (a resident weight is repacked once, an offloaded one on every read)."""
        weight = self.qweight
        key = (weight.data_ptr(), weight._version, id(weight))
        if self._device_weight is None or self._device_weight[0] != key:
            tiles = next(t for t in (8, 4, 2) if self.in_features % (t * 16) == 0)
            self._device_weight = (key, torch._convert_weight_to_int4pack(device_pairs(weight), tiles))
        return self._device_weight[1]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits} packed"
