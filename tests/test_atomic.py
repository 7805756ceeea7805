"""atomic_write: a file or folder appears whole under its name or not at all, and a failed write leaves nothing
behind."""

from __future__ import annotations

import pytest

from offload_core.atomic import atomic_write


def test_a_file_replaces_the_old_one_only_when_the_block_ends(tmp_path):
    target = tmp_path / "data.json"
    target.write_text("old")
    with atomic_write(target) as tmp:
        tmp.write_text("new")
        assert target.read_text() == "old" and tmp.parent == tmp_path
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["data.json"]


@pytest.mark.parametrize("error", [OSError, KeyboardInterrupt])
def test_a_failed_write_removes_its_temporary_and_keeps_the_old_file(tmp_path, error):
    target = tmp_path / "data.json"
    target.write_text("old")
    with pytest.raises(error):
        with atomic_write(target, sync=False) as tmp:
            tmp.write_text("half")
            raise error()
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["data.json"]


def test_a_folder_is_renamed_into_place_or_removed(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_write(tmp_path / "out", folder=True) as tmp:
            (tmp / "a").write_text("a")
            raise RuntimeError
    assert list(tmp_path.iterdir()) == []
    with atomic_write(tmp_path / "out", folder=True) as tmp:
        assert tmp.is_dir() and tmp.parent == tmp_path and not (tmp_path / "out").exists()
        (tmp / "a").write_text("a")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (tmp_path / "out" / "a").read_text() == "a"


def test_merging_into_an_existing_folder_moves_the_last_entries_last(tmp_path, monkeypatch):
    import os

    target = tmp_path / "out"
    target.mkdir()
    (target / "mine.txt").write_text("kept")
    moved, replace = [], os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (moved.append(os.path.basename(dst)), replace(src, dst)))
    with atomic_write(target, folder=True, merge=True, last=("index.json",)) as tmp:
        for name in ("index.json", "b.bin", "a.bin"):
            (tmp / name).write_text(name)
    assert moved[-1] == "index.json" and sorted(moved) == ["a.bin", "b.bin", "index.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in target.iterdir()) == ["a.bin", "b.bin", "index.json", "mine.txt"]
