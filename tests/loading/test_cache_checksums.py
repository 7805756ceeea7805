"""A model cache offload_core builds carries xxh3 checksums written with it and is verified before use: damaged bytes
(even with the file's times put back) are rebuilt with one line saying why, never used."""

from __future__ import annotations

import json
import os

from offload_core.loading import sources
from offload_core.loading.cache_checksums import CHECKSUMS


def _build(monkeypatch, tmp_path):
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path))
    return sources.synthetic_checkpoint(**sources.synthetic_preset("tiny"))


def _contents(folder):
    return {p.name: p.read_bytes() for p in folder.glob("*.safetensors")}


def test_damaged_cache_is_rebuilt_with_one_line(tmp_path, monkeypatch, capsys):
    folder = _build(monkeypatch, tmp_path)
    recorded = json.loads((folder / CHECKSUMS).read_text())["files"]
    shards = sorted(folder.glob("*.safetensors"))
    assert {p.name for p in shards} <= set(recorded) and "config.json" in recorded
    good = _contents(folder)
    assert _build(monkeypatch, tmp_path) == folder and capsys.readouterr().err == ""  # verified, used as it is
    shard = shards[0]
    before = shard.stat()
    with open(shard, "r+b") as f:  # random bytes over the tensors, the size unchanged and the times put back
        f.seek(before.st_size - 4096)
        f.write(os.urandom(4096))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert _build(monkeypatch, tmp_path) == folder
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{shard.name} does not match its checksum" in err and "building it again" in err
    assert _contents(folder) == good


def test_a_missing_file_or_checksums_file_is_named(tmp_path, monkeypatch, capsys):
    folder = _build(monkeypatch, tmp_path)
    (folder / "config.json").unlink()
    _build(monkeypatch, tmp_path)
    assert "config.json is missing" in capsys.readouterr().err and (folder / "config.json").is_file()
    (folder / CHECKSUMS).write_text("[1, 2]")
    _build(monkeypatch, tmp_path)
    assert f"its {CHECKSUMS} file cannot be read" in capsys.readouterr().err
    assert json.loads((folder / CHECKSUMS).read_text())["files"]


def test_a_cache_built_before_checksums_is_hashed_once(tmp_path, monkeypatch, capsys):
    folder = _build(monkeypatch, tmp_path)
    (folder / CHECKSUMS).unlink()
    assert _build(monkeypatch, tmp_path) == folder and capsys.readouterr().err == ""
    assert json.loads((folder / CHECKSUMS).read_text())["files"]
