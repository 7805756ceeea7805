"""A tensor assembled from byte ranges of files without copying them: each part's whole pages are the file's own
pages, mapped at their place in the tensor (``mmap(MAP_FIXED)``); only the page at each part's edges is a copy.

transformers 5 fuses per-expert checkpoint tensors into one parameter per layer (``gate_up_proj[E, 2I, H]``);
each per-expert tensor is contiguous in its shard, and so is its place in the fused tensor. Mapped where they
lie, the parts make a fused tensor that is built once per load, costs no copy on any read after, takes its bytes
from the page cache (file-backed: no anonymous memory but a few edge pages), and reads from the disk only the
pages that are touched: a routed expert's rows.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from offload_core.storage.checkpoint import Checkpoint
from offload_core.storage.mapping import address, map_anonymous, register_file_pages, view
from offload_core.storage.pagecache import Span, libc

PAGE = mmap.PAGESIZE
_PROT_READ, _PROT_WRITE = 1, 2
_MAP_PRIVATE, _MAP_FIXED = 0x02, 0x10
_MADV_NOHUGEPAGE = 15


@dataclass(frozen=True)
class Part:
    """``target[index] = file[start:end]``: one source tensor's bytes and where they go."""

    index: tuple
    path: Path
    start: int
    end: int


@dataclass(frozen=True)
class Piece:
    """Where a part lies in the spliced tensor (``at``: its byte offset there) and whether its pages are the file's."""

    part: Part
    at: int
    mapped: tuple[int, int] | None  # the tensor's byte range [a, b) whose pages map the file (None: copied whole)


def _mmap_fn():
    lib = libc()
    if lib is None:
        return None
    fn = lib.mmap
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    fn.restype = ctypes.c_void_p
    return fn


def layout(shape: torch.Size, dtype: torch.dtype, parts: list[Part]) -> list[tuple[Part, int]] | None:
    """Each part with its byte offset in a contiguous ``shape`` tensor, or None where the parts are not contiguous
    ranges of it of their own sizes, or do not cover it exactly once."""
    meta = torch.empty(shape, dtype=dtype, device="meta")
    placed, total = [], 0
    for part in parts:
        try:
            sub = meta[part.index]
        except (IndexError, TypeError, RuntimeError):
            return None
        nbytes = sub.numel() * dtype.itemsize
        if not sub.is_contiguous() or nbytes != part.end - part.start or nbytes == 0:
            return None
        placed.append((part, sub.storage_offset() * dtype.itemsize))
        total += nbytes
    ranges = sorted((at, at + part.end - part.start) for part, at in placed)
    if total != meta.numel() * dtype.itemsize or any(b > c for (_, b), (c, _) in zip(ranges, ranges[1:])):
        return None
    return placed


def checkpoint_parts(checkpoint: Checkpoint, key: str) -> list[Part]:
    """Where the parts of a converted checkpoint tensor lie (``checkpoint.part_ranges``); [] where the checkpoint
    reads it whole."""
    return [Part(index, Path(file), start, end) for index, file, start, end in checkpoint.part_ranges(key) or []]


def in_order(shape: torch.Size, dtype: torch.dtype, parts: list[Part]) -> list[Part] | None:
    """The parts in the tensor's byte order where they tile it exactly (:func:`layout`), else None."""
    placed = layout(torch.Size(shape), dtype, parts) if parts else None
    return None if placed is None else [part for part, _ in sorted(placed, key=lambda item: item[1])]


def _lead(placed: list[tuple[Part, int]]) -> int:
    """The tensor's address modulo the page size that lets the most bytes map their files: the residue most of the
    parts' bytes share (the parts of one shard share one; a tensor whose parts lie in two shards has two)."""
    by_residue: dict[int, int] = {}
    for part, at in placed:
        residue = (part.start - at) % PAGE
        by_residue[residue] = by_residue.get(residue, 0) + part.end - part.start
    return max(by_residue, key=lambda residue: (by_residue[residue], -residue))


def lead_of(shape: torch.Size, dtype: torch.dtype, parts: list[Part]) -> int | None:
    """The address modulo the page size a spliced ``shape`` tensor of ``parts`` gets (:func:`_lead`), or None where it
    is not spliced (its parts not a layout of the tensor)."""
    placed = layout(torch.Size(shape), dtype, parts) if parts else None
    return None if placed is None else _lead(placed)


def _mapped(part: Part, at: int, lead: int) -> tuple[int, int] | None:
    """The byte range ``[lo, hi)`` of a tensor at an address ``lead`` past a page boundary whose pages can map the
    part's file, or None where none can (the part falls otherwise in its pages, or holds no whole page)."""
    a, b = lead + at, lead + at + part.end - part.start
    lo, hi = -(-a // PAGE) * PAGE, b // PAGE * PAGE
    return (lo - lead, hi - lead) if (part.start - at) % PAGE == lead and hi > lo else None


def copied_bytes(shape: torch.Size, dtype: torch.dtype, parts: list[Part]) -> int:
    """Bytes of a spliced ``shape`` tensor that are copies, held in anonymous memory for as long as the tensor lives:
    each mapped part's edges, and whole the parts that fall otherwise in their pages than the most bytes do. 0 where
    it is not spliced (its parts not a layout of the tensor)."""
    placed = layout(torch.Size(shape), dtype, parts) if parts else None
    if placed is None:
        return 0
    lead, copied = _lead(placed), 0
    for part, at in placed:
        mapped = _mapped(part, at, lead)
        copied += part.end - part.start - (mapped[1] - mapped[0] if mapped is not None else 0)
    return copied


class Spliced:
    """A ``shape`` tensor over a private mapping in which each part's whole pages map its file, copy-on-write.

    The mapping starts where most of the parts' bytes fall in their pages (:func:`_lead`), so that every part whose
    file offset falls alike (all parts of one shard) maps its interior pages; the bytes of a part's first and last
    page, and a part that falls otherwise (a tensor whose parts lie in two shards), are copied once (anonymous
    memory, :func:`copied_bytes`: the plan holds them back from the cpu budget).
    Build with :meth:`build`, which answers None where this cannot be done (off Linux, the parts not a
    layout of the tensor).
    """

    def __init__(self, shape: torch.Size, dtype: torch.dtype, placed: list[tuple[Part, int]]) -> None:
        self.shape, self.dtype = torch.Size(shape), dtype
        self.nbytes = self.shape.numel() * dtype.itemsize
        self.lead = _lead(placed)  # the tensor's address modulo the page size
        self.map = map_anonymous(self.lead + self.nbytes)
        self.address = address(self.map) + self.lead
        lib, fn = libc(), _mmap_fn()
        lib.madvise(self.address - self.lead, self.lead + self.nbytes, _MADV_NOHUGEPAGE)
        self.pieces: list[Piece] = []
        for part, at in placed:
            mapped = _mapped(part, at, self.lead)
            if mapped is not None:
                lo, hi = self.address + mapped[0], self.address + mapped[1]
                fd = os.open(part.path, os.O_RDONLY)
                try:
                    got = fn(
                        lo,
                        hi - lo,
                        _PROT_READ | _PROT_WRITE,
                        _MAP_PRIVATE | _MAP_FIXED,
                        fd,
                        part.start + mapped[0] - at,
                    )
                finally:
                    os.close(fd)
                mapped = mapped if got == lo else None
                if mapped is not None:  # its file's pages, for as long as self.map is mapped
                    register_file_pages(self.map, self.lead + mapped[0], self.lead + mapped[1])
            self.pieces.append(Piece(part, at, mapped))
        with torch.inference_mode(False):  # kept across calls: a normal tensor
            self.tensor = view(self.map, dtype, self.shape, self.lead)

    @classmethod
    def build(cls, shape: torch.Size, dtype: torch.dtype, parts: list[Part]) -> Spliced | None:
        placed = layout(torch.Size(shape), dtype, parts) if parts else None
        if placed is None or libc() is None or _mmap_fn() is None:
            return None
        return cls(shape, dtype, placed)

    def copy_edges(self, sources: list[torch.Tensor]) -> None:
        """Copy the bytes that are not mapped (each part's edge pages, or all of it) from ``sources`` (the parts'
        own views, in the order of the parts)."""
        flat = self.tensor.view(-1).view(torch.uint8)
        for piece, source in zip(self.pieces, sources):
            data = source.reshape(-1).view(torch.uint8)
            size = piece.part.end - piece.part.start
            if piece.mapped is None:
                flat[piece.at : piece.at + size].copy_(data)
                continue
            lo, hi = piece.mapped
            flat[piece.at : lo].copy_(data[: lo - piece.at])
            flat[hi : piece.at + size].copy_(data[hi - piece.at :])

    def ranges(self, start: int, end: int) -> list[tuple[Path, int, int]]:
        """The file byte ranges that hold the tensor's bytes ``[start, end)``: (file, start, end) per part touched."""
        found = []
        for piece in self.pieces:
            size = piece.part.end - piece.part.start
            lo, hi = max(start, piece.at), min(end, piece.at + size)
            if lo < hi:
                found.append((piece.part.path, piece.part.start + lo - piece.at, piece.part.start + hi - piece.at))
        return found

    def mapped_spans(self) -> list[Span]:
        """The file-backed page ranges, one per mapped part."""
        return [
            Span(self.address + lo, hi - lo, p.part.path, p.part.start + lo - p.at, p.part.start + hi - p.at)
            for p in self.pieces
            if (p.mapped is not None)
            for lo, hi in [p.mapped]
        ]
