"""The child process of ``bench/stress_mapped.py``: the mapped paths run by reader threads while a dropper drops their
pages and a closer replaces every store, checkpoint and mapping with new ones, closes the old ones (and tries to close
the mappings under the views it holds), and collects them; optionally models computing on mapped views meanwhile."""

from __future__ import annotations

import gc
import json
import os
import random
import threading
import time
from pathlib import Path

import torch

EXPERTS, ROWS, COLS = 8, 64, 256  # per-expert float32 tensors of 64 KiB: whole pages, spliced where they lie
ODD = [(37, 53), (5, 3), (129, 67)]  # tensors whose bytes begin and end inside pages


class Counts:
    """What happened, by name (written out every second, so that a crash leaves what was counted until then)."""

    def __init__(self, path: Path) -> None:
        self.path, self.lock, self.values, self.failures = path, threading.Lock(), {}, []
        self.written = 0.0

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.values[name] = self.values.get(name, 0) + n

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)
        self.add("failures")

    def write(self, force: bool = False) -> None:
        if force or time.monotonic() - self.written > 1.0:
            self.written = time.monotonic()
            with self.lock:
                text = json.dumps(
                    {**self.values, "failures_first": self.failures[:3]} if self.failures else self.values
                )
            self.path.write_text(text)


def _without_the_rule() -> None:
    """Views as offload_core made them before the rule: ``torch.frombuffer`` (a reference, no buffer export)."""
    import offload_core.loading.safetensors_file as safetensors_file
    import offload_core.module_hooks.experts.rows as rows
    import offload_core.storage.folder as folder
    import offload_core.storage.mapping as mapping
    import offload_core.storage.splice as splice

    def raw_view(mapped, dtype, shape, offset=0):
        shape = torch.Size(shape)
        if shape.numel() == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=shape.numel() * dtype.itemsize, offset=offset)
        return flat.view(dtype).view(shape)

    for module in (mapping, safetensors_file, folder, splice, rows):
        module.view = raw_view


class Data:
    """The tensors, written once into a safetensors shard; each generation maps them anew."""

    def __init__(self, root: Path) -> None:
        from safetensors.torch import save_file

        generator = torch.Generator().manual_seed(0)
        self.tensors = {f"expert.{i}": torch.randn(ROWS, COLS, generator=generator) for i in range(EXPERTS)}
        self.tensors.update({f"odd.{j}": torch.randn(*shape, generator=generator) for j, shape in enumerate(ODD)})
        self.root, self.shard = root, root / "shard.safetensors"
        save_file(self.tensors, str(self.shard))
        self.fused = torch.stack([self.tensors[f"expert.{i}"] for i in range(EXPERTS)])


class Generation:
    """One set of everything that maps the data: a checkpoint, a store reading it in place, an offload folder, the
    experts spliced from the shard, reserved expert rows and a bare safetensors file."""

    def __init__(self, data: Data) -> None:
        from offload_core.loading.checkpoint import Checkpoint
        from offload_core.loading.safetensors_file import SafetensorsFile
        from offload_core.module_hooks.experts.rows import ReservedRows
        from offload_core.storage import StoreContext
        from offload_core.storage.folder import FolderStore
        from offload_core.storage.inplace import InPlaceStore
        from offload_core.storage.splice import Part, Spliced

        names = list(data.tensors)
        self.checkpoint = Checkpoint.open(data.shard)
        self.inplace = InPlaceStore(StoreContext(names=names, checkpoint=self.checkpoint))
        for name in names:
            self.inplace.add_from_checkpoint(name, self.checkpoint, name, None)
        self.folder = FolderStore(StoreContext(names=names, fingerprint={"stress": 1}))
        for name, tensor in data.tensors.items():
            self.folder.put(name, tensor)
        self.folder.finalize()
        file = self.checkpoint.safetensors_file(data.shard)
        parts = [Part((i,), data.shard, *file.byte_range(f"expert.{i}")) for i in range(EXPERTS)]
        self.spliced = Spliced.build(data.fused.shape, torch.float32, parts)
        if self.spliced is not None:
            self.spliced.copy_edges([self.checkpoint.get(f"expert.{i}") for i in range(EXPERTS)])
        self.rows = ReservedRows(data.fused.shape, torch.float32)
        self.rows.tensor.copy_(data.fused)
        self.file = SafetensorsFile(data.shard)

    def views(self, data: Data) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(view, the bytes it must read) for one tensor of each kind (None: rows, whose pages may be released)."""
        name = random.choice(list(data.tensors))
        expert = random.randrange(EXPERTS)
        found = [
            (self.folder[name], data.tensors[name]),
            (self.inplace[name], data.tensors[name]),
            (self.file.get(name), data.tensors[name]),
            (self.rows.tensor[expert], None),
        ]
        if self.spliced is not None:
            found.append((self.spliced.tensor[expert], data.fused[expert]))
        return found

    def close(self) -> None:
        self.folder.close()  # a temporary folder: its files are removed, the mappings stay
        self.inplace.close()
        self.checkpoint.close()
        self.file.close()


def reader(state: dict, data: Data, counts: Counts) -> None:
    from offload_core.storage.pagecache import populate, read_in, resident

    while not state["stop"].is_set():
        try:
            views = state["current"].views(data)
        except (OSError, ValueError, KeyError, RuntimeError) as error:  # a closed generation may refuse new views
            counts.add(f"view refused after close ({type(error).__name__})")
            continue
        time.sleep(random.random() * 0.002)  # the closer and the dropper run meanwhile
        for view, want in views:
            populate(view)
            if not resident(view):
                read_in([view], [[]])
            total = float(view.double().sum())  # every byte read
            if want is not None and not torch.equal(view, want):
                counts.fail(f"a view read other bytes than written (sum {total})")
            counts.add("views read")


def dropper(state: dict, data: Data, counts: Counts) -> None:
    from offload_core.storage.pagecache import drop_spans

    while not state["stop"].is_set():
        generation = state["current"]
        name = random.choice(list(data.tensors))
        try:
            counts.add("pages dropped", int(generation.folder.drop(name)) + int(generation.inplace.drop(name)))
        except (OSError, ValueError, KeyError, RuntimeError):
            counts.add("drop refused after close")
        if generation.spliced is not None:
            counts.add("pages dropped", int(drop_spans(generation.spliced.mapped_spans())))
        generation.rows.release(random.randrange(EXPERTS))
        for path in [data.shard, *Path(generation.folder.folder).glob("*.dat")]:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        time.sleep(0.001)


def closer(state: dict, data: Data, counts: Counts) -> None:
    """Replace the generation, try to close the mappings under views of the old one, close it, collect it."""
    from offload_core.storage.mapping import mapping_of

    while not state["stop"].is_set():
        old, state["current"] = state["current"], Generation(data)
        counts.add("generations")
        try:
            held = old.views(data)
        except (OSError, ValueError, KeyError, RuntimeError):
            held = []
        old.close()
        for view, want in held:
            mapping = mapping_of(view)
            if mapping is None:
                continue
            try:
                mapping.close()
            except BufferError:
                counts.add("close refused under a view")
                continue
            counts.add("mapping closed under a view")
            float(view.double().sum())  # without the rule: pages unmapped under the view
            if want is not None and not torch.equal(view, want):
                counts.fail("a view read other bytes after its mapping was closed")
        del old, held
        if counts.values.get("generations", 0) % 8 == 0:
            gc.collect()
        counts.write()
        time.sleep(0.01)


def _counted(job, state: dict, data: Data, counts: Counts) -> None:
    """``job``, an exception it raises counted as a failure (and the run stopped)."""
    try:
        job(state, data, counts)
    except BaseException as error:  # noqa: BLE001 - any error of a thread is a failure of the run
        counts.fail(f"{job.__name__}: {type(error).__name__}: {error}")
        state["stop"].set()


def run_child(root: Path, counts_path: Path, seconds: float, models: bool, raw: bool, readers: int) -> int:
    """The stress for ``seconds`` in the folder ``root`` (the parent's: it removes it, a crash here or not); 0 when
    every read was equal (a crash ends the process first)."""
    if raw:
        _without_the_rule()
    counts = Counts(counts_path)
    data = Data(root)
    state = {"current": Generation(data), "stop": threading.Event()}
    jobs = [reader] * readers + [dropper, closer]
    threads = [threading.Thread(target=_counted, args=(job, state, data, counts), daemon=True) for job in jobs]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + seconds
    if models:
        from stress_models import run_models

        run_models(root, deadline, counts)
    while time.monotonic() < deadline and all(thread.is_alive() for thread in threads):
        time.sleep(0.1)
    state["stop"].set()
    for thread in threads:
        thread.join()
    counts.write(force=True)
    return 0 if not counts.failures else 2
