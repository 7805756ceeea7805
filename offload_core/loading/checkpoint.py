"""Read a local checkpoint lazily: a Hugging Face folder (sharded index or loose shards) or one file, safetensors or
legacy ``.bin`` (plain tensors only)."""

from __future__ import annotations

import json
import os
import pickle
import weakref
from pathlib import Path, PurePosixPath
from typing import Any, Callable, TypeVar

import torch
import xxhash

from offload_core.errors import CheckpointError
from offload_core.loading.safetensors_file import MAX_HEADER_BYTES, SAFETENSORS_DTYPES, SafetensorsFile

__all__ = ["SAFETENSORS_DTYPES", "SafetensorsFile", "Checkpoint"]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"

T = TypeVar("T")


def _header_digest(file: Path) -> str:
    """xxh3-128 of a file's head: a safetensors file's whole header (8-byte length and JSON), else its first 64 KiB."""
    try:
        with open(file, "rb") as handle:
            head = handle.read(8)
            length = int.from_bytes(head, "little") if file.suffix == ".safetensors" and len(head) == 8 else 65536 - 8
            head += handle.read(min(length, MAX_HEADER_BYTES))
    except OSError as error:
        raise CheckpointError(
            f"cannot read {file}: {error.strerror or error}; check the path and its permissions"
        ) from None
    return xxhash.xxh3_128_hexdigest(head)


def _is_shard_name(name: object) -> bool:
    """Whether an index's shard ``name`` is a file name inside the checkpoint folder: relative, with no ``..`` and
    naming a file, not the folder (``a.safetensors``, ``sub/a.safetensors``).

    The file itself may be a symlink that leads anywhere readable (the Hugging Face cache's snapshot folders link
    every file into ``../../blobs/``): a checkpoint is only ever read, and its folder's owner made its links.
    """
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        return False
    parts = PurePosixPath(name).parts
    return not PurePosixPath(name).is_absolute() and ".." not in parts and parts not in ((), (".",))


def _head(shard: Path) -> bytes:
    try:
        with open(shard, "rb") as handle:
            return handle.read(2)
    except OSError:
        return b""


def _opens_like_weights(head: bytes) -> bool:
    """Whether a file's first two bytes open like a torch file: a zip archive, or a pickle protocol byte."""
    return head == b"PK" or (len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def _is_pickle(shard: Path, error: pickle.UnpicklingError) -> bool:
    """Whether an unpickling refusal came from a real pickle (a zip archive, or a pickle stream refused for what
    it holds) rather than from bytes that are no pickle at all."""
    head = _head(shard)
    return head == b"PK" or (_opens_like_weights(head) and "Weights only load failed" in str(error))


def _not_weights(shard: Path) -> CheckpointError:
    return CheckpointError(
        f"{shard} is not a PyTorch weights file (neither a torch zip archive nor a pickle); "
        "re-download or re-convert the checkpoint"
    )


class Checkpoint:
    """A local checkpoint (Hugging Face folder layout or a single file) read lazily, shard by shard.

    Opening reads only headers / indexes, never tensor data. Build one with :meth:`open`. It meets the contract
    :class:`offload_core.storage.checkpoint.Checkpoint`.
    """

    #: a GGUF file (:class:`~offload_core.loading.gguf_checkpoint.GGUFCheckpoint` says so)
    is_gguf: bool = False
    #: keys built on read from tensors of other names: none here (a converted checkpoint's are its conversion's)
    conversion_targets: frozenset[str] = frozenset()

    def __init__(
        self,
        path: Path,
        root: Path,
        files: list[Path],
        key_files: dict[str, Path],
        index_file: Path | None,
        is_safetensors: bool,
    ) -> None:
        self.path = path
        self.root = root
        self.files = files
        self.index_file = index_file
        self.is_safetensors = is_safetensors
        self._key_files = key_files
        self._safetensors: dict[Path, SafetensorsFile] = {}
        self._bin: dict[Path, dict[str, torch.Tensor]] = {}
        self._worked_out: dict[tuple[str, int], tuple[weakref.ref, Any]] = {}

    # -- opening --------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """Open a checkpoint directory, a ``.safetensors`` file, a ``.bin`` file, an index ``.json`` or a GGUF file
        (:class:`~offload_core.loading.gguf_checkpoint.GGUFCheckpoint`)."""
        path = Path(path).expanduser()
        if not path.exists():
            raise CheckpointError(
                f"checkpoint {path} does not exist; give a checkpoint directory or a .safetensors, .bin or .gguf file"
            )
        from offload_core.loading.gguf_checkpoint import GGUFCheckpoint, find_gguf

        if find_gguf(path) is not None:  # a .gguf file, or a folder holding one and no Hugging Face weights
            return GGUFCheckpoint.open_gguf(find_gguf(path))
        if path.is_dir():
            return cls._open_dir(path)
        if not path.is_file():
            raise CheckpointError(
                f"checkpoint {path} is neither a directory nor a regular file; "
                "give a checkpoint directory or weights file"
            )
        if path.name.endswith(".index.json"):
            return cls._from_index(path, path, path.parent, safetensors=path.name.endswith(".safetensors.index.json"))
        if path.suffix == ".safetensors":
            return cls._from_safetensors_files(path, path.parent, [path])
        if path.suffix in (".bin", ".pt", ".pth"):
            return cls._from_bin_files(path, path.parent, [path])
        raise CheckpointError(
            f"checkpoint file {path} is not a .safetensors, .bin or *.index.json file; give one of those or a directory"
        )

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
                f"{index_file} is not a valid index: expected JSON with a 'weight_map' object; "
                "re-download the checkpoint"
            ) from None
        shard_names = sorted(set(weight_map.values()))
        files = []
        for name in shard_names:
            if not _is_shard_name(name):
                raise CheckpointError(
                    f"{index_file.name} in {root} names shard {name!r}, which is not a file inside that folder; "
                    "fix the index's weight_map (shard names are file names in the checkpoint folder)"
                )
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
        except pickle.UnpicklingError as error:
            if not _is_pickle(shard, error):
                raise _not_weights(shard) from None
            raise CheckpointError(
                f"{shard} contains Python objects beyond tensors; refusing to unpickle it (it could run code). "
                "Convert it to safetensors with a tool you trust"
            ) from None
        except Exception as error:  # noqa: BLE001 - torch raises many types for corrupt files
            if not _opens_like_weights(_head(shard)):
                raise _not_weights(shard) from None
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise CheckpointError(f"cannot read {shard}: {message}; re-download or re-convert the checkpoint") from None
        if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
        ):
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

    def parts(self, key: str) -> list[tuple[Any, torch.Tensor]] | None:
        """None: every tensor is read whole (a converted checkpoint builds some from parts)."""
        return None

    def fills(self, key: str) -> bool:
        """False: a tensor is read whole and copied (a GGUF checkpoint fills the caller's memory itself)."""
        return False

    def part_ranges(self, key: str) -> list[tuple[Any, Path, int, int]] | None:
        """None: no tensor is built from parts."""
        return None

    def total_bytes(self) -> int:
        return sum(self.nbytes(key) for key in self._key_files)

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this checkpoint's content without reading its data: per file (index included) its
        name, size, inode, mtime and ctime (a rewrite changes the ctime even where the mtime is set back) and
        a digest of its header (for safetensors: the header naming every tensor, its dtype, shape and offsets).

        The offloaded copies' own bytes are checked separately, by the store's checksums.
        """
        files = list(self.files) + ([self.index_file] if self.index_file is not None else [])
        entries = []
        for file in files:
            stat = file.stat()
            try:
                name = file.relative_to(self.root).as_posix()
            except ValueError:
                name = str(file)
            entries.append(
                {
                    "name": name,
                    "size": stat.st_size,
                    "inode": stat.st_ino,
                    "mtime_ns": stat.st_mtime_ns,
                    "ctime_ns": stat.st_ctime_ns,
                    "header": _header_digest(file),
                }
            )
        return {"path": str(self.root.resolve()), "files": entries}

    def worked_out(self, what: str, model: Any, make: Callable[[], T]) -> T:
        """``make()``: what is worked out of this checkpoint's headers for ``model`` (``what`` names it, e.g. its key
        conversion), once per model while the checkpoint is open, however many steps (task check, reservation, plan,
        dispatch) ask for it."""
        key = (what, id(model))
        held = self._worked_out.get(key)
        if held is None or held[0]() is not model:
            held = (weakref.ref(model), make())
            self._worked_out[key] = held
        return held[1]

    def close(self) -> None:
        self._worked_out.clear()
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
