"""Where an offload folder puts a checkpoint tensor's bytes (at the offset an in-place load has it, or 0), and which
file range it hints to the kernel when a tensor is warmed or dropped."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from offload_core.alignment import ALIGNMENT, address_offset
from offload_core.loading.checkpoint import Checkpoint
from offload_core.loading.writer import write_sharded_safetensors
from offload_core.storage import StoreContext
from offload_core.storage.folder import INDEX, FolderStore
from offload_core.storage.pagecache import libc, resident

#: int8 tensors, stored in name order: "a" at the shard's data start, "b" empty, "c" three bytes later
TENSORS = {
    "a": torch.tensor([1, 2, 3], dtype=torch.int8),
    "b": torch.empty(0, dtype=torch.int8),
    "c": torch.tensor([4, 5, 6, 7, 8], dtype=torch.int8),
}


def _checkpoint(tmp_path: Path) -> Checkpoint:
    write_sharded_safetensors(TENSORS, tmp_path / "ckpt", max_shard_size=1 << 20)
    return Checkpoint.open(tmp_path / "ckpt")


@pytest.mark.parametrize("maps", [True, False])
def test_a_checkpoint_tensor_lies_where_an_in_place_load_has_it_or_at_0(tmp_path, maps):
    ckpt = _checkpoint(tmp_path)
    (shard,) = ckpt.files
    starts = {key: ckpt.safetensors_file(shard).byte_range(key)[0] for key in TENSORS}
    # safetensors pads its header to 8 bytes: "c" starts 3 bytes past a multiple of 8, "b" (empty) there too
    assert starts["c"] == starts["b"] == starts["a"] + 3 and starts["c"] % 8 == 3
    assert (
        address_offset(ckpt.get("c")) == starts["c"] % ALIGNMENT
    )  # an in-place load maps the shard whole: the file offset
    folder = tmp_path / "off"
    store = FolderStore(StoreContext(names=list(TENSORS), offload_folder=folder, maps_checkpoint=maps))
    for key in TENSORS:
        store.add_from_checkpoint(key, ckpt, key, None)
    store.finalize()
    store.wait_until_sealed()
    index = json.loads((folder / INDEX).read_text())
    offsets = (
        {"a": starts["a"] % ALIGNMENT, "b": 0, "c": starts["c"] % ALIGNMENT} if maps else dict.fromkeys(TENSORS, 0)
    )
    for key, tensor in TENSORS.items():
        entry = {"dtype": "int8", "shape": list(tensor.shape), **({"offset": offsets[key]} if offsets[key] else {})}
        assert index[key] == entry, key
        assert store.offset(key) == offsets[key]
        assert (folder / f"{key}.dat").read_bytes() == bytes(offsets[key]) + tensor.numpy().tobytes(), key
        assert store[key].dtype == torch.int8 and torch.equal(store[key], tensor), key  # the empty one too
    assert store.bytes_written == 8
    store.close()


@pytest.mark.parametrize("maps", [True, False])
def test_a_bin_checkpoint_view_keeps_its_reference_offset(tmp_path, maps):
    """A ``.bin`` file keeps views of one storage as views: loaded, "view" starts 12 bytes into "base"'s memory,
    which is where an in-place load has it (its reference offset); without an in-place load, 0."""
    base = torch.arange(40.0)
    torch.save({"base": base, "view": base[3:11]}, tmp_path / "pytorch_model.bin")
    ckpt = Checkpoint.open(tmp_path / "pytorch_model.bin")
    # torch allocates 64-byte aligned memory (ALIGNMENT): the loaded storage starts at offset 0
    assert address_offset(ckpt.get("base")) == 0 and address_offset(ckpt.get("view")) == 12
    expected = 12 if maps else 0
    folder = tmp_path / "off"
    store = FolderStore(StoreContext(names=["view"], offload_folder=folder, maps_checkpoint=maps))
    store.add_from_checkpoint("view", ckpt, "view", None)
    assert store.offset("view") == expected
    assert (folder / "view.dat").read_bytes() == bytes(expected) + base[3:11].numpy().tobytes()
    assert torch.equal(store["view"], base[3:11])
    store.close()


class Tensors:
    """The least a checkpoint can be: tensors by key, each read whole (no shards, not safetensors, no conversion)."""

    is_safetensors = is_gguf = False
    conversion_targets: frozenset[str] = frozenset()

    def parts(self, key: str) -> None:
        return None

    def part_ranges(self, key: str) -> None:
        return None

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def get(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].dtype


def test_a_checkpoint_with_only_tensors_is_written_through_put(tmp_path):
    source = Tensors({"h": torch.arange(6, dtype=torch.float16)})
    store = FolderStore(StoreContext(names=["h"], offload_folder=tmp_path / "off"))
    store.add_from_checkpoint("h", source, "h", torch.float32)  # converted
    store.add_from_checkpoint("k", source, "h", None)  # kept as stored
    assert store["h"].dtype == torch.float32 and torch.equal(store["h"], torch.arange(6.0))
    assert store["k"].dtype == torch.float16 and torch.equal(store["k"], source.tensors["h"])
    store.close()


@pytest.mark.skipif(libc() is None or not hasattr(os, "posix_fadvise"), reason="needs mincore and posix_fadvise")
def test_warming_and_dropping_hint_exactly_the_tensors_file_range(tmp_path, monkeypatch):
    base = torch.arange((1 << 20) + 3, dtype=torch.float32)
    tensor = base[3:]  # 4 MiB, 12 bytes past base's address
    offset = tensor.data_ptr() % ALIGNMENT
    store = FolderStore(StoreContext(names=["w"], offload_folder=tmp_path / "off"))
    store.put("w", tensor)
    store.finalize()
    store.wait_until_sealed()  # the file flushed: its clean pages can be dropped
    path, nbytes = store.file_of("w"), 4 << 20
    assert path == tmp_path / "off" / "w.dat" and store.offset("w") == offset
    real, calls = os.posix_fadvise, []

    def spying(fd, start, length, advice):
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), start, length, advice))

    try:
        monkeypatch.setattr(os, "posix_fadvise", spying)
        assert store.drop("w") is True
        assert calls == [(str(path), offset, nbytes, os.POSIX_FADV_DONTNEED)]
        monkeypatch.setattr(os, "posix_fadvise", real)
        assert store.drop("w") is True
        if resident(store["w"]):
            pytest.skip("this file system keeps the file in memory (the page cache cannot be dropped)")
        calls.clear()
        monkeypatch.setattr(os, "posix_fadvise", spying)
        assert store.warm("w") is True
        assert {(p, advice) for p, _, _, advice in calls} == {(str(path), os.POSIX_FADV_WILLNEED)}
        assert calls[0][1] == offset and sum(length for _, _, length, _ in calls) == nbytes  # the range, in pieces
        assert all(x + n == y for (_, x, n, _), (_, y, _, _) in zip(calls, calls[1:]))
        monkeypatch.setattr(os, "posix_fadvise", real)
        assert resident(store["w"]) and torch.equal(store["w"], tensor)
        assert store.warm("w") is True  # already in: no hint needed
    finally:
        store.close()
