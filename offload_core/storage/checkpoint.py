"""The contract of a checkpoint as stores, loading and the planner read it: what every checkpoint reader
(:class:`offload_core.loading.checkpoint.Checkpoint`, its GGUF, pipeline and converted forms) offers, by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar

import torch

T = TypeVar("T")


class Checkpoint(Protocol):
    """A checkpoint read lazily, tensor by tensor (opening reads only headers)."""

    #: where it was opened from (a folder or one file)
    path: Path
    #: its tensors lie in safetensors files, which can be mapped in place
    is_safetensors: bool
    #: it is one GGUF file, whose tensors are read (dequantized) through it
    is_gguf: bool
    #: keys the checkpoint builds on read from tensors of other names (a conversion's targets); none for a plain one
    conversion_targets: frozenset[str]

    def keys(self) -> list[str]: ...

    def __contains__(self, key: object) -> bool: ...

    def get(self, key: str) -> torch.Tensor:
        """Tensor ``key`` (a view of the mapped file where it can be)."""
        ...

    def dtype(self, key: str) -> torch.dtype: ...

    def shape(self, key: str) -> tuple[int, ...]: ...

    def nbytes(self, key: str) -> int: ...

    def file_of(self, key: str) -> Path: ...

    def shards(self) -> list[tuple[Path, list[str]]]:
        """Each file and the keys it holds, in file order."""
        ...

    def fingerprint(self) -> dict[str, Any]:
        """What identifies its contents (file names, sizes, header digests)."""
        ...

    def parts(self, key: str) -> list[tuple[Any, torch.Tensor]] | None:
        """The parts a converted tensor is built from (index into it, source tensor); None for a tensor read whole."""
        ...

    def fills(self, key: str) -> bool:
        """Whether ``read_into(key, out)`` builds ``key`` in the caller's memory with nothing of its size beside it
        (a GGUF tensor dequantized or packed as it lies), so that loading reads it into the memory that holds it."""
        ...

    def part_ranges(self, key: str) -> list[tuple[Any, Path, int, int]] | None:
        """Where :meth:`parts` lie on disk (index, file, start, end); None where unknown or read whole."""
        ...

    def worked_out(self, what: str, model: Any, make: Callable[[], T]) -> T:
        """``make()``, computed once per ``what`` and model while the checkpoint is open."""
        ...

    def close(self) -> None: ...
