"""A diffusers pipeline folder's weights read as one checkpoint: every component's tensors under
``<component>.<name>``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from offload_core.loading.checkpoint import Checkpoint

#: a component's weight files, most specific first (a folder may also hold variants such as ``*.fp16.safetensors``)
WEIGHT_NAMES = (
    "diffusion_pytorch_model.safetensors.index.json",
    "model.safetensors.index.json",
    "diffusion_pytorch_model.safetensors",
    "model.safetensors",
)


def open_component(folder: Path) -> Checkpoint:
    """The checkpoint of one component folder: its un-suffixed weights where a folder also holds variants."""
    for name in WEIGHT_NAMES:
        if (folder / name).is_file():
            return Checkpoint.open(folder / name)
    return Checkpoint.open(folder)


class _PrefixedFile:
    """A component shard's :class:`SafetensorsFile` answered under the pipeline's names (``<component>.<name>``)."""

    def __init__(self, file: Any, prefix: str) -> None:
        self._file = file
        self._cut = len(prefix) + 1

    def byte_range(self, name: str) -> tuple[int, int]:
        return self._file.byte_range(name[self._cut :])

    def get(self, name: str) -> torch.Tensor:
        return self._file.get(name[self._cut :])

    def dtype(self, name: str) -> torch.dtype:
        return self._file.dtype(name[self._cut :])

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file.shape(name[self._cut :])

    def nbytes(self, name: str) -> int:
        return self._file.nbytes(name[self._cut :])

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._file, attribute)


class PipelineCheckpoint(Checkpoint):
    """The components' checkpoints (``components``: component name -> :class:`Checkpoint`) as one, keys prefixed by
    component; tensors are the components' own zero-copy views, so every store reads them in place."""

    def __init__(self, root: Path, parts: dict[str, Checkpoint]) -> None:
        files = [file for part in parts.values() for file in part.files]
        key_files = {f"{name}.{key}": part.file_of(key) for name, part in parts.items() for key in part.keys()}
        super().__init__(root, root, files, key_files, None, all(p.is_safetensors for p in parts.values()))
        self.components = parts
        self._owner = {file: name for name, part in parts.items() for file in part.files}

    @classmethod
    def open_components(cls, root: Path, components: list[str]) -> PipelineCheckpoint:
        parts: dict[str, Checkpoint] = {}
        try:
            for name in components:
                parts[name] = open_component(root / name)
        except BaseException:
            for part in parts.values():
                part.close()
            raise
        return cls(root, parts)

    def _split(self, key: str) -> tuple[Checkpoint, str]:
        prefix, _, raw = key.partition(".")
        part = self.components.get(prefix)
        if part is None:
            raise KeyError(f"{key!r} is not a tensor of pipeline {self.root}")
        return part, raw

    def shards(self) -> list[tuple[Path, list[str]]]:
        return [
            (file, [f"{name}.{key}" for key in keys])
            for name, part in self.components.items()
            for file, keys in part.shards()
        ]

    def safetensors_file(self, path: Any) -> Any:
        name = self._owner[Path(path)]
        return _PrefixedFile(self.components[name].safetensors_file(path), name)

    def file_of(self, key: str) -> Path:
        part, raw = self._split(key)
        return part.file_of(raw)

    def get(self, key: str) -> torch.Tensor:
        part, raw = self._split(key)
        return part.get(raw)

    def dtype(self, key: str) -> torch.dtype:
        part, raw = self._split(key)
        return part.dtype(raw)

    def shape(self, key: str) -> tuple[int, ...]:
        part, raw = self._split(key)
        return part.shape(raw)

    def nbytes(self, key: str) -> int:
        part, raw = self._split(key)
        return part.nbytes(raw)

    def fingerprint(self) -> dict[str, Any]:
        return {
            "path": str(self.root.resolve()),
            "components": {name: part.fingerprint() for name, part in self.components.items()},
        }

    def close(self) -> None:
        for part in self.components.values():
            part.close()

    def __repr__(self) -> str:
        return f"PipelineCheckpoint({str(self.root)!r}, components {', '.join(self.components)})"
