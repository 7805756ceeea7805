"""Read checkpoints safely and without copying (safetensors through a private mmap, legacy .bin only as plain tensors), and write sharded safetensors atomically."""

from __future__ import annotations

import json
import math
import mmap
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from offload_core.errors import CheckpointError
from offload_core.atomic import fsync_path

__all__ = [
    "SAFETENSORS_DTYPES",
    "SafetensorsFile",
    "Checkpoint",
    "write_sharded_safetensors",
]

#: Largest header we accept; real headers are a few hundred KB even for huge models.
MAX_HEADER_BYTES = 100 * 1000 * 1000

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"
BIN_WEIGHTS_NAME = "pytorch_model.bin"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"


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
    returned tensor changes only this process's copy, never the file. Each returned tensor holds a
    reference to the map, so it stays valid after :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._mmap: mmap.mmap | None = None
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
                    raise self._fail(f"is truncated: it has {size} bytes, fewer than the 8-byte safetensors header length")
                header_len = int.from_bytes(prefix, "little")
                if header_len > MAX_HEADER_BYTES or header_len > size - 8:
                    raise self._fail(
                        f"is not a valid safetensors file: its header claims {header_len} bytes but the file has "
                        f"{size} bytes (header limit {MAX_HEADER_BYTES})"
                    )
                raw = handle.read(header_len)
        except OSError as error:
            raise CheckpointError(f"cannot read {self.path}: {error.strerror or error}; check the path and its permissions") from None
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
                raise self._fail(f"is truncated: tensor {key!r} ends at byte {self._data_start + end} but the file has {size} bytes")
            self._entries[key] = (dtype, shape, begin, end)
            spans.append((begin, end, key))
        spans.sort()
        for (_, prev_end, prev_key), (begin, end, key) in zip(spans, spans[1:]):
            if begin < prev_end and end > begin:
                raise self._fail(f"is corrupt: tensors {prev_key!r} and {key!r} overlap (bytes {begin} < {prev_end})")

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
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise self._fail(f"is corrupt: tensor {key!r} has shape {shape!r}, not a list of non-negative ints")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise self._fail(f"is corrupt: tensor {key!r} has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end")
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

    def _map(self) -> mmap.mmap:
        if self._mmap is None:
            try:
                with open(self.path, "rb") as handle:
                    self._mmap = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError) as error:
                raise CheckpointError(f"cannot map {self.path}: {error}; check that the file is readable") from None
        return self._mmap

    def get(self, key: str) -> torch.Tensor:
        """A zero-copy CPU view of ``key`` (writable, but writes stay private to this process)."""
        dtype, shape, begin, end = self._entry(key)
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        count = math.prod(shape)
        return torch.frombuffer(self._map(), dtype=dtype, count=count, offset=self._data_start + begin).view(shape)

    def close(self) -> None:
        """Drop this object's reference to the map; it is unmapped once no returned tensor uses it.

        ``torch.frombuffer`` keeps a reference to the mmap object but no buffer export, so calling
        ``mmap.close()`` here would unmap pages under live tensors (a segfault on the next read).
        """
        self._mmap = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self._entries)} tensors)"


class Checkpoint:
    """A local checkpoint (Hugging Face folder layout or a single file) read lazily, shard by shard.

    Opening reads only headers / indexes, never tensor data. Build one with :meth:`open`.
    """

    def __init__(self, path: Path, root: Path, files: list[Path], key_files: dict[str, Path],
                 index_file: Path | None, is_safetensors: bool) -> None:
        self.path = path
        self.root = root
        self.files = files
        self.index_file = index_file
        self.is_safetensors = is_safetensors
        self._key_files = key_files
        self._safetensors: dict[Path, SafetensorsFile] = {}
        self._bin: dict[Path, dict[str, torch.Tensor]] = {}

    # -- opening --------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """Open a checkpoint directory, a ``.safetensors`` file, a ``.bin`` file or an index ``.json``."""
        path = Path(path).expanduser()
        if not path.exists():
            raise CheckpointError(f"checkpoint {path} does not exist; give a checkpoint directory or a .safetensors/.bin file")
        if path.is_dir():
            return cls._open_dir(path)
        if not path.is_file():
            raise CheckpointError(f"checkpoint {path} is neither a directory nor a regular file; give a checkpoint directory or weights file")
        if path.name.endswith(".index.json"):
            return cls._from_index(path, path, path.parent, safetensors=path.name.endswith(".safetensors.index.json"))
        if path.suffix == ".safetensors":
            return cls._from_safetensors_files(path, path.parent, [path])
        if path.suffix in (".bin", ".pt", ".pth"):
            return cls._from_bin_files(path, path.parent, [path])
        raise CheckpointError(f"checkpoint file {path} is not a .safetensors, .bin or *.index.json file; give one of those or a directory")

    @classmethod
    def _open_dir(cls, root: Path) -> Checkpoint:
        if (root / SAFE_INDEX_NAME).is_file():
            return cls._from_index(root, root / SAFE_INDEX_NAME, root, safetensors=True)
        safe = sorted(p for p in root.glob("*.safetensors") if p.is_file())
        if safe:
            return cls._from_safetensors_files(root, root, safe)
        if (root / BIN_INDEX_NAME).is_file():
            return cls._from_index(root, root / BIN_INDEX_NAME, root, safetensors=False)
        bins = sorted(p for p in root.glob("pytorch_model*.bin") if p.is_file())
        if bins:
            return cls._from_bin_files(root, root, bins)
        raise CheckpointError(
            f"no weights found in {root}: expected {SAFE_INDEX_NAME}, *.safetensors, {BIN_INDEX_NAME} or "
            "pytorch_model*.bin; point to the folder that holds the model's weight files"
        )

    @classmethod
    def _from_index(cls, path: Path, index_file: Path, root: Path, safetensors: bool) -> Checkpoint:
        try:
            index = json.loads(index_file.read_text(encoding="utf-8"))
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(
                f"{index_file} is not a valid index: expected JSON with a 'weight_map' object; re-download the checkpoint"
            ) from None
        shard_names = sorted(set(weight_map.values()))
        files = []
        for name in shard_names:
            shard = root / name
            if not shard.is_file():
                count = sum(1 for v in weight_map.values() if v == name)
                raise CheckpointError(
                    f"{index_file.name} in {root} names shard {name} ({count} tensors) but the file is missing; "
                    "download the missing shard or re-convert the checkpoint"
                )
            files.append(shard)
        key_files = {key: root / name for key, name in weight_map.items()}
        ckpt = cls(path, root, files, key_files, index_file, safetensors)
        if safetensors:
            for key, shard in key_files.items():
                if key not in ckpt.safetensors_file(shard):
                    raise CheckpointError(
                        f"{index_file.name} in {root} maps {key!r} to {shard.name}, which has no such tensor; "
                        "the index and shards do not match: re-download the checkpoint"
                    )
        return ckpt

    @classmethod
    def _from_safetensors_files(cls, path: Path, root: Path, files: list[Path]) -> Checkpoint:
        ckpt = cls(path, root, files, {}, None, True)
        for shard in files:
            for key in ckpt.safetensors_file(shard).keys():
                ckpt._add_key(key, shard)
        return ckpt

    @classmethod
    def _from_bin_files(cls, path: Path, root: Path, files: list[Path]) -> Checkpoint:
        ckpt = cls(path, root, files, {}, None, False)
        for shard in files:
            for key in ckpt._load_bin(shard):
                ckpt._add_key(key, shard)
        return ckpt

    def _add_key(self, key: str, shard: Path) -> None:
        other = self._key_files.get(key)
        if other is not None:
            raise CheckpointError(
                f"tensor {key!r} is in both {other.name} and {shard.name} under {self.root}; "
                "remove the stray file or add an index that says which shard to use"
            )
        self._key_files[key] = shard

    def _load_bin(self, shard: Path) -> dict[str, torch.Tensor]:
        loaded = self._bin.get(shard)
        if loaded is not None:
            return loaded
        try:
            try:
                state = torch.load(shard, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as error:
                if "mmap" not in str(error):
                    raise
                # Files in torch's legacy (pre-zip) format cannot be mapped; still load them as weights only.
                state = torch.load(shard, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise CheckpointError(
                f"{shard} contains Python objects beyond tensors; refusing to unpickle it (it could run code). "
                "Convert it to safetensors with a tool you trust"
            ) from None
        except Exception as error:  # noqa: BLE001 - torch raises many types for corrupt files
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise CheckpointError(f"cannot read {shard}: {message}; re-download or re-convert the checkpoint") from None
        if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
            raise CheckpointError(
                f"{shard} is not a flat state dict of tensors (got {type(state).__name__}); "
                "save model.state_dict() or convert the checkpoint to safetensors"
            )
        self._bin[shard] = state
        return state

    # -- queries --------------------------------------------------------------------------------
    def safetensors_file(self, path: str | os.PathLike[str]) -> SafetensorsFile:
        """The (cached) :class:`SafetensorsFile` for one shard."""
        path = Path(path)
        cached = self._safetensors.get(path)
        if cached is None:
            cached = self._safetensors[path] = SafetensorsFile(path)
        return cached

    def shards(self) -> list[tuple[Path, list[str]]]:
        """``(file, keys)`` per shard in file order; keys in the order their bytes lie in the file."""
        by_file: dict[Path, list[str]] = {shard: [] for shard in self.files}
        for key, shard in self._key_files.items():
            by_file[shard].append(key)
        result = []
        for shard in self.files:
            keys = by_file[shard]
            if self.is_safetensors:
                order = {k: i for i, k in enumerate(self.safetensors_file(shard).keys())}
                keys.sort(key=order.__getitem__)
            result.append((shard, keys))
        return result

    def keys(self) -> list[str]:
        return [key for _, keys in self.shards() for key in keys]

    def __contains__(self, key: object) -> bool:
        return key in self._key_files

    def __len__(self) -> int:
        return len(self._key_files)

    def file_of(self, key: str) -> Path:
        try:
            return self._key_files[key]
        except KeyError:
            raise KeyError(f"{key!r} is not a tensor of checkpoint {self.path}") from None

    def get(self, key: str) -> torch.Tensor:
        """The tensor ``key``: a zero-copy mmap view for safetensors, an mmap'd ``torch.load`` tensor for .bin."""
        shard = self.file_of(key)
        if self.is_safetensors:
            return self.safetensors_file(shard).get(key)
        return self._load_bin(shard)[key]

    def dtype(self, key: str) -> torch.dtype:
        shard = self.file_of(key)
        return self.safetensors_file(shard).dtype(key) if self.is_safetensors else self._load_bin(shard)[key].dtype

    def shape(self, key: str) -> tuple[int, ...]:
        shard = self.file_of(key)
        if self.is_safetensors:
            return self.safetensors_file(shard).shape(key)
        return tuple(self._load_bin(shard)[key].shape)

    def nbytes(self, key: str) -> int:
        shard = self.file_of(key)
        if self.is_safetensors:
            return self.safetensors_file(shard).nbytes(key)
        tensor = self._load_bin(shard)[key]
        return tensor.numel() * tensor.element_size()

    def total_bytes(self) -> int:
        return sum(self.nbytes(key) for key in self._key_files)

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this checkpoint's content cheaply: each file's name, size and mtime (index included)."""
        files = list(self.files) + ([self.index_file] if self.index_file is not None else [])
        entries = []
        for file in files:
            stat = file.stat()
            try:
                name = file.relative_to(self.root).as_posix()
            except ValueError:
                name = str(file)
            entries.append({"name": name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
        return {"path": str(self.root.resolve()), "files": entries}

    def close(self) -> None:
        for file in self._safetensors.values():
            file.close()
        self._safetensors.clear()
        self._bin.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "safetensors" if self.is_safetensors else "bin"
        return f"Checkpoint({str(self.path)!r}, {len(self.files)} {kind} file(s), {len(self._key_files)} tensors)"


# -- writing -------------------------------------------------------------------------------------

def plan_shards(sizes: Iterable[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Split ``(name, nbytes)`` in order into shards of at most ``max_shard_size`` bytes (a larger tensor gets its own)."""
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, nbytes in sizes:
        if current and used + nbytes > max_shard_size:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def write_safetensors_shards(
    directory: str | os.PathLike[str],
    shards: list[list[str]],
    produce: Callable[[str], torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    extra_index_metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``shards`` (lists of names) as HF-layout safetensors, asking ``produce(name)`` for one shard's tensors at a time.

    Files are written and fsynced in a temp dir next to ``directory``, then moved into place: the whole
    dir is renamed when ``directory`` does not exist yet, otherwise file by file with the index last.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    if directory.exists():
        if not directory.is_dir():
            raise CheckpointError(f"{directory} exists and is not a directory; choose a directory to write the checkpoint into")
        clash = [p.name for p in directory.iterdir() if p.suffix == ".safetensors" or p.name == SAFE_INDEX_NAME]
        if clash:
            raise CheckpointError(f"{directory} already holds weights ({clash[0]}); write into an empty or new directory")
    directory.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", **(metadata or {})}
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        count = len(shards)
        names = [SAFE_WEIGHTS_NAME] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        weight_map: dict[str, str] = {}
        total = 0
        for file_name, keys in zip(names, shards):
            tensors = {}
            for key in keys:
                tensor = produce(key).detach()
                if tensor.device.type != "cpu":
                    tensor = tensor.cpu()
                tensors[key] = tensor.contiguous()
                total += tensor.numel() * tensor.element_size()
                weight_map[key] = file_name
            save_file(tensors, str(tmp / file_name), metadata=meta)
            del tensors
            fsync_path(tmp / file_name)
        written = list(names)
        if count > 1:
            index = {"metadata": {"total_size": total, **(extra_index_metadata or {})}, "weight_map": weight_map}
            (tmp / SAFE_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            fsync_path(tmp / SAFE_INDEX_NAME)
            written.append(SAFE_INDEX_NAME)
        fsync_path(tmp)
        if not directory.exists():
            os.rename(tmp, directory)
        else:
            for name in written:  # index last: a reader never sees an index naming absent shards
                os.replace(tmp / name, directory / name)
            tmp.rmdir()
            fsync_path(directory)
        fsync_path(directory.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def write_sharded_safetensors(
    state_dict: Mapping[str, torch.Tensor],
    directory: str | os.PathLike[str],
    max_shard_size: int,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``state_dict`` to ``directory`` as ``model-0000i-of-0000N.safetensors`` + index (or one ``model.safetensors``).

    Tensors that share storage as the same view (tied weights) are written once, under their first
    name; the others are left out of the files (the index's metadata lists them under ``"tied"``, and
    a single file's safetensors metadata under ``"offload_core.tied"``) and the loader reties them
    from the model's tied parameters. Writing is atomic (see :func:`write_safetensors_shards`).
    """
    if max_shard_size <= 0:
        raise CheckpointError(f"max_shard_size={max_shard_size} must be positive; give a size in bytes")
    kept: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"state_dict entry {name!r} is a {type(tensor).__name__}, not a tensor; pass tensors only")
        if tensor.device.type == "meta":
            raise CheckpointError(f"state_dict entry {name!r} is on the meta device and has no data; load its weights first")
        if tensor.numel():
            ident = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                     tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
            first = seen.get(ident)
            if first is not None:
                tied[name] = first
                continue
            seen[ident] = name
        kept[name] = tensor
    # Distinct views of one storage cannot go through safetensors as they are: give each its own copy.
    storages: dict[tuple, str] = {}
    for name, tensor in list(kept.items()):
        if tensor.numel():
            key = (tensor.device, tensor.untyped_storage().data_ptr())
            if key in storages:
                kept[name] = tensor.clone()
            else:
                storages[key] = name
    shards = plan_shards(((n, t.numel() * t.element_size()) for n, t in kept.items()), max_shard_size)
    meta = dict(metadata or {})
    extra: dict[str, Any] = {}
    if tied:
        if len(shards) == 1:
            meta["offload_core.tied"] = json.dumps(tied, sort_keys=True)
        else:
            extra["tied"] = tied
    return write_safetensors_shards(directory, shards, kept.__getitem__, meta, extra)
