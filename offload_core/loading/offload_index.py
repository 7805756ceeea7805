"""Tensors from an offload folder in accelerate's layout (``index.json`` and one ``<name>.dat`` file per tensor)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from offload_core.errors import StorageError


def read_offload_index(folder: str | Path, index: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """``index`` or, when ``None``, the ``index.json`` of ``folder``: tensor name -> ``{"dtype", "shape"}``."""
    if index is not None:
        return dict(index)
    path = Path(folder) / "index.json"
    if not path.is_file():
        raise StorageError(
            f"offload folder {folder} has no index.json: give offload_index or the folder it was written to"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StorageError(
            f"{path} cannot be read as JSON ({exc}); give the index.json the offload folder was written with"
        ) from None
    if not isinstance(data, dict) or not all(
        isinstance(v, dict) and "dtype" in v and isinstance(v.get("shape"), list) for v in data.values()
    ):
        raise StorageError(
            f'{path} is not an offload index (an object of tensor name -> {{"dtype", "shape"}}); '
            "give the index.json the offload folder was written with"
        )
    return data


def load_offloaded_tensor(folder: str | Path, name: str, info: Mapping[str, Any]) -> torch.Tensor:
    """The tensor ``name`` of ``folder``, read into memory (bfloat16 is stored as int16, as accelerate writes it)."""
    path = Path(folder) / f"{name}.dat"
    if not path.is_file():
        raise StorageError(f"offload folder {folder} lacks {path.name}: the folder does not match offload_index")
    shape = tuple(info["shape"]) or (1,)
    dtype = str(info["dtype"]).removeprefix("torch.")
    # an offload_core folder puts a tensor with an "offset" that many bytes into its file (storage/folder.py)
    array = np.memmap(
        path, dtype="int16" if dtype == "bfloat16" else dtype, mode="r", shape=shape, offset=int(info.get("offset", 0))
    )
    tensor = torch.from_numpy(np.array(array))
    if dtype == "bfloat16":
        tensor = tensor.view(torch.bfloat16)
    return tensor.reshape(tuple(info["shape"]))
