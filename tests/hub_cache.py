"""A checkpoint folder laid out in a Hugging Face Hub cache as huggingface_hub's downloads leave it: content-addressed
``blobs/``, ``snapshots/<commit>/<file>`` relative symlinks into them and ``refs/<branch>`` naming the commit."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

#: files the Hub stores with Git LFS: their blob is named by the sha256 of their bytes (others: the git blob sha1)
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def repo_folder(cache: Path, repo_id: str) -> Path:
    """``models--org--name``, the folder of a model repo in the cache (huggingface_hub's ``repo_folder_name``)."""
    return cache / ("models--" + repo_id.replace("/", "--"))


def blob_id(name: str, data: bytes) -> str:
    if name.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def as_hub_cache(
    folder: Path,
    cache: Path,
    repo_id: str,
    ref: str = "main",
    commit: str | None = None,
    skip: tuple[str, ...] = (),
    hardlink: bool = False,
) -> Path:
    """Lay out every file under ``folder`` (but those named in ``skip``) in the Hub cache ``cache`` as the repo
    ``repo_id`` at ``ref``; returns the snapshot folder (``.../snapshots/<commit>``). The commit is a digest of the
    files unless given. ``hardlink``: a blob is a hard link to its file where the file system allows (a large model
    is not copied)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in skip)
    blobs = {p.relative_to(folder).as_posix(): (blob_id(p.name, p.read_bytes()), p) for p in files}
    commit = commit or hashlib.sha1("".join(f"{k}:{v[0]}" for k, v in blobs.items()).encode()).hexdigest()
    repo = repo_folder(cache, repo_id)
    snapshot = repo / "snapshots" / commit
    for relative, (blob_name, source) in blobs.items():
        blob = repo / "blobs" / blob_name
        if not blob.exists():
            blob.parent.mkdir(parents=True, exist_ok=True)
            try:
                if not hardlink:
                    raise OSError
                os.link(source, blob)
            except OSError:
                blob.write_bytes(source.read_bytes())
        link = snapshot / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)  # relative, as huggingface_hub's _create_symlink makes it
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


def save_bin_shards(state: dict[str, torch.Tensor], folder: Path, shards: int = 2) -> None:
    """``state`` as older transformers saved it: ``pytorch_model-0000i-of-0000n.bin`` files and
    ``pytorch_model.bin.index.json`` (one ``pytorch_model.bin`` where ``shards`` is 1)."""
    state = {key: tensor.clone() for key, tensor in state.items()}
    if shards == 1:
        torch.save(state, folder / "pytorch_model.bin")
        return
    keys = list(state)
    weight_map = {}
    for number in range(1, shards + 1):
        part = keys[(number - 1) * len(keys) // shards : number * len(keys) // shards]
        name = f"pytorch_model-{number:05d}-of-{shards:05d}.bin"
        torch.save({key: state[key] for key in part}, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())}}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))
