"""Atomic sharded safetensors writing: layout and index, tied tensors once, nothing left on failure, no overwrite."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from offload_core.errors import CheckpointError
from offload_core.loading.checkpoint import Checkpoint
from offload_core.loading.safetensors_file import SafetensorsFile
from offload_core.loading.writer import write_safetensors_shards, write_sharded_safetensors


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def small_state(prefix: str = "", n: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(len(prefix))
    return {f"{prefix}layer{i}.weight": torch.randn(8, 8, generator=gen) for i in range(n)}


# -- writing -------------------------------------------------------------------------------------


def test_write_sharded_layout_and_index(tmp_path):
    state = {**small_state("a."), **small_state("b."), **small_state("c.")}
    out = write_sharded_safetensors(state, tmp_path / "out", max_shard_size=1100, metadata={"who": "test"})
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 12 * 256
    assert set(index["weight_map"]) == set(state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp dir left behind
    for shard in names[:3]:
        loaded = load_file(str(out / shard))
        for key, value in loaded.items():
            assert index["weight_map"][key] == shard
            assert torch.equal(value, state[key])
    with SafetensorsFile(out / names[0]) as sf:
        assert sf.metadata == {"format": "pt", "who": "test"}


def test_write_single_file_when_it_fits(tmp_path):
    out = write_sharded_safetensors(small_state(), tmp_path / "out", max_shard_size=10**9)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_tied_tensors_are_written_once(tmp_path):
    embed = torch.randn(16, 4)
    state = {"embed.weight": embed, "mid.weight": torch.randn(4, 4), "lm_head.weight": embed}
    out = write_sharded_safetensors(state, tmp_path / "one", max_shard_size=10**9)
    with Checkpoint.open(out) as ckpt:
        assert sorted(ckpt.keys()) == ["embed.weight", "mid.weight"]
        assert json.loads(ckpt.safetensors_file(ckpt.files[0]).metadata["offload_core.tied"]) == {
            "lm_head.weight": "embed.weight"
        }
    out = write_sharded_safetensors(state, tmp_path / "many", max_shard_size=64)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]
    assert index["metadata"]["tied"] == {"lm_head.weight": "embed.weight"}


def test_distinct_views_of_one_storage_are_saved_as_copies(tmp_path):
    base = torch.arange(8, dtype=torch.float32)
    out = write_sharded_safetensors({"lo": base[:4], "hi": base[4:]}, tmp_path / "v", max_shard_size=10**9)
    loaded = load_file(str(out / "model.safetensors"))
    assert loaded["lo"].tolist() == [0, 1, 2, 3] and loaded["hi"].tolist() == [4, 5, 6, 7]


def test_failed_write_leaves_nothing(tmp_path):
    def produce(name):
        if name == "b":
            raise RuntimeError("disk on fire")
        return torch.zeros(4)

    with pytest.raises(RuntimeError, match="disk on fire"):
        write_safetensors_shards(tmp_path / "out", [["a"], ["b"]], produce)
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_overwrite_existing_weights(tmp_path):
    write_sharded_safetensors(small_state(), tmp_path / "out", max_shard_size=10**9)
    before = digest(tmp_path / "out" / "model.safetensors")
    with pytest.raises(CheckpointError, match="already holds weights"):
        write_sharded_safetensors(small_state("x"), tmp_path / "out", max_shard_size=10**9)
    assert digest(tmp_path / "out" / "model.safetensors") == before


def test_writes_into_an_existing_empty_directory(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    write_sharded_safetensors(small_state(), tmp_path / "out", max_shard_size=600)
    assert sorted(p.name for p in (tmp_path / "out").iterdir())[-1] == "model.safetensors.index.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with Checkpoint.open(tmp_path / "out") as ckpt:
        assert len(ckpt.keys()) == 4
