"""A lossless code for bf16 tensors that any device decodes with four tensor operations: each element's high byte
(the sign and the exponent's top seven bits, which take few values in trained weights) becomes a 4-bit index into
the tensor's table of its 15 most frequent values, the rest listed as exceptions; the low byte is kept as is."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable

import torch

from offload_core.errors import StorageError

#: the dtypes the code applies to (others are kept raw: fp16 and fp32 exponents do not sit in one byte)
CODED_DTYPES = (torch.bfloat16,)
#: tensors with fewer elements are kept raw (the table and header would outweigh the bytes saved)
MIN_ELEMENTS = 4096
#: elements per chunk by default (8 MiB of bf16): a device decodes one chunk at a time in fixed scratch buffers
CHUNK_ELEMENTS = 2**22
MAGIC = 0x45585031  # "EXP1"
HEADER = 16  # int32 magic, elements, exceptions, 0
TABLE = 512  # 256 int16: a byte of two indices -> the two high bytes it stands for
ESCAPE = 15  # the index of an element whose high byte is an exception
PIECE = 16  # each chunk starts on this boundary in the blob


@dataclass(frozen=True)
class Chunk:
    """One chunk of a packed tensor: elements ``[start, start + count)``, its bytes ``[offset, offset + nbytes)`` of
    the blob, ``exceptions`` high bytes listed apart, and the CRC-32 of its bytes."""

    start: int
    count: int
    offset: int
    nbytes: int
    exceptions: int
    crc: int

    @property
    def pairs(self) -> int:
        return (self.count + 1) // 2

    @property
    def positions_at(self) -> int:
        return -(-(HEADER + TABLE + self.count + self.pairs) // 4) * 4


@dataclass
class Packed:
    """A tensor held in the code: its chunks one after another in ``blob`` (uint8, host memory)."""

    blob: torch.Tensor
    chunks: tuple[Chunk, ...]
    shape: torch.Size
    dtype: torch.dtype
    chunk: int  # the most elements of a chunk, here or in the other tensors decoded with the same scratch

    @property
    def nbytes(self) -> int:
        """The bytes a read moves (the blob)."""
        return self.blob.numel()

    @property
    def raw_nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def verify(self, name: str = "tensor") -> None:
        """Raise :class:`StorageError` where a chunk's bytes no longer match the CRC-32 taken when it was packed."""
        for chunk in self.chunks:
            check_header(self, chunk, name)
            data = self.blob[chunk.offset : chunk.offset + chunk.nbytes].numpy()
            if zlib.crc32(memoryview(data)) != chunk.crc:
                raise StorageError(damaged(name, f"chunk at element {chunk.start} fails its checksum"))


def damaged(name: str, what: str) -> str:
    return (
        f"the packed bytes of {name!r} are damaged ({what}): host memory was overwritten; "
        "load the model again (storage.codec=none keeps the weights unpacked)"
    )


def scratch_bytes(chunk: int = CHUNK_ELEMENTS) -> int:
    """The device bytes :class:`Scratch` takes for chunks of ``chunk`` elements: the largest packed chunk
    (:func:`encode` keeps a tensor raw rather than exceed it), its indices widened to int32 and its high bytes."""
    pairs = (chunk + 1) // 2
    return raw_bound(chunk) + 4 * pairs + 2 * pairs


def raw_bound(chunk: int) -> int:
    """The most bytes one packed chunk of at most ``chunk`` elements may take."""
    return 2 * chunk + HEADER + TABLE + PIECE


def applies(dtype: torch.dtype, numel: int) -> bool:
    """Whether a tensor of ``dtype`` and ``numel`` elements is worth coding (the others are kept raw)."""
    return dtype in CODED_DTYPES and numel >= MIN_ELEMENTS


def encode(
    tensor: torch.Tensor,
    chunk: int = CHUNK_ELEMENTS,
    allocate: Callable[[int], torch.Tensor] | None = None,
) -> Packed | None:
    """``tensor`` (bf16, on the host) in the code, its blob from ``allocate(nbytes)`` (a uint8 tensor; default: new
    memory); None where the code does not apply (:func:`applies`) or would not take fewer bytes than the tensor."""
    if not applies(tensor.dtype, tensor.numel()):
        return None
    chunk = max(2, int(chunk) // 2 * 2)
    flat = tensor.detach().contiguous().view(torch.uint8).view(-1, 2)
    high = flat[:, 1]
    counts = torch.zeros(256, dtype=torch.int64)
    for start in range(0, high.numel(), chunk):
        counts += torch.bincount(high[start : start + chunk], minlength=256)
    # the 15 most frequent high bytes, ties to the smaller value (so the code is deterministic)
    order = torch.sort(-counts, stable=True).indices
    values = torch.zeros(16, dtype=torch.uint8)
    values[:ESCAPE] = order[:ESCAPE].to(torch.uint8)
    index_of = torch.full((256,), ESCAPE, dtype=torch.uint8)
    index_of[order[:ESCAPE]] = torch.arange(ESCAPE, dtype=torch.uint8)
    byte = torch.arange(256)
    table = torch.stack((values[byte & 15], values[byte >> 4]), dim=1).reshape(-1)
    pieces, chunks, offset = [], [], 0
    for start in range(0, high.numel(), chunk):
        piece = _encode_chunk(flat[start : start + chunk], table, index_of)
        if piece.numel() > raw_bound(chunk):
            return None  # too many exceptions: the tensor stays raw
        pieces.append(piece)
        count = min(chunk, high.numel() - start)
        exceptions = int(piece[:HEADER].view(torch.int32)[2])
        crc = zlib.crc32(memoryview(piece.numpy()))
        chunks.append(Chunk(start, count, offset, piece.numel(), exceptions, crc))
        offset += -(-piece.numel() // PIECE) * PIECE
    if offset >= tensor.numel() * tensor.element_size():
        return None
    blob = allocate(offset) if allocate is not None else torch.empty(offset, dtype=torch.uint8)
    for piece, c, end in zip(pieces, chunks, [c.offset for c in chunks[1:]] + [offset]):
        blob[c.offset : c.offset + c.nbytes].copy_(piece)
        blob[c.offset + c.nbytes : end].zero_()  # the padding to the next piece: the same tensor, the same blob
    return Packed(blob, tuple(chunks), tensor.shape, tensor.dtype, chunk)


def _encode_chunk(pairs: torch.Tensor, table: torch.Tensor, index_of: torch.Tensor) -> torch.Tensor:
    """One chunk's bytes: header, table, low bytes, indices two to a byte, exception positions (int32) and values."""
    count = pairs.shape[0]
    low, high = pairs[:, 0], pairs[:, 1]
    codes = index_of.index_select(0, high.to(torch.int32))
    if count % 2:
        codes = torch.cat((codes, torch.zeros(1, dtype=torch.uint8)))
    nibbles = codes[0::2] | (codes[1::2] << 4)
    positions = (codes[:count] == ESCAPE).nonzero().reshape(-1).to(torch.int32)
    chunk = Chunk(0, count, 0, 0, positions.numel(), 0)
    header = torch.tensor([MAGIC, count, positions.numel(), 0], dtype=torch.int32).view(torch.uint8)
    pad = torch.zeros(chunk.positions_at - (HEADER + TABLE + count + nibbles.numel()), dtype=torch.uint8)
    return torch.cat((header, table, low, nibbles, pad, positions.view(torch.uint8), high[positions.long()]))


def check_header(packed: Packed, chunk: Chunk, name: str) -> None:
    """A chunk's header read from host memory (16 bytes, no device work): the code, and the counts it was packed
    with."""
    header = packed.blob[chunk.offset : chunk.offset + HEADER].view(torch.int32).tolist()
    if header != [MAGIC, chunk.count, chunk.exceptions, 0]:
        raise StorageError(damaged(name, f"chunk at element {chunk.start} has a wrong header"))


class Scratch:
    """Fixed buffers on a device where chunks of at most ``chunk`` elements land and are decoded: allocated once,
    reused by every chunk in the order of the one stream that decodes (one thread queueing at a time)."""

    def __init__(self, device: torch.device, chunk: int = CHUNK_ELEMENTS) -> None:
        pairs = (chunk + 1) // 2
        self.chunk = chunk
        with torch.inference_mode(False):  # written in place by every decode: never inference tensors
            self.raw = torch.empty(raw_bound(chunk), dtype=torch.uint8, device=device)
            self.indices = torch.empty(pairs, dtype=torch.int32, device=device)
            self.high = torch.empty(pairs, dtype=torch.int16, device=device)

    @property
    def nbytes(self) -> int:
        return self.raw.numel() + 4 * self.indices.numel() + 2 * self.high.numel()


def decode_into(packed: Packed, out: torch.Tensor, scratch: Scratch | None = None, name: str = "tensor") -> None:
    """Write the tensor ``packed`` holds into ``out`` (a contiguous tensor of its bytes, any dtype, on any device).

    With ``scratch`` (on ``out``'s device) each chunk is copied there (asynchronously from pinned memory) and decoded
    in its buffers, with no allocation; without, the host blob is decoded where it lies and every chunk's checksum
    is checked first. Each chunk's header is checked in host memory either way."""
    pairs_out = out.view(torch.uint8).view(-1, 2)
    if pairs_out.shape[0] != math.prod(packed.shape):
        raise ValueError(f"decode_into: {tuple(out.shape)} {out.dtype} does not hold {tuple(packed.shape)} bf16")
    if scratch is None:
        packed.verify(name)
    for chunk in packed.chunks:
        check_header(packed, chunk, name)
        if scratch is not None and chunk.count > scratch.chunk:
            raise ValueError(f"decode_into: a chunk of {chunk.count} elements exceeds the scratch's {scratch.chunk}")
        src = packed.blob[chunk.offset : chunk.offset + chunk.nbytes]
        if scratch is not None:
            raw = scratch.raw[: chunk.nbytes]
            raw.copy_(src, non_blocking=True)
            indices, high = scratch.indices[: chunk.pairs], scratch.high[: chunk.pairs]
        else:
            raw = src
            indices = torch.empty(chunk.pairs, dtype=torch.int32)
            high = torch.empty(chunk.pairs, dtype=torch.int16)
        decode_chunk(raw, chunk, indices, high, pairs_out[chunk.start : chunk.start + chunk.count])


def decode_chunk(raw: torch.Tensor, chunk: Chunk, indices: torch.Tensor, high: torch.Tensor, out: torch.Tensor):
    count, pairs = chunk.count, chunk.pairs
    table = raw[HEADER : HEADER + TABLE].view(torch.int16)
    low = raw[HEADER + TABLE : HEADER + TABLE + count]
    indices.copy_(raw[HEADER + TABLE + count : HEADER + TABLE + count + pairs])
    torch.index_select(table, 0, indices, out=high)  # one byte of two indices -> the two high bytes
    high_bytes = high.view(torch.uint8)[:count]
    if chunk.exceptions:
        at = chunk.positions_at
        positions = raw[at : at + 4 * chunk.exceptions].view(torch.int32)
        values = raw[at + 4 * chunk.exceptions : at + 5 * chunk.exceptions]
        high_bytes.index_put_((positions,), values)
    torch.stack((low, high_bytes), dim=1, out=out)


def decode(packed: Packed, name: str = "tensor") -> torch.Tensor:
    """The tensor ``packed`` holds, decoded on the host into new memory (checksums checked)."""
    out = torch.empty(packed.shape, dtype=packed.dtype)
    decode_into(packed, out, name=name)
    return out


def estimate(sample: torch.Tensor) -> float:
    """The fraction of its bytes a bf16 tensor like ``sample`` takes in the code (1.0 where it stays raw)."""
    if not applies(sample.dtype, max(sample.numel(), MIN_ELEMENTS)) or sample.numel() == 0:
        return 1.0
    high = sample.detach().contiguous().view(torch.uint8).view(-1, 2)[:, 1]
    counts = torch.sort(torch.bincount(high, minlength=256), descending=True).values
    n = high.numel()
    packed = n + (n + 1) // 2 + 5 * int(counts[ESCAPE:].sum()) + HEADER + TABLE
    return min(1.0, packed / (2 * n))
