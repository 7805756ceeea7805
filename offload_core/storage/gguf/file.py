"""One GGUF file: its header parsed and checked (every tensor's type known and its bytes inside the
file), its tensors' quantized blocks zero-copy views of a private map of the file."""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from offload_core.errors import CheckpointError
from offload_core.storage.gguf.dequant import block_shape, check_supported, type_name

__all__ = ["GGUFEntry", "GGUFFile"]


@dataclass(frozen=True)
class GGUFEntry:
    """One tensor of a GGUF file: its GGML type, shape (numpy order, as gguf-py reads it), and where its bytes lie."""

    name: str
    kind: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def type_name(self) -> str:
        return type_name(self.kind)


class _Truncated(Exception):
    """The header ends before what it declares."""


#: GGUF metadata value type -> struct format of one value (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class _Cursor:
    """Reads a GGUF header's little-endian values from a mapped file, checking every read against its end."""

    def __init__(self, data: Any) -> None:
        self.data = data
        self.at = 4

    def unpack(self, fmt: str) -> Any:
        width = struct.calcsize(fmt)
        if self.at + width > len(self.data):
            raise _Truncated(f"at byte {self.at}")
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += width
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        if self.at + length > len(self.data):
            raise _Truncated(f"a string of {length} bytes at byte {self.at}")
        raw = self.data[self.at : self.at + length]
        self.at += length
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        """Past ``count`` strings, each checked to lie inside the data as :meth:`string` checks it."""
        data, at, end, length_of = self.data, self.at, len(self.data), struct.Struct("<Q").unpack_from
        for _ in range(count):
            if at + 8 > end:
                raise _Truncated(f"at byte {at}")
            (length,) = length_of(data, at)
            at += 8
            if at + length > end:
                raise _Truncated(f"a string of {length} bytes at byte {at}")
            at += length
        self.at = at

    def value(self, kind: int, key: str) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == 8:
            return self.string()
        if kind == 9:
            inner, count = self.unpack("<I"), self.unpack("<Q")
            if inner in _SCALARS:  # numbers: skipped in one step (only their count matters here)
                width = struct.calcsize(_SCALARS[inner])
                if self.at + width * count > len(self.data):
                    raise _Truncated(f"array {key!r} of {count} values")
                values = struct.unpack_from(f"<{count}{_SCALARS[inner][1]}", self.data, self.at) if count < 64 else ()
                self.at += width * count
                return list(values) if count < 64 else count
            if inner == 8 and count >= 64:  # a tokenizer's strings: skipped one length at a time, none decoded
                self.skip_strings(count)
                return count
            items = [self.value(inner, key) for _ in range(count)]
            return items if count < 64 else count
        raise _Truncated(f"field {key!r} has unknown value type {kind}")


class GGUFFile:
    """A GGUF file read lazily: opening parses the header (metadata and tensor infos) and checks it; a tensor's bytes
    are read only when :meth:`raw` is used (a view of a ``MAP_PRIVATE`` map: pages from the page cache, writes never
    reach the file)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._mmap: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None
        self.entries: dict[str, GGUFEntry] = {}
        self.fields: dict[str, Any] = {}
        self.architecture = ""
        self._parse()

    def _fail(self, problem: str, remedy: str = "re-download or re-convert the GGUF file") -> CheckpointError:
        return CheckpointError(f"{self.path} {problem}; {remedy}")

    def _parse(self) -> None:
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as handle:
                head = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except (OSError, ValueError) as error:
            raise self._fail(f"cannot be read ({getattr(error, 'strerror', None) or error})", "check the path")
        if head[:4] != b"GGUF":
            raise self._fail(f"is not a GGUF file (it opens with {bytes(head[:4])!r}, not b'GGUF')")
        try:
            self._read_header(_Cursor(head), size)
        except _Truncated as error:
            raise self._fail(f"is truncated or damaged ({size} bytes; its header ends early: {error})") from None
        finally:
            if isinstance(head, mmap.mmap):
                head.close()

    def _read_header(self, cursor: "_Cursor", size: int) -> None:
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise self._fail(f"has GGUF version {version}; only versions 2 and 3 are read")
        tensors, fields = cursor.unpack("<Q"), cursor.unpack("<Q")
        if tensors > size // 24 or fields > size // 12:
            raise self._fail(
                f"is truncated or damaged: its header declares {tensors} tensors and {fields} fields in {size} bytes"
            )
        for _ in range(fields):
            key = cursor.string()
            self.fields[key] = cursor.value(cursor.unpack("<I"), key)
        self.architecture = str(self.fields.get("general.architecture") or "")
        infos = []
        for _ in range(tensors):
            name = cursor.string()
            dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
            infos.append((name, tuple(reversed(dims)), cursor.unpack("<I"), cursor.unpack("<Q")))
        alignment = self.fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0:
            raise self._fail(f"is damaged: general.alignment is {alignment!r}")
        start = -(-cursor.at // alignment) * alignment
        for name, shape, kind, offset in infos:
            if name in self.entries:
                raise self._fail(f"holds tensor {name!r} twice")
            check_supported(kind, name)
            elements, block_bytes = block_shape(kind)
            numel = 1
            for dim in shape:
                numel *= dim
            if numel % elements:
                raise self._fail(f"has tensor {name!r} of {numel} elements, not whole {type_name(kind)} blocks")
            nbytes = numel // elements * block_bytes
            if start + offset + nbytes > size:
                raise self._fail(
                    f"is truncated: tensor {name!r} ({type_name(kind)}, {nbytes} bytes at offset "
                    f"{start + offset}) ends past the end of the file ({size} bytes)"
                )
            self.entries[name] = GGUFEntry(name, kind, shape, start + offset, nbytes)

    def field(self, key: str) -> Any:
        """The value of metadata field ``key`` (a string, number or list), or None when the file has none."""
        return self.fields.get(key)

    def _map(self) -> torch.Tensor:
        if self._bytes is None:
            with open(self.path, "rb") as handle:
                self._mmap = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            self._bytes = torch.frombuffer(self._mmap, dtype=torch.uint8)
        return self._bytes

    def raw(self, name: str) -> torch.Tensor:
        """The bytes of tensor ``name`` as a uint8 view of the mapped file (nothing is read until it is used)."""
        entry = self.entries[name]
        return self._map()[entry.offset : entry.offset + entry.nbytes]

    def file_of(self, name: str) -> Path:
        """The file tensor ``name`` lies in: this one (a split model's: :mod:`offload_core.storage.gguf.split`)."""
        return self.path

    def stored_bytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries.values())

    def close(self) -> None:
        """Forget the map (views handed out keep it alive until they are dropped)."""
        self._bytes = None
        self._mmap = None
