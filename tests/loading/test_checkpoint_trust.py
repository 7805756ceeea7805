"""Checkpoint parsing that trusts nothing: overlapping data ranges (hidden behind 0-byte tensors too), shard names
leaving the folder, garbage ``.bin`` files, and a fingerprint that notices rewritten shards."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from offload_core.errors import CheckpointError
from offload_core.loading.checkpoint import Checkpoint


def raw_safetensors(path: Path, entries: dict[str, tuple[str, list[int], list[int]]], data_len: int) -> Path:
    header = {
        key: {"dtype": dtype, "shape": shape, "data_offsets": offsets}
        for key, (dtype, shape, offsets) in entries.items()
    }
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data_len))
    return path


@pytest.mark.parametrize(
    "entries",
    [
        # overlap hidden behind a 0-byte tensor between the two ranges (neighbours alone look fine)
        {"a": ("F32", [25], [0, 100]), "z": ("F32", [0], [50, 50]), "b": ("F32", [25], [50, 150])},
        # a range inside another, with a third in between in sorted order
        {"a": ("F32", [50], [0, 200]), "b": ("F32", [5], [10, 30]), "c": ("F32", [5], [40, 60])},
        # same start
        {"a": ("F32", [4], [0, 16]), "b": ("F32", [4], [0, 16])},
    ],
    ids=["hidden-behind-0-byte", "nested", "same-start"],
)
def test_overlapping_ranges_are_refused(entries, tmp_path):
    path = raw_safetensors(tmp_path / "model.safetensors", entries, 200)
    with pytest.raises(CheckpointError, match="overlap"):
        Checkpoint.open(path)


def test_a_0_byte_tensor_past_the_end_is_refused(tmp_path):
    path = raw_safetensors(
        tmp_path / "model.safetensors", {"a": ("F32", [4], [0, 16]), "z": ("F32", [0], [99, 99])}, 16
    )
    with pytest.raises(CheckpointError, match="truncated"):
        Checkpoint.open(path)


def test_adjacent_and_empty_tensors_are_fine(tmp_path):
    save_file({"a": torch.ones(4), "z": torch.ones(0), "b": torch.zeros(3)}, tmp_path / "model.safetensors")
    with Checkpoint.open(tmp_path) as ckpt:
        assert torch.equal(ckpt.get("b"), torch.zeros(3)) and ckpt.get("z").numel() == 0


@pytest.mark.parametrize("shard", ["../elsewhere/x.safetensors", "/etc/passwd", ".", "sub/../../x.safetensors"])
def test_shard_names_are_confined_to_the_checkpoint_folder(shard, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (tmp_path / "elsewhere").mkdir()
    save_file({"w": torch.ones(2)}, tmp_path / "elsewhere" / "x.safetensors")
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    with pytest.raises(CheckpointError, match="not a file inside that folder"):
        Checkpoint.open(root)


def test_random_bytes_in_a_bin_file_are_called_what_they_are(tmp_path):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(os.urandom(4096).replace(b"\x80", b"\x81"))
    with pytest.raises(CheckpointError) as error:
        Checkpoint.open(path)
    assert "could run code" not in str(error.value) and "is not a PyTorch weights file" in str(error.value)


def test_an_empty_bin_file_is_unreadable_not_dangerous(tmp_path):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError) as error:
        Checkpoint.open(path)
    assert "could run code" not in str(error.value)


def test_the_fingerprint_notices_a_rewrite_with_the_same_size_and_mtime(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(8)}, path)
    stat = path.stat()
    with Checkpoint.open(tmp_path) as ckpt:
        before = ckpt.fingerprint()
    save_file({"w": torch.full((8,), 2.0)}, path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    with Checkpoint.open(tmp_path) as ckpt:
        assert ckpt.fingerprint() != before


def test_the_fingerprint_is_stable_when_nothing_changed(tmp_path):
    save_file({"w": torch.ones(8)}, tmp_path / "model.safetensors")
    with Checkpoint.open(tmp_path) as a, Checkpoint.open(tmp_path) as b:
        assert a.fingerprint() == b.fingerprint()
