"""The kept set and the streamed set: the split by budget, shrinking under (faked) memory pressure, and dropping a mapped tensor's pages."""

from __future__ import annotations

import torch

from offload_core.atomic import fsync_path
from offload_core.storage import StoreContext
from offload_core.storage.pagecache import libc, populate, resident
from offload_core.storage.residency import Residency, page_cache_budget

GIB = 1 << 30


def test_blocks_are_kept_in_order_while_they_fit_and_the_rest_streamed():
    residency = Residency(budget=250)
    residency.assign([("a", 100), ("b", 100), ("c", 100), ("d", 40)])
    assert list(residency.kept) == ["a", "b", "d"]
    assert list(residency.streamed) == ["c"]
    assert residency.kept_bytes == 240 and residency.streamed_bytes == 100


def test_a_zero_budget_streams_every_block():
    residency = Residency(budget=0)
    residency.assign([("a", 1), ("b", 1)])
    assert not residency.kept and list(residency.streamed) == ["a", "b"]


def test_the_budget_is_the_explicit_size_else_available_memory_less_the_margin():
    assert page_cache_budget(123, available=lambda: 10 * GIB) == 123
    assert page_cache_budget(None, available=lambda: 10 * GIB, margin=GIB) == 9 * GIB
    assert page_cache_budget(None, available=lambda: GIB // 2, margin=GIB) == 0


def test_the_kept_set_shrinks_when_available_memory_falls_and_reports_it():
    free = {"bytes": 100 * GIB}
    residency = Residency(budget=4 * GIB, available=lambda: free["bytes"], margin=GIB)
    residency.assign([(f"layer{i}", GIB) for i in range(6)])
    assert residency.kept_bytes == 4 * GIB
    assert residency.check() == [] and residency.shrinks == 0
    free["bytes"] = 3 * GIB  # another process grew: 2 GiB may stay cached now
    moved = residency.check()
    assert moved == ["layer3", "layer2"]
    assert residency.kept_bytes == 2 * GIB and list(residency.streamed)[:2] == ["layer2", "layer3"]
    counters = residency.counters()
    assert counters["kept_shrinks"] == 1 and counters["kept_shrunk_bytes"] == 2 * GIB


def test_dropping_a_mapped_tensor_takes_its_pages_out_of_the_page_cache(tmp_path):
    from offload_core.storage.folder import FolderStore

    tensor = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    store = FolderStore(StoreContext(names=["w"], offload_folder=tmp_path / "off"))
    store.put("w", tensor)
    store.finalize()
    fsync_path(store.file_of("w"))  # the kernel drops clean pages only: a freshly written file's are dirty
    try:
        assert populate(store["w"]) and resident(store["w"])
        assert store.drop("w") is (libc() is not None)
        if libc() is not None:
            assert not resident(store["w"]), "the dropped pages are still in the page cache"
        assert torch.equal(store["w"], tensor), "a dropped tensor reads back other values"
    finally:
        store.close()
