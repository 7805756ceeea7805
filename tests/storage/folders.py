"""The offload folders the folder-store tests build: a store of given tensors, written and sealed unless an earlier
run's complete folder is reused."""

from __future__ import annotations

from pathlib import Path

import torch

from offload_core.storage import StoreContext
from offload_core.storage.folder import FolderStore


def build_folder(
    folder: Path | None, fingerprint: dict | None = None, verify: bool = True, *, tensors: dict[str, torch.Tensor]
) -> FolderStore:
    """A folder store of ``tensors`` in ``folder`` (a temporary one for None) under ``fingerprint``: written and
    finalized, or the complete folder an earlier run left there, reused."""
    context = StoreContext(names=list(tensors), offload_folder=folder, fingerprint=fingerprint or {"v": 1})
    store = FolderStore(context, verify=verify)
    if not store.reused:
        for name, tensor in tensors.items():
            store.put(name, tensor)
        store.finalize()
    return store
