"""GGUF block dequantization in vectorized torch, bit for bit gguf-py's ``gguf.quants.dequantize`` (the same float32
products and sums, in the same order), writing into a buffer the caller holds; other types go through gguf-py's numpy
dequantizer, and a type gguf-py cannot dequantize is refused in one line."""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np
import torch

from offload_core.errors import CheckpointError

__all__ = [
    "UnsupportedTensorType",
    "block_shape",
    "buffers_in",
    "copy_inline",
    "dequantize_into",
    "fast_types",
    "has_kernel",
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


#: each thread's scratch buffers (a reader thread dequantizes beside the compute thread)
_THREAD = threading.local()


def _held_buffers() -> dict:
    """This thread's held buffers (a device decoder's own while it decodes: :func:`buffers_in`)."""
    if getattr(_THREAD, "buffers", None) is None:
        _THREAD.buffers = {}
    return _THREAD.buffers


def _scratch(slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A view of ``shape`` into this thread's buffer ``slot`` on ``device``, grown as needed and kept: the passes of
    every call reuse it (no allocation per pass, nor per call once the largest pass has run)."""
    buffers = _held_buffers()
    count = math.prod(shape)
    key = (slot, dtype, device)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < count:
        buffer = buffers[key] = torch.empty(count, dtype=dtype, device=device)
    return buffer[:count].view(shape)


@contextmanager
def buffers_in(held: dict) -> Iterator[None]:
    """The kernels' scratch buffers taken from ``held`` on the calling thread while the block runs (a device
    decoder's own, used by the threads that decode in turn: the device keeps one set, not one a thread)."""
    before = getattr(_THREAD, "buffers", None)
    _THREAD.buffers = held
    try:
        yield
    finally:
        _THREAD.buffers = before


def _planes(blocks: torch.Tensor) -> torch.Tensor:
    """The low and the high nibble of every byte of ``blocks`` (``(n, block bytes)``), as ``(2, n, block bytes)``
    uint8 (a held buffer): two passes over contiguous bytes (the scale bytes' nibbles are computed and left unused;
    a pass over each block's packed bytes alone runs one short row at a time, several times slower)."""
    out = _scratch("planes", (2, *blocks.shape), torch.uint8, blocks.device)
    flat = (
        blocks.reshape(-1)
        if blocks.is_contiguous()
        else _scratch("blocks", tuple(blocks.shape), torch.uint8, blocks.device).copy_(blocks).view(-1)
    )
    torch.bitwise_and(flat, 0x0F, out=out[0].view(-1))
    torch.bitwise_right_shift(flat, 4, out=out[1].view(-1))
    return out


def _nibbles(planes: torch.Tensor, start: int, rows: int, end: int | None = None) -> torch.Tensor:
    """Bytes ``start:end`` of each block as ``rows`` rows, ``(n, rows, 2, k)`` (the low nibbles of a row, then its
    high ones): a view of :func:`_planes`'s buffer."""
    part = planes[:, :, start:end]
    return part.reshape(2, part.shape[1], rows, -1).permute(1, 2, 0, 3)


def _split(blocks: torch.Tensor, start: int, rows: int, end: int | None = None) -> torch.Tensor:
    """Bytes ``start:end`` of each block as ``rows`` rows, ``(n, rows, 2, k)`` uint8: the low nibbles of a row, then
    its high ones (the order of the values in GGML's 4-bit types). Four bytes at a time where the rows lie at 4-byte
    boundaries (a held buffer, its bytes in that order, so that converting it is one contiguous pass); else a view of
    :func:`_planes`'s buffer."""
    n, nbytes = blocks.shape
    stop = nbytes if end is None else end
    if nbytes % 4 or start % 4 or stop % 4 or blocks.data_ptr() % 4 or blocks.stride(0) != nbytes:
        return _nibbles(_planes(blocks), start, rows, end)
    words = blocks.view(torch.int32)[:, start // 4 : stop // 4].reshape(n, rows, -1)
    out = _scratch("words", (n, rows, 2, words.shape[-1]), torch.int32, blocks.device)
    torch.bitwise_and(words, 0x0F0F0F0F, out=out[:, :, 0])
    torch.bitwise_right_shift(words, 4, out=out[:, :, 1])
    out[:, :, 1].bitwise_and_(0x0F0F0F0F)  # each byte's high nibble, the next byte's low bits shifted in cleared
    return out.view(torch.uint8).view(n, rows, 2, -1)


def _held(slot: str, values: torch.Tensor) -> torch.Tensor:
    """``values`` copied into a contiguous held buffer (to be changed in place)."""
    return _scratch(slot, tuple(values.shape), values.dtype, values.device).copy_(values)


def _scaled(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, shift: torch.Tensor | None = None) -> None:
    """``out = float(q) * scale`` (then ``+ shift``, a second rounding as gguf-py's): ``q`` (``out``'s elements, in
    any shape) converted into ``out`` first, so that the product runs on float32 alone (a product of an integer and a
    float tensor converts each element inside the multiplication, several times slower)."""
    out.view(q.shape).copy_(q)
    out.mul_(scale)
    if shift is not None:
        out.add_(shift)


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _scaled(blocks[:, 2:].view(torch.int8), _halves(blocks, 0), out)


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:  # d * (q - 8), q - 8 in int8 as gguf-py's
    planes = _planes(blocks)
    planes.view(torch.int8).sub_(8)
    _scaled(_nibbles(planes, 2, 1).view(torch.int8), _halves(blocks, 0), out)


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:  # d * q + m, two roundings as gguf-py's
    _scaled(_split(blocks, 4, 1), _halves(blocks, 0), out, _halves(blocks, 2))


def _five_bit(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """Q5_0 / Q5_1's 5-bit values, ``(n, 32)`` uint8: the nibbles from byte ``at``, the fifth bits from the four
    bytes before."""
    n = blocks.shape[0]
    q = _held("q", _split(blocks, at, 1)).view(n, 32)
    return q.bitwise_or_(_spread(_BIT_TABLE, blocks[:, at - 4 : at]).view(n, 32))


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    q = _five_bit(blocks, 6).view(torch.int8)
    q.sub_(16)
    _scaled(q, _halves(blocks, 0), out)


def _q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _scaled(_five_bit(blocks, 8), _halves(blocks, 0), out, _halves(blocks, 2))


#: byte -> its 8 bits, lowest first, each as 0 or 16 (a 5-bit value's high bit); byte -> its four 2-bit fields,
#: lowest first, each shifted up by 4 (a 6-bit value's high bits)
_BIT_TABLE = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).to(torch.uint8) << 4
_PAIR_TABLE = ((torch.arange(256).unsqueeze(1) >> torch.tensor([0, 2, 4, 6])) & 3).to(torch.uint8) << 4


def _spread(table: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``table[byte]`` for every byte of ``packed``: ``packed``'s shape with the table's row appended (held)."""
    if table.device != packed.device:  # copied to the device once, then held with the buffers
        buffers, key = _held_buffers(), ("table", table.data_ptr(), packed.device)
        if key not in buffers:
            buffers[key] = table.to(packed.device)
        table = buffers[key]
    index = _scratch("index", tuple(packed.shape), torch.int64, packed.device).copy_(packed)
    spread = _scratch("spread", (index.numel(), table.shape[1]), table.dtype, packed.device)
    return torch.index_select(table, 0, index.view(-1), out=spread).view(*packed.shape, table.shape[1])


def _k_factors(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``d * scale`` and ``dmin * min`` of each 32-element sub-block of Q4_K / Q5_K blocks (``(n, 8, 1)`` float32,
    each product rounded once, as gguf-py computes them). The 6-bit scales and mins are unpacked four bytes at a time
    where the block's 12 bytes of them lie at 4-byte boundaries (one pass per word of every block)."""
    n = blocks.shape[0]
    if blocks.data_ptr() % 4 or blocks.stride(0) % 4:
        packed = blocks[:, 4:16].reshape(n, 3, 4)
        d, m, md = packed[:, 0], packed[:, 1], packed[:, 2]
        sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
        mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    else:  # the same byte-wise operations on each word's four bytes (a shift's bits from the next byte masked off)
        words = blocks.view(torch.int32)[:, 1:4]
        d, m, md = words[:, 0], words[:, 1], words[:, 2]
        both = _scratch("factors", (2, n, 2), torch.int32, blocks.device)
        torch.bitwise_and(d, 0x3F3F3F3F, out=both[0, :, 0])
        torch.bitwise_and(m, 0x3F3F3F3F, out=both[1, :, 0])
        high = (d >> 2).bitwise_and_(0x30303030)
        torch.bitwise_or(high, md & 0x0F0F0F0F, out=both[0, :, 1])
        high = (m >> 2).bitwise_and_(0x30303030)
        torch.bitwise_or(high, (md >> 4).bitwise_and_(0x0F0F0F0F), out=both[1, :, 1])
        sc, mins = both.view(torch.uint8).view(2, n, 8)
    return sc.float().mul_(_halves(blocks, 0)).unsqueeze(-1), mins.float().mul_(_halves(blocks, 2)).unsqueeze(-1)


def _k_quant(blocks: torch.Tensor, out: torch.Tensor, high: bool) -> None:
    """Q4_K (``high`` False) and Q5_K: ``out = (d * scale) * q - dmin * min`` per sub-block, in two passes (no fused
    multiply-add: gguf-py rounds the product, then the difference)."""
    n = blocks.shape[0]
    d, dm = _k_factors(blocks)
    q = _split(blocks, 48 if high else 16, 4)  # (n, 4, 2, 32): sub-blocks 2i and 2i + 1
    if high:  # bit i of byte p of qh is element p of sub-block i's fifth bit
        q = _held("q", q).view(n, 8, 32)
        q.bitwise_or_(_spread(_BIT_TABLE, blocks[:, 16:48]).transpose(1, 2))
    view = out.view(n, 8, 32)
    _scaled(q, d, view)
    view.sub_(dm)


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _k_quant(blocks, out, high=False)


def _q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _k_quant(blocks, out, high=True)


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    scale = blocks[:, 192:208].view(torch.int8).float().mul_(_halves(blocks, 208))  # d * scales, as gguf-py
    q = _held("q", _nibbles(_planes(blocks), 0, 2, 128)).view(n, 2, 4, 32)
    q.bitwise_or_(_spread(_PAIR_TABLE, blocks[:, 128:192].reshape(n, 2, 32)).transpose(2, 3))
    q = q.view(torch.int8)
    q.sub_(32)
    _scaled(q.view(n, 16, 16), scale.unsqueeze(-1), out.view(n, 16, 16))


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

#: torch's grain size: a CPU op over fewer elements runs inline on the calling thread
GRAIN = 32768
#: elements one pass of a kernel writes on the CPU: fewer passes, fewer op dispatches (an op over 32,768 elements
#: cost as much again as its work), and a pass's scratch (a few bytes an element) still within a core's cache
CPU_PASS = 2**18


@contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    """Torch on one thread on the calling thread while a kernel runs on the CPU (torch's thread count is per thread:
    the others keep theirs), so that every op runs inline: a reader thread dequantizes beside the compute thread, and
    torch's thread pool, woken for every op of a pass, made a loaded 2-core machine 30-100x slower."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def fast_types() -> list[str]:
    """The names of the types these torch kernels dequantize (the others go through gguf-py's numpy code)."""
    return [type_name(kind) for kind in _KERNELS]


def has_kernel(kind: int) -> bool:
    """Whether tensor type ``kind`` has a torch kernel here (one that runs on any device)."""
    return int(kind) in _KERNELS


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
    step = max(CPU_PASS // elements, 1) if out.device.type == "cpu" else count
    with torch.inference_mode(False), one_thread(out.device):
        for start in range(0, count, step):
            kernel(blocks[start : start + step], target[start : start + step])
    return out


def held_buffer(elements: int, device: torch.device) -> torch.Tensor:
    """A float32 buffer of ``elements`` held by this thread for the next call's intermediate values (reused: no
    allocation per call)."""
    return _scratch("values", (elements,), torch.float32, torch.device(device))


def unpermute_into(values: torch.Tensor, heads: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` = ``values`` (a tensor's rows, flat) un-permuted as transformers' ``LlamaTensorProcessor`` does llama's
    q and k (``reshape(heads, rows // heads // 2, 2, ...).swapaxes(2, 1)``): the same values moved, in one copy."""
    rows = out.shape[0]
    dim = rows // heads // 2
    source = values.view(heads, dim, 2, -1).transpose(1, 2)
    with one_thread(out.device):
        out.view(heads, 2, dim, -1).copy_(source)
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
