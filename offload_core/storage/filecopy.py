"""Write one file's bytes: from memory, or from a span of another file copied by the kernel (``copy_file_range``, else
``sendfile``)."""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from offload_core.storage.pagecache import libc

__all__ = ["KERNEL_COPY", "FileSpan", "FileSpans", "Padded", "Slices", "write_file"]

#: Linux: ``copy_file_range`` and a ``sendfile`` that writes to files copy file to file in the kernel
KERNEL_COPY = hasattr(os, "copy_file_range")
#: errors of ``copy_file_range`` that mean "not between these two files" (another file system, an old kernel)
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


@dataclass(frozen=True)
class FileSpan:
    """Bytes ``start:end`` of the file at ``path``, to be copied by the kernel from file to file.

    Copied this way, a checkpoint tensor is never mapped into this process nor passed through user
    space.
    """

    path: Path
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start

    def copy_to(self, fd: int) -> None:
        """Append the span to ``fd``: ``copy_file_range``, or ``sendfile`` where that cannot join the two
        files or copies nothing (some file systems answer 0 instead of an error)."""
        with open(self.path, "rb") as source:
            copy, offset = _copy_range, self.start
            while offset < self.end:
                copied = copy(source.fileno(), fd, offset, self.end - offset)
                if copied:
                    offset += copied
                elif copy is _copy_range:
                    copy = _send
                else:
                    raise OSError(
                        errno.EIO,
                        f"checkpoint file {self.path} ends at byte {offset}, before the tensor's "
                        f"end at byte {self.end} (it changed after it was opened; re-download it)",
                    )


@dataclass(frozen=True)
class FileSpans:
    """File spans written one after another: a tensor whose parts, in its byte order, lie in checkpoint files (a
    converted tensor's per-expert sources), copied file to file without being assembled in memory."""

    spans: tuple[FileSpan, ...]

    def __len__(self) -> int:
        return sum(len(span) for span in self.spans)

    def copy_to(self, fd: int) -> None:
        for span in self.spans:
            span.copy_to(fd)


def _copy_range(source: int, target: int, offset: int, count: int) -> int:
    """``copy_file_range``; 0 where it cannot join the two files."""
    try:
        return os.copy_file_range(source, target, count, offset)
    except OSError as exc:
        if exc.errno in _NO_COPY_RANGE:
            return 0
        raise


def _send(source: int, target: int, offset: int, count: int) -> int:
    return os.sendfile(target, source, offset, count)


def _reserve(fd: int, size: int) -> None:
    """Allocate a new file's blocks in one go: faster than growing it chunk by chunk, and a full disk
    fails before any byte is copied. File systems without ``fallocate`` just grow as written (never
    glibc's ``posix_fallocate`` emulation, which writes every block)."""
    lib = libc()
    if lib is None or size == 0 or lib.fallocate(fd, 0, 0, size) == 0:
        return
    code = ctypes.get_errno()
    if code not in (errno.EOPNOTSUPP, errno.ENOSYS):
        raise OSError(code, os.strerror(code))


@dataclass(frozen=True)
class Slices:
    """``size`` bytes made a slice at a time by ``make()`` (a tensor cast to another dtype piece by piece), each
    written as it comes: never held whole."""

    size: int
    make: Callable[[], Iterable[bytes | memoryview]]

    def __len__(self) -> int:
        return self.size


@dataclass(frozen=True)
class Padded:
    """``data`` written after ``lead`` zero bytes (so that, mapped from the file's start, it lies at ``lead`` modulo
    any alignment up to a page)."""

    lead: int
    data: bytes | memoryview | FileSpan | FileSpans | Slices

    def __len__(self) -> int:
        return self.lead + len(self.data)


def write_file(path: Path, data: bytes | memoryview | FileSpan | FileSpans | Slices | Padded) -> None:
    """Write ``data`` to a new file at ``path``, its blocks reserved first (flushing to the disk is the caller's)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with open(fd, "wb") as f:  # never through a symlink
        _reserve(f.fileno(), len(data))
        if isinstance(data, Padded):
            f.write(bytes(data.lead))
            f.flush()
            data = data.data
        if isinstance(data, (FileSpan, FileSpans)):
            data.copy_to(f.fileno())
        elif isinstance(data, Slices):
            for piece in data.make():
                f.write(piece)
        else:
            f.write(data)
        f.flush()
