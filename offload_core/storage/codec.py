"""A lossless code for bf16 tensors that any device decodes with four tensor operations: each element's high byte
(the sign and the exponent's top seven bits, which take few values in trained weights) becomes a 4-bit index into
the tensor's table of its 15 most frequent values, the rest listed as exceptions; the low byte is kept as is."""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np
import torch

from offload_core.errors import StorageError

#: the dtypes the code applies to (others are kept raw: fp16 and fp32 exponents do not sit in one byte)
CODED_DTYPES = (torch.bfloat16,)
#: tensors with fewer elements are kept raw (the table and header would outweigh the bytes saved)
MIN_ELEMENTS = 4096
#: elements per chunk by default (16 MiB of bf16): a device decodes one chunk at a time in fixed scratch buffers
CHUNK_ELEMENTS = 2**23
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
    _host: np.ndarray | None = dataclasses.field(default=None, repr=False, compare=False)
    #: the tensors of one kind decode in one scratch on the device (:class:`offload_core.storage.base.DevicePacked`)
    kind: ClassVar[str] = "exponent"

    def new_scratch(self, device: torch.device) -> Scratch:
        return Scratch(device, self.chunk)

    def decode_on_device(self, out: torch.Tensor, scratch: Scratch, name: str) -> None:
        decode_into(self, out, scratch, name)

    @property
    def host(self) -> np.ndarray:
        """The blob as a numpy array (made once: its headers are read on every decode)."""
        if self._host is None:
            self._host = self.blob.numpy()
        return self._host

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
            data = self.host[chunk.offset : chunk.offset + chunk.nbytes]
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
    return -(-(2 * chunk + HEADER + TABLE + PIECE) // PIECE) * PIECE


def applies(dtype: torch.dtype, numel: int) -> bool:
    """Whether a tensor of ``dtype`` and ``numel`` elements is worth coding (the others are kept raw)."""
    return dtype in CODED_DTYPES and numel >= MIN_ELEMENTS


def encode(
    tensor: torch.Tensor,
    chunk: int = CHUNK_ELEMENTS,
    allocate: Callable[[int], torch.Tensor] | None = None,
) -> Packed | None:
    """``tensor`` (bf16, on the host) in the code, its blob from ``allocate(nbytes)`` (a uint8 tensor; default: new
    memory); None where the code does not apply (:func:`applies`) or would not take fewer bytes than the tensor.

    Encoded with numpy (one pass per step, no element-wise Python): the histogram of high bytes, their indices, then
    each chunk written straight into the blob once every chunk's exceptions are counted."""
    if not applies(tensor.dtype, tensor.numel()):
        return None
    chunk = max(2, int(chunk) // 2 * 2)
    flat = tensor.detach().contiguous().view(torch.uint8).numpy().reshape(-1, 2)
    high = flat[:, 1]
    # the 15 most frequent high bytes of every 16th element (any table decodes exactly: a sample only sets the size),
    # ties to the smaller value
    counts = np.bincount(high[::16], minlength=256)
    order = np.argsort(-counts, kind="stable")
    values = np.zeros(16, dtype=np.uint8)
    values[:ESCAPE] = order[:ESCAPE]
    index_of = np.full(256, ESCAPE, dtype=np.uint8)
    index_of[order[:ESCAPE]] = np.arange(ESCAPE, dtype=np.uint8)
    byte = np.arange(256)
    table = np.stack((values[byte & 15], values[byte >> 4]), axis=1).reshape(-1)
    codes = index_of[high]
    chunks, offset = [], 0
    for start in range(0, high.shape[0], chunk):
        count = min(chunk, high.shape[0] - start)
        k = int(np.count_nonzero(codes[start : start + count] == ESCAPE))
        nbytes = Chunk(start, count, 0, 0, k, 0).positions_at + 5 * k
        if nbytes > raw_bound(chunk):
            return None  # too many exceptions: the tensor stays raw
        chunks.append(Chunk(start, count, offset, nbytes, k, 0))
        offset += -(-nbytes // PIECE) * PIECE
    if offset >= tensor.numel() * tensor.element_size():
        return None
    blob = allocate(offset) if allocate is not None else torch.empty(offset, dtype=torch.uint8)
    out = blob.numpy()
    out[:] = 0  # padding included: the same tensor always packs to the same bytes
    for i, c in enumerate(chunks):
        piece = out[c.offset : c.offset + c.nbytes]
        _encode_chunk(piece, c, flat[c.start : c.start + c.count], codes[c.start : c.start + c.count], table)
        chunks[i] = dataclasses.replace(c, crc=zlib.crc32(memoryview(piece)))
    return Packed(blob, tuple(chunks), tensor.shape, tensor.dtype, chunk)


def _encode_chunk(piece: np.ndarray, chunk: Chunk, pairs: np.ndarray, codes: np.ndarray, table: np.ndarray) -> None:
    """Write one chunk into ``piece``: header, table, low bytes, indices two to a byte, exception positions (int32)
    and values."""
    count, at = chunk.count, HEADER + TABLE
    piece[:HEADER] = np.array([MAGIC, count, chunk.exceptions, 0], dtype=np.int32).view(np.uint8)
    piece[HEADER:at] = table
    piece[at : at + count] = pairs[:, 0]
    nibbles = piece[at + count : at + count + chunk.pairs]
    nibbles[: count // 2] = codes[0 : count - count % 2 : 2] | (codes[1::2] << 4)
    if count % 2:
        nibbles[-1] = codes[-1]
    positions = _escapes(codes)
    at = chunk.positions_at
    piece[at : at + 4 * chunk.exceptions] = positions.view(np.uint8)
    piece[at + 4 * chunk.exceptions :] = pairs[positions, 1]


def _escapes(codes: np.ndarray) -> np.ndarray:
    """The positions (int32) of the escape indices in ``codes``, found 8 at a time (few of them, in a long array)."""
    mask = codes == ESCAPE
    if mask.shape[0] % 8:
        mask = np.concatenate((mask, np.zeros(8 - mask.shape[0] % 8, dtype=bool)))
    words = np.flatnonzero(mask.view(np.uint64))
    rows, cols = np.nonzero(mask.reshape(-1, 8)[words])
    return (words[rows] * 8 + cols).astype(np.int32)


def check_header(packed: Packed, chunk: Chunk, name: str) -> None:
    """A chunk's header read from host memory (16 bytes, no device work): the code, and the counts it was packed
    with."""
    header = packed.host[chunk.offset : chunk.offset + HEADER].view(np.int32).tolist()
    if header != [MAGIC, chunk.count, chunk.exceptions, 0]:
        raise StorageError(damaged(name, f"chunk at element {chunk.start} has a wrong header"))


class Scratch:
    """Fixed buffers on a device where chunks of at most ``chunk`` elements land and are decoded: allocated once,
    reused by every chunk in the order of the one stream that decodes (one thread queueing at a time)."""

    def __init__(self, device: torch.device, chunk: int = CHUNK_ELEMENTS) -> None:
        pairs = (chunk + 1) // 2
        self.chunk = chunk
        with torch.inference_mode(False):  # written in place by every decode: never inference tensors
            self.raw = Views(torch.empty(raw_bound(chunk), dtype=torch.uint8, device=device))
            self.indices = torch.empty(pairs, dtype=torch.int32, device=device)
            self.high = Views(torch.empty(2 * pairs, dtype=torch.uint8, device=device))

    @property
    def nbytes(self) -> int:
        return self.raw.u8.numel() + 4 * self.indices.numel() + self.high.u8.numel()


def decode_into(packed: Packed, out: torch.Tensor, scratch: Scratch | None = None, name: str = "tensor") -> None:
    """Write the tensor ``packed`` holds into ``out`` (a contiguous tensor of its bytes, any dtype, on any device).

    With ``scratch`` (on ``out``'s device) each chunk is copied there (asynchronously from pinned memory) and decoded
    in its buffers, with no allocation; without, the host blob is decoded where it lies and every chunk's checksum
    is checked first. Each chunk's header is checked in host memory either way. Only slices are taken per chunk:
    the views in other dtypes are made once (a dtype view costs several times a slice)."""
    pairs_out = out.view(torch.uint8).view(-1, 2)
    if pairs_out.shape[0] != math.prod(packed.shape):
        raise ValueError(f"decode_into: {tuple(out.shape)} {out.dtype} does not hold {tuple(packed.shape)} bf16")
    if scratch is None:
        packed.verify(name)
        source = Views(packed.blob)
        high = Views(torch.empty(2 * ((packed.chunk + 1) // 2), dtype=torch.uint8))
        indices = torch.empty((packed.chunk + 1) // 2, dtype=torch.int32)
    else:
        source, high, indices = scratch.raw, scratch.high, scratch.indices
    for chunk in packed.chunks:
        check_header(packed, chunk, name)
        base = chunk.offset
        if scratch is not None:
            if chunk.count > scratch.chunk or chunk.nbytes > scratch.raw.u8.numel():
                raise ValueError(f"decode_into: a chunk of {chunk.count} elements exceeds the scratch: {scratch.chunk}")
            scratch.raw.u8[: chunk.nbytes].copy_(packed.blob[base : base + chunk.nbytes], non_blocking=True)
            base = 0
        decode_chunk(source, base, chunk, indices, high, pairs_out[chunk.start : chunk.start + chunk.count])


class Views:
    """A byte buffer (its length a multiple of 4, its start aligned) with its int16 and int32 views, made once."""

    def __init__(self, u8: torch.Tensor) -> None:
        self.u8 = u8
        self.i16 = u8.view(torch.int16)
        self.i32 = u8.view(torch.int32) if u8.numel() % 4 == 0 else None


def decode_chunk(buf: Views, base: int, chunk: Chunk, indices: torch.Tensor, high: Views, out: torch.Tensor) -> None:
    """Decode the chunk lying at byte ``base`` of ``buf`` into ``out`` (its ``count`` x 2 bytes), through ``indices``
    (int32) and ``high`` (its int16 view gets the high bytes two at a time), each at least the chunk's pairs long."""
    count, pairs, at = chunk.count, chunk.pairs, base + HEADER + TABLE
    table = buf.i16[(base + HEADER) // 2 : at // 2]
    indices = indices[:pairs]
    indices.copy_(buf.u8[at + count : at + count + pairs])
    torch.index_select(table, 0, indices, out=high.i16[:pairs])  # one byte of two indices -> the two high bytes
    high_bytes = high.u8[:count]
    if chunk.exceptions:
        at, k = base + chunk.positions_at, chunk.exceptions
        high_bytes.index_put_((buf.i32[at // 4 : at // 4 + k],), buf.u8[at + 4 * k : at + 5 * k])
    torch.stack((buf.u8[base + HEADER + TABLE : base + HEADER + TABLE + count], high_bytes), dim=1, out=out)


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
