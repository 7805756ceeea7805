"""An offload folder: one raw data file per tensor plus accelerate's ``index.json``, written atomically and reused when
still valid.

Layout (accelerate's, as ``load_offloaded_weights`` reads it, for tensors whose entry has no ``offset``): ``index.json``
maps each tensor name to ``{"dtype": ..., "shape": [...]}`` (plus, ours, ``"offset"`` where the tensor's reference
address offset is not 0: see :mod:`offload_core.alignment`); ``<name>.dat`` holds its bytes, after ``offset`` zero
bytes, so that its mapping lies at the reference offset and is used as it is, never copied. Beside them, files of our
own: ``.offload_core`` (our tag: the names of every file we wrote, so only those are ever removed),
``.offload_complete`` (written last: the fingerprint of what the folder holds and each file's xxh3-128 checksum and
stamp, verified before the folder is reused: a file whose stamp (size, mtime, ctime, inode) is unchanged is trusted, any
other is hashed again), and ``.lock``. No file in the folder is opened through a symlink. Reading and checking the
index, tag and marker, and removing exactly our files: :mod:`offload_core.storage.folder_record`.
"""

from __future__ import annotations

import atexit
import errno
import gc
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from offload_core.alignment import ALIGNMENT, address_offset, misplaced, placed
from offload_core.atomic import atomic_write, fsync_path
from offload_core.errors import StorageError
from offload_core.storage.base import FileMaps, Store, StoreContext, converts, written
from offload_core.storage.filecopy import KERNEL_COPY, FileSpan, FileSpans, Padded, Slices, write_file
from offload_core.storage.mapping import map_file, view
from offload_core.storage.leftovers import PREFIX as LEFTOVER_PREFIX, remove_leftovers
from offload_core.storage.folder_guard import (
    LOCK,
    FolderLock,
    checksum,
    dtype_from_name,
    dtype_name,
    entries,
    open_nofollow,
    safe_file_name,
    stamp,
)
from offload_core.storage.folder_record import (
    COMPLETE,
    INDEX,
    TAG,
    check_reusable,
    marker,
    read_index,
    remove_our_files,
    remove_record,
    write_tag,
)
from offload_core.storage.checkpoint import Checkpoint
from offload_core.storage.pagecache import drop_named, populate, span_of
from offload_core.storage.splice import checkpoint_parts, in_order

log = logging.getLogger(__name__)


class FolderStore(FileMaps, Store):
    """Offloaded tensors in an offload folder, read back through memory maps (file-backed pages, no copy)."""

    reads_into = True  # one copy from the mapped file

    #: ``write_file(path, data)`` writes one new file (a tensor's bytes, the index, the completion marker):
    #: the one place this store writes data. A seam: tests replace it to inject a full disk or a crash.
    write_file = staticmethod(write_file)

    def __init__(self, context: StoreContext, verify: bool = True) -> None:
        self.verify = verify
        self.maps_checkpoint = context.maps_checkpoint
        # memmap/3: each tensor's bytes start at its reference offset in its file
        self.fingerprint = {"store": "memmap/3", **context.fingerprint}
        self.temporary = context.offload_folder is None
        if self.temporary:
            remove_leftovers()  # the temporary folders of killed runs
            self.folder = Path(tempfile.mkdtemp(prefix=LEFTOVER_PREFIX))
            atexit.register(self.close)
        else:
            self.folder = Path(context.offload_folder).expanduser().resolve()
        self._created = not self.folder.exists()
        self._maps: dict[str, torch.Tensor] = {}
        self._index: dict[str, dict] = {}
        self._written: list[str] = []
        self._tagged: dict[str, None] = {}  # the files named in the tag, in order
        self._lock: FolderLock | None = None
        self._aborted = False
        self._sealer: threading.Thread | None = None
        self.bytes_written = 0
        self._prepare(context.names)

    # -- opening ---------------------------------------------------------------------------------
    def _prepare(self, names: list[str]) -> None:
        folder = self.folder
        planned = [safe_file_name(folder, name).name for name in names]
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(
                f"cannot create offload_folder {folder}: {exc.strerror}; choose a writable folder"
            ) from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise StorageError(f"offload_folder {folder} is not writable; choose a folder you can write to")
        self._refuse_foreign(entries(folder, links=True))  # before the lock: a foreign folder is left as it was
        self._lock = FolderLock(folder)
        weakref.finalize(self, self._lock.release)  # a store dropped without close() lets the folder go
        try:
            self._lock.begin_build()
            present = entries(folder)  # under the lock: what the folder holds now
            self._refuse_foreign(present)
            problem = self._check_reusable()
            if problem is not None and self._lock.shared:
                gc.collect()  # a dropped model of this process may still hold the folder until collected
                if self._lock.shared:
                    raise StorageError(
                        f"offload_folder {folder} is in use by another model of this process built "
                        "for different weights; delete that model or give another offload_folder"
                    )
        except BaseException:
            self.close()
            raise
        if problem is None:
            self._index = read_index(folder)
            self.reused = True
            self._lock.reading()
            self._lock.end_build()
            log.info(
                "memmap: reusing complete offload folder %s (%s)",
                folder,
                "contents verified" if self.verify else "contents not verified: verify=false",
            )
            return
        try:
            if TAG in present:
                if problem.startswith("verification"):
                    print(f"offload_core: offload folder {folder} failed {problem}; rebuilding it", file=sys.stderr)
                else:
                    log.info("memmap: offload folder %s is %s; rebuilding it", folder, problem)
                remove_our_files(folder)
            self._tagged = dict.fromkeys(planned)
            write_tag(
                self.folder, list(self._tagged)
            )  # every file this run will write, named once before any is written
        except OSError as exc:
            self.close()
            raise StorageError(
                f"cannot prepare offload_folder {folder}: {exc.strerror or exc}; "
                "choose a writable folder with free space"
            ) from None

    def _refuse_foreign(self, present: set[str]) -> None:
        others = sorted(present - {LOCK, TAG + ".tmp"})  # what a start of ours leaves before its tag is in place
        if others and TAG not in present and not self.temporary:
            raise StorageError(
                f"offload_folder {self.folder} holds files offload_core did not create ({', '.join(others[:3])}"
                f"{', ...' if len(others) > 3 else ''}); give an empty or new folder (nothing was changed)"
            )

    def _check_reusable(self) -> str | None:
        return check_reusable(self.folder, self.fingerprint, self.verify, self._write_marker)

    def _write_marker(self, sums: dict[str, str], stamps: dict[str, list[int]]) -> None:
        """Best effort: each file's checksum and stamp in the marker (else all are hashed again next time)."""
        try:
            with atomic_write(self.folder / COMPLETE) as tmp:
                self.write_file(tmp, marker(self.fingerprint, sums, stamps))
        except OSError as exc:
            log.info("memmap: could not record the verified stamps in %s (%s)", self.folder, exc)

    # -- writing ---------------------------------------------------------------------------------
    def put(self, name: str, tensor: torch.Tensor, owned: bool = False) -> None:
        """The tensor's reference offset is where it lies now (an in-memory model's tensor)."""
        self._put(name, tensor.detach(), address_offset(tensor) if tensor.is_contiguous() else 0)

    def _put(self, name: str, tensor: torch.Tensor, offset: int) -> None:
        data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        self._write(name, memoryview(data), tensor.dtype, tensor.shape, offset)

    def add_from_checkpoint(self, name: str, checkpoint: Checkpoint, key: str, dtype: torch.dtype | None) -> None:
        """A tensor kept in its stored dtype is copied file to file from its safetensors shard (see :class:`FileSpan`),
        and so is one whose parts tile it (per-expert tensors fused: never assembled in memory); one converted
        otherwise, or from a ``.bin`` file, is written from memory, cast slice by slice (:func:`written`)."""
        spans = self._spans_of_parts(checkpoint, key, dtype)
        if spans is not None:  # built by the conversion, it would lie in a new allocation: reference offset 0
            self._write(name, spans, checkpoint.dtype(key), checkpoint.shape(key), 0)
            return
        if (
            not (KERNEL_COPY and checkpoint.is_safetensors)
            or converts(checkpoint.dtype(key), dtype)
            or key in checkpoint.conversion_targets
        ):
            data, kind, offset = written(tensor := checkpoint.get(key), dtype, self.maps_checkpoint)  # cast by slices
            self._write(name, data, kind, tensor.shape, offset)
            return
        shard = checkpoint.file_of(key)
        start, end = checkpoint.safetensors_file(shard).byte_range(key)
        # mapped whole, the shard puts the tensor at its file offset: where an in-memory load in place has it
        offset = start % ALIGNMENT if self.maps_checkpoint and end > start else 0
        self._write(name, FileSpan(shard, start, end), checkpoint.dtype(key), checkpoint.shape(key), offset)

    @staticmethod
    def _spans_of_parts(checkpoint: Checkpoint, key: str, dtype: torch.dtype | None) -> FileSpans | None:
        """The file spans of a converted tensor's parts in its byte order, where they tile it in its stored dtype."""
        parts = checkpoint_parts(checkpoint, key)
        if not parts or not KERNEL_COPY or converts(checkpoint.dtype(key), dtype):
            return None
        ordered = in_order(torch.Size(checkpoint.shape(key)), checkpoint.dtype(key), parts)
        return None if ordered is None else FileSpans(tuple(FileSpan(p.path, p.start, p.end) for p in ordered))

    def _write(
        self,
        name: str,
        data: memoryview | FileSpan | FileSpans | Slices,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        offset: int,
    ) -> None:
        """Write one tensor's file atomically (a temp file, then a rename; named in the tag before it is written), its
        bytes after ``offset`` zero bytes: mapped from the file's page-aligned start, they lie at their reference
        offset."""
        path = safe_file_name(self.folder, name)
        try:
            self._tag(path.name)
            with atomic_write(path, sync=False) as tmp:
                self.write_file(tmp, Padded(offset, data) if offset else data)
        except OSError as exc:
            raise self._failed(exc, f"writing {name!r}") from None
        self._written.append(path.name)
        self._index[name] = {"dtype": dtype_name(dtype), "shape": list(shape), **({"offset": offset} if offset else {})}
        self.bytes_written += len(data)

    def _tag(self, file_name: str) -> None:
        """Name a file in the tag before it is written (so an interrupted run's leftovers are ours to remove);
        the files planned at opening are already there."""
        if file_name not in self._tagged:
            self._tagged[file_name] = None
            write_tag(self.folder, list(self._tagged))

    def _failed(self, exc: OSError, doing: str) -> StorageError:
        """Remove everything this store wrote (the user's files stay) and say what went wrong."""
        self._abort()
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return StorageError(
                f"no space left on the device of offload_folder {self.folder} while {doing}; free space or point "
                "offload_folder at a larger disk (the partial offload folder was removed; your files are untouched)"
            )
        return StorageError(
            f"cannot write offload_folder {self.folder} while {doing}: {exc.strerror or exc}; "
            "check the folder (the partial offload folder was removed)"
        )

    def _abort(self) -> None:
        """Best effort, never raising: our data files, index, marker and tag go (the folder too if we made it)."""
        remove_record(self.folder)
        self._written.clear()
        self._tagged.clear()
        self._index.clear()
        self._aborted = True
        if self._lock is not None:
            self._lock.end_build()

    def finalize(self) -> None:
        """Write the index; then, on a thread, flush every file to the disk and only then the completion marker.

        The data is readable at once (it is in the page cache); a later run trusts the folder only once the marker is
        there, which needs every byte on the disk first. A temporary folder is removed at exit and never flushed."""
        if self.reused:
            return
        try:
            with atomic_write(self.folder / INDEX, sync=False) as tmp:
                self.write_file(tmp, json.dumps(self._index).encode())
            self._written.append(INDEX)
            self._tag(INDEX)
        except OSError as exc:
            raise self._failed(exc, "writing its index") from None
        if self.temporary:
            self._lock.reading()
            self._lock.end_build()
        else:
            self._sealer = threading.Thread(target=self._seal, name="offload-folder-seal", daemon=True)
            self._sealer.start()

    def _seal(self) -> None:
        _yield_to_the_run()
        self._lock.reading()
        try:
            sums, stamps = {}, {}
            for name in self._written:  # each file's stamp and checksum, read back as written, then the file flushed
                stamps[name] = stamp(self.folder / name)
                sums[name] = checksum(self.folder / name)
                fsync_path(self.folder / name, follow=False)
            with atomic_write(self.folder / COMPLETE) as tmp:  # flushed, renamed, the folder flushed
                self.write_file(tmp, marker(self.fingerprint, sums, stamps))
        except (OSError, StorageError) as exc:  # the folder stays unmarked: the next run rebuilds it
            log.warning(
                "memmap: could not flush offload folder %s (%s); it will be rebuilt next time", self.folder, exc
            )
        finally:
            if self._lock is not None:
                self._lock.end_build()

    def wait_until_sealed(self) -> None:
        """Block until the completion marker is written (close() does this before releasing the lock)."""
        if self._sealer is not None:
            self._sealer.join()

    # -- reading ---------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        """The mapped tensor, at its reference offset (:meth:`_write`): never a copy."""
        return placed(self._mapped(name), self.offset(name))

    def offset(self, name: str) -> int:
        return int(self._index[name].get("offset", 0))

    def _mapped(self, name: str) -> torch.Tensor:
        tensor = self._maps.get(name)
        if tensor is None:
            info = self._index[name]
            dtype = dtype_from_name(info["dtype"])
            shape = tuple(info["shape"])
            numel = int(np.prod(shape, dtype=np.int64))
            if numel == 0:
                tensor = torch.empty(shape, dtype=dtype)
            else:
                # private copy-on-write mapping, so the tensor is writable for torch and the file can never be
                # changed through it; pages stay file-backed until written.
                fd = open_nofollow(safe_file_name(self.folder, name))
                try:
                    mapped = map_file(fd, self.offset(name) + numel * dtype.itemsize)
                finally:
                    os.close(fd)
                with torch.inference_mode(False):  # kept across calls: a normal tensor, whatever mode this call runs in
                    tensor = view(mapped, dtype, shape, self.offset(name))
            self._maps[name] = tensor
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def file_of(self, name: str) -> Path:
        return safe_file_name(self.folder, name)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Copy ``name`` from its mapped file into ``out`` (a buffer at its reference offset): one copy."""
        out.copy_(self._mapped(name))

    def warm(self, name: str) -> bool:
        mapped = self._mapped(name)  # a tensor handed out as a copy (misplaced) is fetched ahead by the caller
        return populate(mapped, self.file_of(name), self.offset(name)) and not misplaced(mapped, self.offset(name))

    def drop(self, name: str) -> bool:
        return bool(self.drop_all([name]))

    def drop_all(self, names: Sequence[str]) -> list[str]:
        return drop_named({n: [span_of(self._mapped(n), self.file_of(n), self.offset(n))] for n in names})

    def close(self) -> None:
        self.wait_until_sealed()
        self._maps.clear()
        if self._lock is not None:
            if self._aborted and not self.temporary and not self._lock.shared:
                (self.folder / LOCK).unlink(missing_ok=True)
            self._lock.release()
            self._lock = None
        if self.temporary and self.folder.exists():
            shutil.rmtree(self.folder, ignore_errors=True)
        elif self._aborted and self._created:
            try:
                self.folder.rmdir()  # only when empty: a folder we made for a write that failed
            except OSError:
                pass


def _yield_to_the_run() -> None:
    """The calling thread (the folder's sealer) runs only where the run leaves a core and the disk idle: lowest CPU
    priority and idle I/O class, where the system lets a thread lower its own. Sealing a 2 GB folder (checksums, then
    every byte flushed) beside the first tokens halved their speed on 2 cores: 0.110 s a decoding step against
    0.050 s with nothing beside it."""
    import psutil

    try:
        task = psutil.Process(threading.get_native_id())
        task.nice(19)
        if hasattr(psutil, "IOPRIO_CLASS_IDLE"):
            task.ionice(psutil.IOPRIO_CLASS_IDLE)
    except (psutil.Error, OSError, ValueError):
        pass  # a priority that cannot be lowered costs the run time, never data
