"""One ``.safetensors`` file: its header parsed and checked, its tensors zero-copy views of a private mmap."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from offload_core.errors import CheckpointError
from offload_core.storage.mapping import Mapping, map_file, view

__all__ = ["MAX_HEADER_BYTES", "SAFETENSORS_DTYPES", "SafetensorsFile"]

#: Largest header we accept; real headers are a few hundred KB even for huge models.
MAX_HEADER_BYTES = 100 * 1000 * 1000


def _dtype_table() -> dict[str, torch.dtype]:
    names = {
        "BOOL": "bool",
        "U8": "uint8",
        "I8": "int8",
        "I16": "int16",
        "U16": "uint16",
        "I32": "int32",
        "U32": "uint32",
        "I64": "int64",
        "U64": "uint64",
        "F16": "float16",
        "BF16": "bfloat16",
        "F32": "float32",
        "F64": "float64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
    }
    return {st: getattr(torch, name) for st, name in names.items() if hasattr(torch, name)}


#: safetensors dtype name -> torch dtype (only those this torch build has).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = _dtype_table()


class SafetensorsFile:
    """One ``.safetensors`` file: the header is parsed and checked here, tensors are zero-copy views of a private mmap.

    The map is ``ACCESS_COPY`` (``MAP_PRIVATE``): its pages come from the page cache, and writing to a
    returned tensor changes only this process's copy, never the file. Each returned tensor holds the
    map (:mod:`offload_core.storage.mapping`), so it stays valid after :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._mmap: Mapping | None = None
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        self.metadata: dict[str, str] = {}
        self._data_start = 0
        self._parse_header()

    # -- header ---------------------------------------------------------------------------------
    def _fail(self, problem: str, remedy: str = "re-download or re-convert the checkpoint") -> CheckpointError:
        return CheckpointError(f"{self.path} {problem}; {remedy}")

    def _parse_header(self) -> None:
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as handle:
                prefix = handle.read(8)
                if len(prefix) < 8:
                    raise self._fail(
                        f"is truncated: it has {size} bytes, fewer than the 8-byte safetensors header length"
                    )
                header_len = int.from_bytes(prefix, "little")
                if header_len > MAX_HEADER_BYTES or header_len > size - 8:
                    raise self._fail(
                        f"is not a valid safetensors file: its header claims {header_len} bytes but the file has "
                        f"{size} bytes (header limit {MAX_HEADER_BYTES})"
                    )
                raw = handle.read(header_len)
        except OSError as error:
            raise CheckpointError(
                f"cannot read {self.path}: {error.strerror or error}; check the path and its permissions"
            ) from None
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise self._fail(f"has a safetensors header that is not valid JSON ({error})") from None
        if not isinstance(header, dict):
            raise self._fail("has a safetensors header that is not a JSON object")
        self._data_start = 8 + header_len
        data_len = size - self._data_start
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise self._fail("has a __metadata__ entry that is not a JSON object")
        self.metadata = metadata
        spans = []
        for key, info in header.items():
            dtype, shape, begin, end = self._check_entry(key, info)
            if end > data_len:
                raise self._fail(
                    f"is truncated: tensor {key!r} ends at byte {self._data_start + end} but the file has {size} bytes"
                )
            self._entries[key] = (dtype, shape, begin, end)
            spans.append((begin, end, key))
        # Every pair, not only neighbours: each range against the furthest end seen so far (0-byte tensors
        # alias nothing and hide nothing, so they are left out of the comparison).
        furthest, furthest_key = 0, None
        for begin, end, key in sorted(span for span in spans if span[1] > span[0]):
            if begin < furthest:
                raise self._fail(
                    f"is corrupt: tensors {furthest_key!r} and {key!r} overlap (bytes {begin} < {furthest})"
                )
            furthest, furthest_key = end, key

    def _check_entry(self, key: str, info: Any) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise self._fail(f"is corrupt: header entry {key!r} lacks dtype, shape or data_offsets")
        name = info["dtype"]
        if name not in SAFETENSORS_DTYPES:
            raise self._fail(
                f"has tensor {key!r} of dtype {name!r}, which this torch build cannot read "
                f"(known: {', '.join(SAFETENSORS_DTYPES)})",
                "convert the checkpoint to a supported dtype or upgrade torch",
            )
        shape, offsets = info["shape"], info["data_offsets"]
        if not (
            isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise self._fail(f"is corrupt: tensor {key!r} has shape {shape!r}, not a list of non-negative ints")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise self._fail(
                f"is corrupt: tensor {key!r} has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end"
            )
        dtype = SAFETENSORS_DTYPES[name]
        itemsize = torch.empty((), dtype=dtype).element_size()
        expected = math.prod(shape) * itemsize
        if expected != offsets[1] - offsets[0]:
            raise self._fail(
                f"is corrupt: tensor {key!r} of shape {shape} and dtype {name} needs {expected} bytes "
                f"but its data_offsets span {offsets[1] - offsets[0]}"
            )
        return dtype, tuple(shape), offsets[0], offsets[1]

    # -- access ---------------------------------------------------------------------------------
    def _entry(self, key: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"{key!r} is not a tensor of {self.path}") from None

    def keys(self) -> list[str]:
        """Tensor names in the order their bytes lie in the file."""
        return sorted(self._entries, key=lambda k: (self._entries[k][2], k))

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def dtype(self, key: str) -> torch.dtype:
        return self._entry(key)[0]

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entry(key)[1]

    def nbytes(self, key: str) -> int:
        _, _, begin, end = self._entry(key)
        return end - begin

    def byte_range(self, key: str) -> tuple[int, int]:
        """``(start, end)`` of the tensor's bytes as absolute offsets in the file."""
        _, _, begin, end = self._entry(key)
        return self._data_start + begin, self._data_start + end

    def _map(self) -> Mapping:
        if self._mmap is None:
            try:
                self._mmap = map_file(self.path)
            except (OSError, ValueError) as error:
                raise CheckpointError(f"cannot map {self.path}: {error}; check that the file is readable") from None
        return self._mmap

    def get(self, key: str) -> torch.Tensor:
        """A zero-copy CPU view of ``key`` (writable, but writes stay private to this process)."""
        dtype, shape, begin, end = self._entry(key)
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        return view(self._map(), dtype, shape, self._data_start + begin)

    def close(self) -> None:
        """Drop this object's reference to the map; it is unmapped once no returned tensor uses it (never closed
        here: :mod:`offload_core.storage.mapping`)."""
        self._mmap = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self._entries)} tensors)"
