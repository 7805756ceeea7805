"""GGUF block dequantization in vectorized torch, bit for bit gguf-py's ``gguf.quants.dequantize`` (the same float32
products and sums, in the same order), writing into a buffer the caller holds; other types go through gguf-py's numpy
dequantizer, and a type gguf-py cannot dequantize is refused in one line."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from offload_core.errors import CheckpointError

__all__ = [
    "UnsupportedTensorType",
    "block_shape",
    "copy_inline",
    "dequantize_into",
    "fast_types",
    "supported",
    "type_name",
]


class UnsupportedTensorType(CheckpointError):
    """A GGUF tensor type that neither these kernels nor gguf-py can dequantize."""


def _quant_sizes() -> dict[int, tuple[int, int]]:
    from gguf import GGML_QUANT_SIZES

    return {int(kind): sizes for kind, sizes in GGML_QUANT_SIZES.items()}


def type_name(kind: int) -> str:
    """The GGML name of tensor type ``kind`` (``Q4_K``), or ``type <n>`` for a number gguf-py does not know."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(kind).name
    except ValueError:
        return f"type {kind}"


def block_shape(kind: int) -> tuple[int, int]:
    """``(elements, bytes)`` of one block of tensor type ``kind`` (1 element for the plain types)."""
    sizes = _quant_sizes().get(int(kind))
    if sizes is None:
        raise UnsupportedTensorType(
            f"GGUF tensor type {type_name(kind)} is unknown to gguf-py; convert the file with a llama.cpp that "
            "writes a type gguf-py reads, or upgrade gguf (pip install -U gguf)"
        )
    return sizes


def _halves(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte ``start`` of every block, as float32 (``(n, 1)``; float16 to float32 is exact)."""
    return blocks[:, start : start + 2].view(torch.float16).float()


def _nibbles(packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Low then high nibbles of ``packed`` (``(..., k)`` bytes) into ``out`` (``(..., 2, k)`` uint8)."""
    torch.bitwise_and(packed, 0x0F, out=out[..., 0, :])
    torch.bitwise_right_shift(packed, 4, out=out[..., 1, :])
    return out


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(blocks[:, 2:].view(torch.int8), _halves(blocks, 0), out=out)


#: 32-element blocks one inner pass of the 4-bit kernels writes (below :data:`GRAIN` elements)
_SUB32 = 1023


def _four_bit(blocks: torch.Tensor, out: torch.Tensor, offset: bool) -> None:
    """Q4_0 (``offset`` False: ``d * (q - 8)``) and Q4_1 (``d * q + m``, two roundings as gguf-py's): the scales of
    the outer pass converted once, the nibbles and products written :data:`_SUB32` blocks at a time."""
    d = _halves(blocks, 0)
    m = _halves(blocks, 2) if offset else None
    at = 4 if offset else 2
    scratch = torch.empty((min(_SUB32, blocks.shape[0]), 2, 16), dtype=torch.uint8)
    for start in range(0, blocks.shape[0], _SUB32):
        part = blocks[start : start + _SUB32]
        n = part.shape[0]
        q = _nibbles(part[:, at:], scratch[:n]).view(n, 32)
        target = out[start : start + n]
        if m is None:
            q = q.view(torch.int8)
            q.sub_(8)
            torch.mul(q, d[start : start + n], out=target)
        else:
            torch.mul(q, d[start : start + n], out=target)
            target.add_(m[start : start + n])


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _four_bit(blocks, out, offset=False)


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _four_bit(blocks, out, offset=True)


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 6:], torch.empty((n, 2, 16), dtype=torch.uint8)).view(n, 32)
    q = q.bitwise_or_(_spread(_BIT_TABLE, blocks[:, 2:6]).view(n, 32)).view(torch.int8)
    q.sub_(16)
    torch.mul(q, _halves(blocks, 0), out=out)


def _q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 8:], torch.empty((n, 2, 16), dtype=torch.uint8)).view(n, 32)
    q.bitwise_or_(_spread(_BIT_TABLE, blocks[:, 4:8]).view(n, 32))
    torch.mul(q, _halves(blocks, 0), out=out)
    out.add_(_halves(blocks, 2))


#: byte -> its 8 bits, lowest first, each as 0 or 16 (a 5-bit value's high bit); byte -> its four 2-bit fields,
#: lowest first, each shifted up by 4 (a 6-bit value's high bits)
_BIT_TABLE = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).to(torch.uint8) << 4
_PAIR_TABLE = ((torch.arange(256).unsqueeze(1) >> torch.tensor([0, 2, 4, 6])) & 3).to(torch.uint8) << 4


def _spread(table: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``table[byte]`` for every byte of ``packed``: ``packed``'s shape with the table's row appended."""
    return torch.index_select(table, 0, packed.reshape(-1).long()).view(*packed.shape, table.shape[1])


#: blocks of 256 elements one inner pass of a K-quant kernel writes (below :data:`GRAIN` elements)
_SUB = 127


def _k_factors(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``d * scale`` and ``dmin * min`` of each 32-element sub-block of Q4_K / Q5_K blocks (``(n, 8)`` float32,
    each product rounded once, as gguf-py computes them)."""
    n = blocks.shape[0]
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    d, m, md = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float().mul_(_halves(blocks, 0)), mins.float().mul_(_halves(blocks, 2))


def _k_quant(blocks: torch.Tensor, out: torch.Tensor, high: bool) -> None:
    """Q4_K (``high`` False) and Q5_K: ``out = (d * scale) * q - dmin * min`` per sub-block, in two passes (no fused
    multiply-add: gguf-py rounds the product, then the difference)."""
    d, dm = _k_factors(blocks)
    scratch = torch.empty((min(_SUB, blocks.shape[0]), 4, 2, 32), dtype=torch.uint8)
    low_at = 48 if high else 16
    for start in range(0, blocks.shape[0], _SUB):
        part = blocks[start : start + _SUB]
        n = part.shape[0]
        q = _nibbles(part[:, low_at:].reshape(n, 4, 32), scratch[:n]).view(n, 8, 32)
        if high:  # bit i of byte p of qh is element p of sub-block i's fifth bit
            q.bitwise_or_(_spread(_BIT_TABLE, part[:, 16:48]).transpose(1, 2))
        view = out[start : start + n].view(n, 8, 32)
        torch.mul(q, d[start : start + n].unsqueeze(-1), out=view)
        view.sub_(dm[start : start + n].unsqueeze(-1))


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _k_quant(blocks, out, high=False)


def _q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _k_quant(blocks, out, high=True)


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    scale = blocks[:, 192:208].view(torch.int8).float().mul_(_halves(blocks, 208))  # d * scales, as gguf-py
    scratch = torch.empty((min(_SUB, blocks.shape[0]), 2, 2, 64), dtype=torch.uint8)
    for start in range(0, blocks.shape[0], _SUB):
        part = blocks[start : start + _SUB]
        n = part.shape[0]
        q = _nibbles(part[:, :128].reshape(n, 2, 64), scratch[:n]).view(n, 2, 4, 32)
        q.bitwise_or_(_spread(_PAIR_TABLE, part[:, 128:192].reshape(n, 2, 32)).transpose(2, 3))
        q = q.view(torch.int8)
        q.sub_(32)
        torch.mul(q.view(n, 16, 16), scale[start : start + n].unsqueeze(-1), out=out[start : start + n].view(n, 16, 16))


def _f32(blocks: torch.Tensor, out: torch.Tensor) -> None:  # the plain types: one chunk of elements at a time
    out.copy_(blocks.reshape(-1).view(torch.float32).view(out.shape))


def _f16(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks.reshape(-1).view(torch.float16).view(out.shape))


def _bf16(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks.reshape(-1).view(torch.bfloat16).view(out.shape))  # bfloat16 to float32: the bits shifted by 16


#: GGML type number -> the torch kernel (``blocks``: ``(n, block bytes)`` uint8; ``out``: ``(n, block elements)``)
_KERNELS: dict[int, Callable[[torch.Tensor, torch.Tensor], None]] = {
    0: _f32,
    1: _f16,
    2: _q4_0,
    3: _q4_1,
    6: _q5_0,
    7: _q5_1,
    8: _q8_0,
    12: _q4_k,
    13: _q5_k,
    14: _q6_k,
    30: _bf16,
}

#: torch's grain size: a CPU op over fewer elements runs inline on the calling thread. One pass of a kernel writes
#: the most whole blocks below it (a reader thread dequantizes beside the compute thread; torch's thread pool, woken
#: for every op of a pass, made a loaded 2-core machine 30-50x slower), and its scratch stays in the caches
GRAIN = 32768


#: blocks one outer pass of the 4-bit and K-quant kernels takes: their scales (1, 8 or 16 a block) stay below
#: :data:`GRAIN`; the elements are then written :data:`_SUB32` or :data:`_SUB` blocks at a time
_OUTER = {2: GRAIN - 1, 3: GRAIN - 1, 12: (GRAIN - 1) // 8, 13: (GRAIN - 1) // 8, 14: (GRAIN - 1) // 16}


def fast_types() -> list[str]:
    """The names of the types these torch kernels dequantize (the others go through gguf-py's numpy code)."""
    return [type_name(kind) for kind in _KERNELS]


def supported(kind: int) -> bool:
    """Whether tensor type ``kind`` can be dequantized (here, or by gguf-py)."""
    from gguf.quants import _type_traits

    return int(kind) in _KERNELS or any(int(k) == int(kind) for k in _type_traits)


def check_supported(kind: int, tensor: str) -> None:
    """A one-line :class:`UnsupportedTensorType` naming ``tensor`` and its type when it cannot be dequantized."""
    block_shape(kind)
    if not supported(kind):
        raise UnsupportedTensorType(
            f"GGUF tensor {tensor!r} has type {type_name(kind)}, which gguf-py cannot dequantize; "
            "re-quantize the model to a type it reads (Q4_K, Q8_0, ...) or upgrade gguf (pip install -U gguf)"
        )


def dequantize_into(raw: torch.Tensor, kind: int, out: torch.Tensor) -> torch.Tensor:
    """Dequantize ``raw`` (the tensor's bytes, uint8, any shape) of GGML type ``kind`` into ``out`` (float32,
    contiguous, the tensor's element count): bit for bit ``gguf.quants.dequantize``. Returns ``out``."""
    elements, nbytes = block_shape(kind)
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("dequantize_into writes a contiguous float32 tensor")
    flat = raw.reshape(-1)
    count = out.numel() // elements
    if out.numel() % elements or flat.numel() != count * nbytes:
        raise ValueError(f"{flat.numel()} bytes of {type_name(kind)} do not hold {out.numel()} elements")
    kernel = _KERNELS.get(int(kind))
    target = out.view(count, elements)
    if kernel is None:
        _numpy_into(flat, kind, target)
        return out
    blocks = flat.view(count, nbytes)
    step = _OUTER.get(int(kind), max((GRAIN - 1) // elements, 1))
    with torch.inference_mode(False):
        for start in range(0, count, step):
            kernel(blocks[start : start + step], target[start : start + step])
    return out


def copy_inline(out: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``out.copy_(source)`` in pieces below :data:`GRAIN` elements, so that it runs on the calling thread."""
    if out.numel() < GRAIN or out.dim() == 0:
        return out.copy_(source)
    rows = out.shape[0]
    per = out.numel() // max(rows, 1)
    if per >= GRAIN:
        for row in range(rows):
            copy_inline(out[row], source[row])
        return out
    step = max((GRAIN - 1) // max(per, 1), 1)
    for start in range(0, rows, step):
        out[start : start + step].copy_(source[start : start + step])
    return out


def _numpy_into(flat: torch.Tensor, kind: int, target: torch.Tensor) -> None:
    from gguf.quants import dequantize

    check_supported(kind, "?")
    values = dequantize(flat.numpy(), kind)
    copy_inline(target, torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(target.shape))
