"""Quantized compute for GGUF linear layers (``storage.compute=quantized``): Q4_0, Q4_1 and Q4_K blocks repacked, no
float pass, into PyTorch's int4 weight-only layout (group 32, bfloat16 scales and zeros), Q8_0 requantized per output
channel into its int8 one, and :class:`QuantLinear`, which multiplies by them with PyTorch's own packed kernels."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from offload_core.storage.gguf.dequant import _halves, _k_factors, _nibbles, block_shape, dequantize_into

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
    if QUANT_KINDS[int(kind)] == 4 and shape[0] % 16:
        return f"the int4 kernel takes output rows in multiples of 16, not {shape[0]}"
    return None


def _elements(raw: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The 4-bit values ``(out, in)`` uint8 0..15 of a Q4_0 / Q4_1 / Q4_K tensor, in element order."""
    per, nbytes = block_shape(spec.kind)
    blocks = raw.reshape(-1, nbytes)
    count = blocks.shape[0]
    if spec.kind == 12:  # four chunks of 32 bytes: low nibbles then high nibbles of 64 elements
        out = torch.empty((count, 4, 2, 32), dtype=torch.uint8)
        _nibbles(blocks[:, 16:].reshape(count, 4, 32), out)
    else:
        out = torch.empty((count, 2, 16), dtype=torch.uint8)
        _nibbles(blocks[:, 4 if spec.kind == 3 else 2 :], out)
    return out.view(spec.out_features, spec.in_features)


def _rows(raw: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``raw`` as ``(out, bytes per row)`` in the row order the model computes with."""
    rows = raw.reshape(spec.out_features, -1)
    return rows if spec.rows is None else rows[list(spec.rows)]


def _int4_weight(q: torch.Tensor, out: torch.Tensor) -> None:
    """PyTorch's CPU int4 layout of ``q`` (``(n, k)`` values 0..15) into ``out`` (``(n, k/2)`` uint8): per 64 rows,
    element k of rows j and j + 32 share a byte (low, high), bytes ordered by k then j (what
    ``torch._convert_weight_to_int4pack_for_cpu`` writes, here without its int32 copy)."""
    n, k = q.shape
    if n % 64:
        out.copy_(torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
        return
    halves = q.view(n // 64, 2, 32, k)
    target = out.view(n // 64, k, 32).transpose(1, 2)
    torch.bitwise_left_shift(halves[:, 1], 4, out=target)
    target.bitwise_or_(halves[:, 0])


def _int4_scales(blocks: torch.Tensor, spec: QuantSpec, out: torch.Tensor) -> None:
    """Scales and zeros ``(in/32, out, 2)`` with which the kernel's ``(q - 8) * scale + zero`` is the GGUF value:
    Q4_0 ``d * (q - 8)`` exactly; Q4_1 ``d * q + m`` with zero ``m + 8d`` (rounded once more than gguf-py's); Q4_K
    ``(d * sc) * q - dmin * m`` per sub-block with zero ``8 (d * sc) - dmin * m``."""
    n, groups = spec.out_features, spec.in_features // GROUP
    if spec.kind == 12:
        scale, low = _k_factors(blocks)
        zero = scale * 8 - low
    else:
        scale = _halves(blocks, 0)
        zero = _halves(blocks, 2) + scale * 8 if spec.kind == 3 else torch.zeros_like(scale)
    out[..., 0].copy_(scale.reshape(n, groups).t())
    out[..., 1].copy_(zero.reshape(n, groups).t())


#: rows of a Q8_0 weight requantized at once (its float32 values taken a slice at a time: an embedding-sized head
#: would otherwise take several float32 copies of itself while it loads)
_INT8_ROWS = 2048


def _int8(rows: torch.Tensor, spec: QuantSpec, part: str, out: torch.Tensor) -> None:
    """Q8_0 (``d * q`` per block of 32) requantized to one scale per output row into ``out`` (``part``): the row's
    largest magnitude over 127 (rounded to bfloat16), each value rounded to the nearest step (at most half a step
    off), :data:`_INT8_ROWS` rows at a time."""
    k = spec.in_features
    for start in range(0, spec.out_features, _INT8_ROWS):
        chunk = rows[start : start + _INT8_ROWS]
        values = dequantize_into(chunk, spec.kind, torch.empty(chunk.shape[0] * k)).view(-1, k)
        scale = (values.abs().amax(dim=1) / 127).to(torch.bfloat16)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        if part == "qscale":
            out[start : start + _INT8_ROWS].copy_(scale.view(torch.int16))
            continue
        values.div_(scale.float()[:, None]).round_().clamp_(-127, 127)
        out[start : start + _INT8_ROWS].copy_(values)


def pack_into(raw: torch.Tensor, spec: QuantSpec, part: str, out: torch.Tensor) -> torch.Tensor:
    """Packed tensor ``part`` (``qweight`` or ``qscale``) of the weight whose GGUF blocks are ``raw`` into ``out``
    (:meth:`QuantSpec.part_spec`'s shape; scales in any float dtype). Returns ``out``."""
    with torch.inference_mode(False):
        rows = _rows(raw, spec)
        if spec.bits == 8:
            _int8(rows, spec, part, out)
            return out
        if part == "qweight":
            _int4_weight(_elements(rows, spec), out)
            return out
        held = torch.empty(out.shape, dtype=torch.float32)
        _int4_scales(rows.reshape(-1, block_shape(spec.kind)[1]), spec, held)
        return out.copy_(held.to(torch.bfloat16).view(torch.int16))


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
            n, k = self.out_features, self.in_features
            q = torch.empty((n, k), dtype=torch.uint8, device=weight.device)
            if n % 64:
                raise RuntimeError("the CUDA int4 path takes out_features in multiples of 64")
            halves = q.view(n // 64, 2, 32, k)
            packed = weight.view(n // 64, k, 32).transpose(1, 2)
            torch.bitwise_and(packed, 0x0F, out=halves[:, 0])
            torch.bitwise_right_shift(packed, 4, out=halves[:, 1])
            pairs = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()
            tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
            self._device_weight = (key, torch._convert_weight_to_int4pack(pairs, tiles))
        return self._device_weight[1]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits} packed"
