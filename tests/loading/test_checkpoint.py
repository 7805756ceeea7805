"""SafetensorsFile / Checkpoint reading (zero-copy, validation, unsafe pickles) and atomic sharded writing."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload_core.loading.checkpoint import Checkpoint
from offload_core.loading.safetensors_file import SAFETENSORS_DTYPES, SafetensorsFile
from offload_core.loading.writer import write_sharded_safetensors
from offload_core.errors import CheckpointError


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def raw_safetensors(path: Path, header: dict, data: bytes = b"", header_len: int | None = None) -> Path:
    """Write a safetensors file by hand so it can be malformed on purpose."""
    blob = json.dumps(header).encode()
    length = len(blob) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", length) + blob + data)
    return path


def all_dtype_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "f16": torch.randn(7, generator=gen).to(torch.float16),
        "f32": torch.randn(2, 3, 4, generator=gen),
        "f64": torch.randn(3, generator=gen, dtype=torch.float64),
        "i8": torch.randint(-128, 127, (9,), generator=gen, dtype=torch.int8),
        "u8": torch.randint(0, 255, (4, 2), generator=gen, dtype=torch.uint8),
        "i16": torch.randint(-1000, 1000, (5,), generator=gen, dtype=torch.int16),
        "i32": torch.randint(-(10**6), 10**6, (6,), generator=gen, dtype=torch.int32),
        "i64": torch.randint(-(10**12), 10**12, (3, 1), generator=gen, dtype=torch.int64),
        "bool": torch.tensor([[True, False, True], [False, False, True]]),
        "scalar": torch.tensor(3.5),
        "scalar_i64": torch.tensor(-7, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "empty_bf16": torch.empty(2, 0, dtype=torch.bfloat16),
    }
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            tensors[name] = torch.randn(4, 4, generator=gen).to(getattr(torch, name))
    return tensors


# -- SafetensorsFile -----------------------------------------------------------------------------


def test_round_trip_every_dtype_matches_safetensors(tmp_path):
    tensors = all_dtype_tensors()
    path = tmp_path / "all.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "x"})
    reference = load_file(str(path))
    with SafetensorsFile(path) as sf:
        assert sorted(sf.keys()) == sorted(tensors)
        assert sf.metadata == {"format": "pt", "note": "x"}
        for key, expected in reference.items():
            got = sf.get(key)
            assert got.dtype == expected.dtype == sf.dtype(key), key
            assert tuple(got.shape) == tuple(expected.shape) == sf.shape(key), key
            assert sf.nbytes(key) == expected.numel() * expected.element_size()
            start, end = sf.byte_range(key)
            assert end - start == sf.nbytes(key)
            assert got.reshape(-1).view(torch.uint8).tolist() == expected.reshape(-1).view(torch.uint8).tolist(), key


def test_every_safetensors_dtype_name_is_readable(tmp_path):
    for name, dtype in SAFETENSORS_DTYPES.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        path = raw_safetensors(
            tmp_path / f"{name}.safetensors",
            {"t": {"dtype": name, "shape": [2], "data_offsets": [0, 2 * itemsize]}},
            bytes(2 * itemsize),
        )
        with SafetensorsFile(path) as sf:
            assert sf.get("t").dtype == dtype


def _file_mappings(path: Path) -> list[tuple[int, int]]:
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == str(path.resolve()):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                spans.append((lo, hi))
    return spans


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see mappings")
def test_get_is_a_zero_copy_view_of_the_file_mapping(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(64, 64, dtype=torch.bfloat16)}, str(path))
    with SafetensorsFile(path) as sf:
        a, b = sf.get("a"), sf.get("b")
        spans = _file_mappings(path)
        assert spans, "the file is not mapped"
        for tensor in (a, b):
            ptr = tensor.data_ptr()
            assert any(lo <= ptr and ptr + tensor.nbytes <= hi for lo, hi in spans)
        # Offsets inside the mapping are the offsets inside the file.
        assert b.data_ptr() - a.data_ptr() == sf.byte_range("b")[0] - sf.byte_range("a")[0]
        assert sf.get("a").data_ptr() == a.data_ptr()


def test_writing_to_a_returned_tensor_never_touches_the_file(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(256)}, str(path))
    before = digest(path)
    with SafetensorsFile(path) as sf:
        view = sf.get("a")
        view.fill_(42.0)
        assert view.sum() == 42.0 * 256
    assert digest(path) == before
    with SafetensorsFile(path) as again:
        assert again.get("a").sum() == 0


def test_tensors_outlive_close_and_the_file_object(tmp_path):
    import gc

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(4096, dtype=torch.float32)}, str(path))
    sf = SafetensorsFile(path)
    tensor = sf.get("a")
    sf.close()
    del sf
    gc.collect()
    assert tensor.sum().item() == sum(range(4096))


def test_opening_reads_only_the_header(tmp_path):
    path = tmp_path / "huge.safetensors"
    nbytes = 8 * 2**30  # a sparse 8 GiB tensor: parsing must not read it
    raw_safetensors(path, {"big": {"dtype": "BF16", "shape": [2**32], "data_offsets": [0, nbytes]}})
    os.truncate(path, path.stat().st_size + nbytes)
    with Checkpoint.open(tmp_path) as ckpt:
        assert ckpt.nbytes("big") == nbytes
        assert ckpt.shape("big") == (2**32,)
        assert ckpt.total_bytes() == nbytes


MALFORMED = {
    "too_short": (lambda p: p.write_bytes(b"\x01\x02\x03"), "truncated"),
    "absurd_header": (lambda p: p.write_bytes(struct.pack("<Q", 2**62) + b"{}"), "header claims"),
    "header_past_end": (lambda p: raw_safetensors(p, {}, header_len=500), "header claims"),
    "bad_json": (lambda p: p.write_bytes(struct.pack("<Q", 5) + b"{nope"), "not valid JSON"),
    "not_object": (lambda p: raw_safetensors(p, [1, 2]), "not a JSON object"),
    "truncated": (
        lambda p: raw_safetensors(p, {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8)),
        "is truncated: tensor 'x' ends at byte",
    ),
    "offsets_reversed": (
        lambda p: raw_safetensors(p, {"x": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}, bytes(8)),
        "data_offsets",
    ),
    "offsets_negative": (
        lambda p: raw_safetensors(p, {"x": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, bytes(8)),
        "data_offsets",
    ),
    "overlap": (
        lambda p: raw_safetensors(
            p,
            {
                "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            bytes(12),
        ),
        "overlap",
    ),
    "unknown_dtype": (
        lambda p: raw_safetensors(p, {"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8)),
        "'C64'",
    ),
    "size_mismatch": (
        lambda p: raw_safetensors(p, {"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)),
        "needs 12 bytes",
    ),
    "missing_fields": (lambda p: raw_safetensors(p, {"x": {"dtype": "F32"}}, bytes(8)), "lacks"),
    "bad_shape": (
        lambda p: raw_safetensors(p, {"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4)),
        "shape",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_files_fail_with_one_clear_line_and_stay_unchanged(tmp_path, case):
    make, expected = MALFORMED[case]
    path = tmp_path / "model-00002.safetensors"
    make(path)
    before = digest(path)
    with pytest.raises(CheckpointError) as info:
        SafetensorsFile(path)
    message = str(info.value)
    assert expected in message
    assert str(path) in message
    assert "\n" not in message
    assert digest(path) == before
    with pytest.raises(CheckpointError):
        Checkpoint.open(tmp_path)
    assert digest(path) == before


# -- Checkpoint ----------------------------------------------------------------------------------


def small_state(prefix: str = "", n: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(len(prefix))
    return {f"{prefix}layer{i}.weight": torch.randn(8, 8, generator=gen) for i in range(n)}


def test_single_file_directory_and_file_path(tmp_path):
    state = small_state()
    save_file(state, str(tmp_path / "model.safetensors"))
    for target in (tmp_path, tmp_path / "model.safetensors"):
        with Checkpoint.open(target) as ckpt:
            assert ckpt.is_safetensors
            assert ckpt.files == [tmp_path / "model.safetensors"]
            assert sorted(ckpt.keys()) == sorted(state)
            for key, value in state.items():
                assert torch.equal(ckpt.get(key), value)
                assert ckpt.dtype(key) == torch.float32 and ckpt.shape(key) == (8, 8) and ckpt.nbytes(key) == 256
            assert ckpt.total_bytes() == 4 * 256
            assert ckpt.safetensors_file(ckpt.files[0]) is ckpt.safetensors_file(ckpt.files[0])


def test_sharded_directory_keeps_shard_order(tmp_path):
    state = {**small_state("a."), **small_state("b."), **small_state("c.")}
    write_sharded_safetensors(state, tmp_path / "ckpt", max_shard_size=1100)
    with Checkpoint.open(tmp_path / "ckpt") as ckpt:
        assert ckpt.index_file == tmp_path / "ckpt" / "model.safetensors.index.json"
        assert len(ckpt.files) == 3
        shards = ckpt.shards()
        assert [path for path, _ in shards] == ckpt.files
        assert ckpt.keys() == [key for _, keys in shards for key in keys]
        assert sorted(ckpt.keys()) == sorted(state)
        for path, keys in shards:
            for key in keys:
                assert ckpt.file_of(key) == path
                assert torch.equal(ckpt.get(key), state[key])


def test_several_safetensors_without_index_are_all_used(tmp_path):
    save_file(small_state("a."), str(tmp_path / "part-b.safetensors"))
    save_file(small_state("b."), str(tmp_path / "part-a.safetensors"))
    with Checkpoint.open(tmp_path) as ckpt:
        assert ckpt.files == [tmp_path / "part-a.safetensors", tmp_path / "part-b.safetensors"]
        assert len(ckpt.keys()) == 8


def test_duplicate_keys_across_shards_name_the_key_and_both_files(tmp_path):
    save_file(small_state("a."), str(tmp_path / "one.safetensors"))
    save_file(small_state("a."), str(tmp_path / "two.safetensors"))
    with pytest.raises(CheckpointError, match=r"'a\.layer0\.weight' is in both one\.safetensors and two\.safetensors"):
        Checkpoint.open(tmp_path)


def test_index_naming_a_missing_shard(tmp_path):
    write_sharded_safetensors({**small_state("a."), **small_state("b.")}, tmp_path / "c", max_shard_size=1100)
    (tmp_path / "c" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors .* missing"):
        Checkpoint.open(tmp_path / "c")


def test_index_that_does_not_match_its_shard(tmp_path):
    write_sharded_safetensors({**small_state("a."), **small_state("b.")}, tmp_path / "c", max_shard_size=1100)
    index_path = tmp_path / "c" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'ghost.weight'"):
        Checkpoint.open(tmp_path / "c")


def test_missing_empty_and_odd_paths(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint.open(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"no weights found .*model\.safetensors\.index\.json"):
        Checkpoint.open(tmp_path)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError, match="not a .safetensors"):
        Checkpoint.open(tmp_path / "notes.txt")
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "pipe")
        with pytest.raises(CheckpointError, match="neither a directory nor a regular file"):
            Checkpoint.open(tmp_path / "pipe")


def test_bin_single_and_indexed(tmp_path):
    state = {**small_state("a."), "tok": torch.arange(5)}
    single = tmp_path / "single"
    single.mkdir()
    torch.save(state, single / "pytorch_model.bin")
    with Checkpoint.open(single) as ckpt:
        assert not ckpt.is_safetensors
        assert sorted(ckpt.keys()) == sorted(state)
        for key, value in state.items():
            assert torch.equal(ckpt.get(key), value)
            assert ckpt.dtype(key) == value.dtype and ckpt.shape(key) == tuple(value.shape)
        assert ckpt.total_bytes() == sum(v.numel() * v.element_size() for v in state.values())

    indexed = tmp_path / "indexed"
    indexed.mkdir()
    first, second = small_state("a."), small_state("b.")
    torch.save(first, indexed / "pytorch_model-00001-of-00002.bin")
    torch.save(second, indexed / "pytorch_model-00002-of-00002.bin")
    weight_map = {k: "pytorch_model-00001-of-00002.bin" for k in first}
    weight_map.update({k: "pytorch_model-00002-of-00002.bin" for k in second})
    (indexed / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with Checkpoint.open(indexed) as ckpt:
        assert [p.name for p, _ in ckpt.shards()] == [
            "pytorch_model-00001-of-00002.bin",
            "pytorch_model-00002-of-00002.bin",
        ]
        assert torch.equal(ckpt.get("b.layer1.weight"), second["b.layer1.weight"])
        assert ckpt.fingerprint()["files"][-1]["name"] == "pytorch_model.bin.index.json"


class _Payload:
    """Unpickling this creates ``marker``: stands in for any code a hostile pickle could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_the_payload_really_runs_under_plain_pickle(tmp_path):
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_Payload(marker)))
    assert marker.exists()


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_malicious_bin_is_refused_and_never_runs(tmp_path, fmt):
    marker = tmp_path / "pwned"
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    evil = {"w": torch.zeros(2), "x": _Payload(marker)}
    target = ckpt_dir / "pytorch_model.bin"
    if fmt == "zip":
        torch.save(evil, target)
    else:
        torch.save(evil, target, _use_new_zipfile_serialization=False)
    before = digest(target)
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(ckpt_dir)
    message = str(info.value)
    assert "contains Python objects beyond tensors; refusing to unpickle it" in message
    assert "Convert it to safetensors" in message and "\n" not in message
    assert not marker.exists()
    assert digest(target) == before


def test_bin_that_is_not_a_state_dict(tmp_path):
    torch.save([torch.zeros(1)], tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="not a flat state dict"):
        Checkpoint.open(tmp_path)


def test_fingerprint_changes_when_a_file_changes(tmp_path):
    write_sharded_safetensors({**small_state("a."), **small_state("b.")}, tmp_path / "c", max_shard_size=1100)
    with Checkpoint.open(tmp_path / "c") as ckpt:
        first = ckpt.fingerprint()
        assert [f["name"] for f in first["files"]] == [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
        ]
        assert ckpt.fingerprint() == first
    shard = tmp_path / "c" / "model-00002-of-00002.safetensors"
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with Checkpoint.open(tmp_path / "c") as ckpt:
        assert ckpt.fingerprint() != first
