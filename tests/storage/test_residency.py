"""The kept set and the streamed set: the split by budget, shrinking under (faked) memory pressure, and dropping a
mapped tensor's pages."""

from __future__ import annotations

import mmap
import os
import random

import pytest
import torch

from offload_core.atomic import fsync_path
from offload_core.storage import StoreContext
from offload_core.storage.pagecache import libc, populate, resident
from offload_core.storage.residency import Residency, page_cache_budget

GIB = 1 << 30


def test_kept_blocks_are_spread_through_the_order_and_fill_the_budget():
    residency = Residency(budget=3 * GIB)
    residency.assign([(f"layer{i}", GIB) for i in range(6)])
    assert list(residency.kept) == ["layer1", "layer3", "layer5"]
    assert list(residency.streamed) == ["layer0", "layer2", "layer4"]
    uneven = Residency(budget=250)
    uneven.assign([("a", 100), ("b", 100), ("c", 100), ("d", 40), ("b", 100)])  # a repeat counts once
    assert uneven.kept_bytes == 240 and uneven.streamed_bytes == 100
    assert set(uneven.kept) | set(uneven.streamed) == {"a", "b", "c", "d"}


def test_the_kept_set_never_exceeds_its_budget_and_leaves_less_than_a_block_unused():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [(f"b{i}", rng.randint(1, 1000)) for i in range(rng.randint(1, 30))]
        budget = rng.randint(0, sum(size for _, size in sizes) + 500)
        residency = Residency(budget=budget)
        residency.assign(sizes)
        assert residency.kept_bytes <= budget
        assert not residency.streamed or residency.kept_bytes + min(residency.streamed.values()) > budget
        assert residency.kept_bytes + residency.streamed_bytes == sum(size for _, size in sizes)


def test_a_zero_budget_streams_every_block():
    residency = Residency(budget=0)
    residency.assign([("a", 1), ("b", 1)])
    assert not residency.kept and list(residency.streamed) == ["a", "b"]


def test_the_budget_is_the_explicit_size_else_available_memory_less_the_margin():
    assert page_cache_budget(123, available=lambda: 10 * GIB) == 123
    assert page_cache_budget(None, available=lambda: 10 * GIB, margin=GIB) == 9 * GIB
    assert page_cache_budget(None, available=lambda: GIB // 2, margin=GIB) == 0


def test_the_kept_set_shrinks_when_available_memory_falls_and_grows_back_when_it_returns():
    free = {"bytes": 100 * GIB}
    residency = Residency(budget=4 * GIB, available=lambda: free["bytes"], margin=GIB)
    residency.assign([(f"layer{i}", GIB) for i in range(8)])
    kept = list(residency.kept)
    assert residency.kept_bytes == 4 * GIB
    assert residency.check() == [] and residency.shrinks == 0
    free["bytes"] = 3 * GIB  # another process grew: 2 GiB may stay cached now
    moved = residency.check()
    assert moved == kept[:1:-1]  # the last two kept blocks leave, last first
    assert residency.kept_bytes == 2 * GIB and list(residency.streamed)[:2] == kept[2:]
    counters = residency.counters()
    assert counters["kept_shrinks"] == 1 and counters["kept_shrunk_bytes"] == 2 * GIB
    assert residency.check() == [] and residency.kept_bytes == 2 * GIB  # no room yet: nothing comes back
    free["bytes"] = 4 * GIB  # room for one of them again
    assert residency.check() == [] and list(residency.kept) == kept[:3]
    free["bytes"] = 100 * GIB  # the other process is gone: the kept set is whole again, never over its budget
    residency.check()
    assert sorted(residency.kept) == sorted(kept) and residency.kept_bytes == 4 * GIB
    counters = residency.counters()
    assert counters["kept_grows"] == 2 and counters["kept_grown_bytes"] == 2 * GIB


def test_the_read_ahead_window_counts_streamed_blocks_only():
    residency = Residency(budget=2, kept={"k1": 1, "k3": 1}, streamed={"s0": 1, "s2": 1, "s4": 1})
    assert residency.window(["k1", "s2", "k3", "s4", "s0"], 2) == 4  # k1, s2, k3, s4
    assert residency.window(["k1", "s2", "k3", "s4", "s0"], 1) == 2
    assert residency.window(["k1", "k3"], 2) == 2
    assert residency.window(["s2", "s4"], 0) == 0


def test_dropping_a_mapped_tensor_takes_its_pages_out_of_the_page_cache(tmp_path):
    from offload_core.storage.folder import FolderStore

    tensor = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    store = FolderStore(StoreContext(names=["w"], offload_folder=tmp_path / "off"))
    store.put("w", tensor)
    store.finalize()
    store.wait_until_sealed()  # the seal reads the file on its own thread: its reads would bring the pages back
    fsync_path(store.file_of("w"))  # the kernel drops clean pages only: a freshly written file's are dirty
    try:
        assert populate(store["w"]) and resident(store["w"])
        assert store.drop("w") is (libc() is not None)
        if libc() is not None:
            assert not resident(store["w"]), "the dropped pages are still in the page cache"
        assert torch.equal(store["w"], tensor), "a dropped tensor reads back other values"
    finally:
        store.close()


def _mapped_halves(path, nbytes):
    """Two tensors mapping the two halves of a new file of ``nbytes`` bytes, its pages out of the page cache."""
    path.write_bytes(bytes(range(256)) * (nbytes // 256))
    fsync_path(path)  # the kernel drops clean pages only
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    whole = torch.frombuffer(mapped, dtype=torch.uint8)
    half = nbytes // 2
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return whole[:half], whole[half:]


@pytest.mark.skipif(libc() is None or not hasattr(os, "posix_fadvise"), reason="needs mincore and posix_fadvise")
def test_populating_with_the_file_range_reads_the_tensor_in_and_a_file_gone_is_no_error(tmp_path):
    first, second = _mapped_halves(tmp_path / "weights", 16 << 20)
    assert populate(first, tmp_path / "weights", 0) and resident(first)
    assert torch.equal(first[:256], torch.arange(256, dtype=torch.uint8))
    (tmp_path / "weights").unlink()  # the mapping still reads; advising the file by name cannot
    assert populate(second, tmp_path / "weights", 8 << 20) and resident(second)
    assert torch.equal(second[-256:], torch.arange(256, dtype=torch.uint8))
