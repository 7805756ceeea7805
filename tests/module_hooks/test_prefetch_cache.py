"""Prefetch when the page cache drops what was read ahead: the reader reads it again before its block runs."""

from __future__ import annotations

import threading

import pytest
import torch

from offload_core import dispatch_model
from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig
from tests.module_hooks.prefetch_model import DISK
from tests.module_hooks.prefetch_model import tiny_llama as _model


# -- read-ahead the page cache evicted before use -------------------------------------------------


def test_resident_sees_pages_dropped_from_the_page_cache(tmp_path):
    import ctypes
    import mmap
    import os

    import numpy as np

    from offload_core.storage.pagecache import populate, resident

    path = tmp_path / "weights.bin"
    path.write_bytes(np.arange(4 << 20, dtype=np.uint8).tobytes())
    tensor = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))
    assert populate(tensor) and resident(tensor)
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    assert tensor.data_ptr() % page == 0

    def drop(offset, length):  # this process's mapping of the bytes (MADV_DONTNEED), then the page cache's
        libc.madvise(tensor.data_ptr() + offset, length, 4)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    drop(0, tensor.numel())
    if resident(tensor):
        pytest.skip(f"{tmp_path} keeps its pages in memory (tmpfs): nothing to drop")
    assert populate(tensor) and resident(tensor)
    assert tensor[12345].item() == 12345 % 256
    drop(517 * page, page)  # one page of 1024 missing is enough to be read again
    assert not resident(tensor) and resident(tensor[: 517 * page]) and resident(tensor[518 * page :])
    assert populate(tensor) and resident(tensor)


class _Evictions:
    """Stands in for the page cache letting go of pages: ``resident`` is False for the tensors marked
    evicted until the store reads them in again; records which thread read what."""

    def __init__(self, monkeypatch, store):
        import offload_core.module_hooks.prefetch.prefetcher as module

        self.evicted: set[int] = set()
        self.reads: list[tuple[str, str]] = []
        self.store = store
        warm = store.warm

        def read(key):
            self.reads.append((key, threading.current_thread().name))
            self.evicted.discard(store[key].data_ptr())
            return warm(key)

        monkeypatch.setattr(store, "warm", read)
        monkeypatch.setattr(module, "resident", lambda tensor: tensor.data_ptr() not in self.evicted)

    def evict(self, keys):
        self.evicted |= {self.store[key].data_ptr() for key in keys}
        self.reads.clear()


@pytest.mark.parametrize("storage", ["memmap", "safetensors"])
def test_read_ahead_evicted_between_passes_is_read_again_by_the_reader(tmp_path, monkeypatch, storage):
    from offload_core.loading.dispatch import load_checkpoint_and_dispatch

    reference = _model()
    reference.save_pretrained(tmp_path / "ckpt")
    model = _model()
    ids = torch.tensor([[5, 6, 7, 8]])
    load_checkpoint_and_dispatch(
        model,
        tmp_path / "ckpt",
        DISK,
        storage=storage,
        policy=Prefetch(PrefetchConfig(depth=2)),
        offload_folder=tmp_path / "off",
        no_split_module_classes=["LlamaDecoderLayer"],
        progress=False,
    )
    prefetcher = model.offload_state.handle.prefetcher
    evictions = _Evictions(monkeypatch, prefetcher.store)
    with torch.no_grad():
        expected = reference(ids).logits
        model(ids)
        model(ids)  # the trace is recorded: the first blocks of the next pass are read ahead now
        for future, _, _ in prefetcher.pending.values():
            future.result()
        ahead = {i: list(fetched.mapped) for i, (_, _, fetched) in prefetcher.pending.items()}
        assert ahead and all(ahead.values())
        evictions.evict([key for keys in ahead.values() for key in keys])
        before = prefetcher.reread
        assert torch.equal(model(ids).logits, expected)
    # All read again on the reader thread as the pass started: nothing by the compute thread, which
    # would have had to read them itself (or fault them in) when their block ran.
    evicted = {key for keys in ahead.values() for key in keys}
    assert {key for key, thread in evictions.reads if thread.startswith("offload-prefetch")} >= evicted
    assert not [key for key, thread in evictions.reads if thread == threading.current_thread().name]
    assert prefetcher.reread - before == len(ahead)
    model.offload_state.remove()


def test_read_ahead_evicted_after_the_pass_started_is_read_in_before_its_block_runs(tmp_path, monkeypatch):
    reference = _model()
    model = _model()
    ids = torch.tensor([[5, 6, 7, 8]])
    dispatch_model(
        model,
        DISK,
        storage="memmap",
        policy=Prefetch(PrefetchConfig(depth=1)),
        offload_folder=tmp_path / "off",
        no_split_module_classes=["LlamaDecoderLayer"],
    )
    prefetcher = model.offload_state.handle.prefetcher
    evictions = _Evictions(monkeypatch, prefetcher.store)
    layer3 = next(i for i, unit in enumerate(prefetcher.units) if unit.name == "model.layers.3")
    keys = prefetcher.units[layer3].keys

    def evict_layer3(module, args):  # layers.2 is resident and runs just before the offloaded layers.3
        if layer3 in prefetcher.pending:
            prefetcher.pending[layer3][0].result()
            evictions.evict(keys)

    with torch.no_grad():
        expected = reference(ids).logits
        model(ids)
        model(ids)
        hook = model.model.layers[2].register_forward_pre_hook(evict_layer3)
        assert torch.equal(model(ids).logits, expected)
        hook.remove()
    assert {key for key, thread in evictions.reads if thread == threading.current_thread().name} == set(keys)
    model.offload_state.remove()
