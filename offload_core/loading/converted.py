"""A checkpoint presented under a model's names (:class:`ConvertedCheckpoint`), from the
:class:`~offload_core.loading.conversion.KeyConversion` worked out for it."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload_core.loading.conversion import Index, KeyConversion, run_converter, key_conversion
from offload_core.storage.checkpoint import Checkpoint

__all__ = ["ConvertedCheckpoint", "convert_checkpoint"]


class _RenamedFile:
    """A shard's :class:`SafetensorsFile` answered under the model's names (byte ranges of renamed tensors)."""

    def __init__(self, file: Any, source: dict[str, str]) -> None:
        self._file = file
        self._source = source

    def byte_range(self, name: str) -> tuple[int, int]:
        return self._file.byte_range(self._source.get(name, name))

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._file, attribute)


class ConvertedCheckpoint:
    """A checkpoint read under the model's names: renamed tensors are the same views, converted ones are built.

    Shapes and dtypes come from headers (converted ones from transformers' operations run on meta
    tensors). ``get`` of a converted tensor materialises it with transformers' converter; stores that
    read in place use :meth:`parts` instead. Everything else is the wrapped checkpoint's.
    """

    def __init__(self, checkpoint: Checkpoint, conversion: KeyConversion, model: nn.Module) -> None:
        self.checkpoint = checkpoint
        self.conversion = conversion
        # Some operations read the model (a parameter's shape) or its config. A weak reference: the model's
        # store holds this checkpoint, and the model must still be freed as soon as it is dropped.
        self._model = weakref.ref(model)
        self._source = dict(conversion.renamed)
        consumed = set(conversion.renamed.values())
        for item in conversion.converted.values():
            consumed.update(item.sources)
        self._consumed = consumed
        self._shards: list[tuple[Path, list[str]]] | None = None
        #: names of tensors built from several checkpoint tensors (stores never copy these file to file)
        self.conversion_targets: frozenset[str] = frozenset(conversion.converted)

    def shards(self) -> list[tuple[Path, list[str]]]:
        """``(file, names)`` per shard; a converted tensor is listed with the shard of its last source."""
        if self._shards is None:
            underlying = self.checkpoint.shards()
            position = {key: (i, j) for i, (_, keys) in enumerate(underlying) for j, key in enumerate(keys)}
            built_at: dict[str, list[str]] = {}  # last source (in file order) -> converted tensors it completes
            for name, item in self.conversion.converted.items():
                built_at.setdefault(max(item.sources, key=position.__getitem__), []).append(name)
            renamed = {key: name for name, key in self._source.items()}
            self._shards = []
            for shard, keys in underlying:
                names = []
                for key in keys:
                    if key in renamed:
                        names.append(renamed[key])
                    elif key not in self._consumed:
                        names.append(key)
                    names.extend(built_at.get(key, ()))
                self._shards.append((shard, names))
        return self._shards

    def keys(self) -> list[str]:
        return [name for _, names in self.shards() for name in names]

    def __contains__(self, name: object) -> bool:
        return (
            name in self.conversion.converted
            or name in self._source
            or (name in self.checkpoint and name not in self._consumed)
        )

    def __len__(self) -> int:
        return len(self.keys())

    def _key(self, name: str) -> str:
        return self._source.get(name, name)

    def shape(self, name: str) -> tuple[int, ...]:
        item = self.conversion.converted.get(name)
        return item.shape if item is not None else tuple(self.checkpoint.shape(self._key(name)))

    def dtype(self, name: str) -> torch.dtype:
        item = self.conversion.converted.get(name)
        return item.dtype if item is not None else self.checkpoint.dtype(self._key(name))

    def nbytes(self, name: str) -> int:
        item = self.conversion.converted.get(name)
        return item.nbytes if item is not None else self.checkpoint.nbytes(self._key(name))

    def file_of(self, name: str) -> Path:
        item = self.conversion.converted.get(name)
        return self.checkpoint.file_of(item.sources[-1] if item is not None else self._key(name))

    def safetensors_file(self, path: Any) -> _RenamedFile:
        return _RenamedFile(self.checkpoint.safetensors_file(path), self._source)

    def parts(self, name: str) -> list[tuple[Index, torch.Tensor]] | None:
        """``[(index, source view)]`` with ``target[index] = source`` for a converted tensor read in place;
        None for a tensor that is not converted or whose operations are more than placement."""
        item = self.conversion.converted.get(name)
        if item is None or item.parts is None:
            return None
        return [(index, self.checkpoint.get(key)) for key, index in item.parts]

    def part_ranges(self, name: str) -> list[tuple[Index, Path, int, int]] | None:
        """``[(index, file, start, end)]``: where each of :meth:`parts`' sources lies (absolute byte offsets), or
        None."""
        item = self.conversion.converted.get(name)
        if item is None or item.parts is None or not self.checkpoint.is_safetensors:
            return None
        files = [(index, self.checkpoint.file_of(key), key) for key, index in item.parts]
        return [(index, file, *self.checkpoint.safetensors_file(file).byte_range(key)) for index, file, key in files]

    def get(self, name: str) -> torch.Tensor:
        """The tensor under the model's name: a zero-copy view, or a converted tensor built by transformers."""
        item = self.conversion.converted.get(name)
        if item is None:
            return self.checkpoint.get(self._key(name))
        return run_converter(item.converter, name, item.by_pattern, self.checkpoint.get, self._model())[name]

    def fingerprint(self) -> dict[str, Any]:
        return {
            **self.checkpoint.fingerprint(),
            "converted": sorted(self.conversion.converted),
            "renamed": sorted(self.conversion.renamed.items()),
        }

    def fills(self, key: str) -> bool:
        """False: its tensors are the wrapped checkpoint's read whole, or built from parts."""
        return False

    def __getattr__(self, attribute: str) -> Any:
        if attribute in ("checkpoint", "conversion", "conversion_targets", "_model", "_source", "_consumed", "_shards"):
            raise AttributeError(attribute)
        return getattr(self.checkpoint, attribute)

    def __repr__(self) -> str:
        return (
            f"ConvertedCheckpoint({self.checkpoint!r}, {len(self._source)} renamed, "
            f"{len(self.conversion.converted)} converted)"
        )


def convert_checkpoint(model: nn.Module, checkpoint: Checkpoint) -> Any:
    """``checkpoint`` as ``model`` names its tensors: itself when names already match, else a
    :class:`ConvertedCheckpoint`."""
    conversion = key_conversion(model, checkpoint)
    return ConvertedCheckpoint(checkpoint, conversion, model) if conversion else checkpoint
