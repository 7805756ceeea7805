"""A GGUF model split across files, as llama.cpp's ``gguf-split`` writes the large ones on the Hub
(``name-00001-of-00003.gguf``, ...): the first holds the metadata, each file its share of the tensors. Read as one
file: its header is the first's, its tensors those of every part, each read from where it lies."""

from __future__ import annotations

import re
from pathlib import Path, PurePath
from typing import Any, TypeVar

import torch

from offload_core.errors import CheckpointError
from offload_core.storage.gguf.file import GGUFEntry, GGUFFile

__all__ = ["GGUFSplit", "open_gguf", "split_paths"]

_P = TypeVar("_P", bound=PurePath)
#: how gguf-split names the parts of a model
PART = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def split_paths(path: _P) -> list[_P] | None:
    """Every part of the split GGUF model ``path`` is named as a part of (in order, the first holding the metadata),
    whether they exist or not (``path`` a file's, or a name in a Hub repo's listing); None for a file not named as a
    part of two or more."""
    named = PART.match(path.name)
    if named is None or int(named["count"]) < 2:
        return None
    suffix = path.name[named.end("count") :]
    return [
        path.with_name(f"{named['stem']}-{no:05d}-of-{named['count']}{suffix}")
        for no in range(1, int(named["count"]) + 1)
    ]


def open_gguf(path: str | Path) -> GGUFFile | GGUFSplit:
    """The GGUF model ``path`` names: a :class:`GGUFSplit` where it is a part of a split model (any part), else the
    :class:`GGUFFile`."""
    parts = split_paths(Path(path))
    return GGUFFile(path) if parts is None else GGUFSplit(parts)


class GGUFSplit:
    """The parts of a split GGUF model read as one :class:`GGUFFile`: ``path``, ``fields`` and ``architecture`` the
    first's, ``entries`` every part's; :meth:`raw` reads a tensor from its part, :meth:`file_of` names it. Every part
    is checked as it opens (its number and count, no tensor twice, as many as the first says)."""

    def __init__(self, paths: list[Path]) -> None:
        self.path = paths[0]
        self.paths = paths
        missing = [path for path in paths if not path.is_file()]
        if missing:
            raise CheckpointError(
                f"{self.path.parent} lacks {len(missing)} of the {len(paths)} parts of the split GGUF model "
                f"{self.path.name} (such as {missing[0].name}); download every part into that folder"
            )
        self.files: list[GGUFFile] = []
        try:
            for path in paths:
                self.files.append(GGUFFile(path))
            self._check()
        except BaseException:
            self.close()
            raise
        self.fields = self.files[0].fields
        self.architecture = self.files[0].architecture
        self.entries: dict[str, GGUFEntry] = {}
        self._owner: dict[str, GGUFFile] = {}
        for file in self.files:
            for name, entry in file.entries.items():
                if name in self.entries:
                    raise self._damaged(
                        f"tensor {name!r} is in both {self._owner[name].path.name} and {file.path.name}"
                    )
                self.entries[name] = entry
                self._owner[name] = file
        declared = self.files[0].field("split.tensors.count")
        if isinstance(declared, int) and declared != len(self.entries):
            raise self._damaged(f"its parts hold {len(self.entries)} tensors, and the first says {declared}")

    def _damaged(self, problem: str) -> CheckpointError:
        return CheckpointError(
            f"{self.path} is a split GGUF model whose parts disagree ({problem}); re-download every part"
        )

    def _check(self) -> None:
        for no, file in enumerate(self.files):
            number, count = file.field("split.no"), file.field("split.count")
            if number is None or count is None:
                raise self._damaged(
                    f"{file.path.name} holds no split.no and split.count: it is no part of a split model"
                )
            if number != no or count != len(self.files):
                raise self._damaged(
                    f"{file.path.name} says it is part {number} of {count}; its name says {no + 1} of {len(self.files)}"
                    " (split.no counts from 0)"
                )
        if not self.files[0].architecture:
            raise self._damaged(f"the first part, {self.path.name}, holds no metadata")

    def field(self, key: str) -> Any:
        return self.files[0].field(key)

    def raw(self, name: str) -> torch.Tensor:
        return self._owner[name].raw(name)

    def file_of(self, name: str) -> Path:
        """The part tensor ``name`` lies in."""
        return self._owner[name].path

    def stored_bytes(self) -> int:
        return sum(file.stored_bytes() for file in self.files)

    def close(self) -> None:
        for file in self.files:
            file.close()
