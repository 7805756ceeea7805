"""The offload folder copies checkpoint tensors file to file (``copy_file_range``, else ``sendfile``) when no
conversion is needed; its files are byte for byte those the user-space path (``put``) writes."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from offload_core.loading.checkpoint import Checkpoint
from offload_core.loading.writer import write_sharded_safetensors
from offload_core.errors import StorageError
from offload_core.storage import Store, StoreContext, convert_dtype
from offload_core.storage.filecopy import FileSpan
from offload_core.storage.folder import INDEX, TAG, FolderStore

from offload_core.testing import round_trip_tensors as sample_tensors


@pytest.fixture
def kernel_copies(monkeypatch) -> list[Path]:
    """The shards each file-to-file copy read from, in order."""
    seen: list[Path] = []
    real = FileSpan.copy_to

    def counting(span, fd):
        seen.append(span.path)
        real(span, fd)

    monkeypatch.setattr(FileSpan, "copy_to", counting)
    return seen


def _safetensors(tmp_path: Path) -> tuple[Checkpoint, dict[str, torch.Tensor]]:
    """Every round-trip dtype (0-d and empty included) over several shards."""
    tensors = {k: v.contiguous() for k, v in sample_tensors().items()}
    write_sharded_safetensors(tensors, tmp_path / "ckpt", max_shard_size=200)
    return Checkpoint.open(tmp_path / "ckpt"), tensors


def _fill(folder: Path, ckpt: Checkpoint, dtype: torch.dtype | None, add) -> FolderStore:
    keys = ckpt.keys()
    store = FolderStore(StoreContext(names=keys, offload_folder=folder, fingerprint={"v": 1}))
    for key in keys:
        add(store, key, ckpt, key, dtype)
    store.finalize()
    store.wait_until_sealed()
    return store


def _contents(folder: Path) -> tuple[dict[str, bytes], dict]:
    files = {p.name: p.read_bytes() for p in sorted(folder.glob("*.dat"))}
    return files, json.loads((folder / INDEX).read_text())


def _assert_same_folders(ckpt: Checkpoint, tmp_path: Path, dtype: torch.dtype | None) -> FolderStore:
    """Fill one folder through the store's own path and one through ``put`` (the user-space write); same bytes."""
    fast = _fill(tmp_path / "fast", ckpt, dtype, FolderStore.add_from_checkpoint)
    slow = _fill(tmp_path / "slow", ckpt, dtype, Store.add_from_checkpoint)
    slow.close()
    assert _contents(tmp_path / "fast") == _contents(tmp_path / "slow")
    return fast


def test_kernel_copy_writes_the_files_put_writes(tmp_path, kernel_copies):
    ckpt, tensors = _safetensors(tmp_path)
    assert len(ckpt.files) > 1
    store = _assert_same_folders(ckpt, tmp_path, None)
    assert len(kernel_copies) == len(tensors)  # every tensor went file to file
    assert set(kernel_copies) == set(ckpt.files)
    for name, expected in tensors.items():
        assert store[name].dtype == expected.dtype and torch.equal(store[name], expected), name
    assert store.bytes_written == sum(t.numel() * t.element_size() for t in tensors.values())
    store.close()


def test_a_converted_tensor_is_written_through_put(tmp_path, kernel_copies):
    ckpt, tensors = _safetensors(tmp_path)  # fp32, fp16 and bf16 tensors, run in float32
    store = _assert_same_folders(ckpt, tmp_path, torch.float32)
    kept = [k for k, t in tensors.items() if not t.is_floating_point() or t.dtype == torch.float32]
    assert len(kernel_copies) == len(kept) < len(tensors)  # f16 and bf16 were converted, in user space
    for name, t in tensors.items():
        expected = convert_dtype(t, torch.float32)
        assert store[name].dtype == expected.dtype and torch.equal(store[name], expected), name
    store.close()


def test_a_bin_checkpoint_and_a_non_contiguous_tensor_go_through_put(tmp_path, kernel_copies):
    tensors = sample_tensors()
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    ckpt = Checkpoint.open(tmp_path / "pytorch_model.bin")
    assert not ckpt.get("noncontig").is_contiguous()
    store = _assert_same_folders(ckpt, tmp_path, None)
    assert kernel_copies == []
    assert torch.equal(store["noncontig"], tensors["noncontig"])
    assert (tmp_path / "fast" / "noncontig.dat").read_bytes() == tensors["noncontig"].contiguous().numpy().tobytes()
    store.close()


@pytest.mark.parametrize("refusal", ["exdev", "copies nothing"])
def test_sendfile_copies_where_copy_file_range_cannot(tmp_path, monkeypatch, refusal):
    def refused(source, target, count, offset_src=None, offset_dst=None):
        if refusal == "exdev":
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        return 0

    sent, real_send = [], os.sendfile

    def send(*args):
        sent.append(args)
        return real_send(*args)

    monkeypatch.setattr(os, "copy_file_range", refused)
    monkeypatch.setattr(os, "sendfile", send)
    ckpt, _ = _safetensors(tmp_path)
    _assert_same_folders(ckpt, tmp_path, None).close()
    assert sent  # the bytes still went file to file


def test_a_shard_truncated_after_opening_is_a_clear_error(tmp_path):
    ckpt, _ = _safetensors(tmp_path)
    key = max(ckpt.keys(), key=ckpt.nbytes)
    shard = ckpt.file_of(key)
    start, end = ckpt.safetensors_file(shard).byte_range(key)
    os.truncate(shard, start + (end - start) // 2)
    folder = tmp_path / "off"
    store = FolderStore(StoreContext(names=[key], offload_folder=folder))
    with pytest.raises(StorageError, match=f"ends at byte {start + (end - start) // 2}.*re-download it"):
        store.add_from_checkpoint(key, ckpt, key, None)
    store.close()
    assert not folder.exists()  # the partial folder is gone


def test_the_tag_names_every_planned_file_before_any_is_written(tmp_path):
    folder = tmp_path / "off"
    store = FolderStore(StoreContext(names=["a", "b"], offload_folder=folder))
    assert json.loads((folder / TAG).read_text())["files"] == ["a.dat", "b.dat"]
    assert not list(folder.glob("*.dat"))
    store.put("c", torch.ones(2))  # a name not planned is added before its file is written
    assert json.loads((folder / TAG).read_text())["files"] == ["a.dat", "b.dat", "c.dat"]
    store.close()
