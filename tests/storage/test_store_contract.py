"""The Store contract declares every capability a module hook uses (spec, read_into, warm, read_expert, mapped_view,
offset, pinned) with its default; a plain mapping handed to a hook gets them at their "not supported" defaults, and no
hook probes a store or a checkpoint for them."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from offload_core.loading.checkpoint import Checkpoint
from offload_core.storage.base import MappingStore, Store, as_store
from offload_core.storage.folder import FolderStore
from offload_core.storage.gguf.store import GGUFStore
from offload_core.storage.inplace import InPlaceStore
from offload_core.storage.memory import HostMemoryStore
from offload_core.storage.packed import PackedMemoryStore

PACKAGE = Path(__file__).resolve().parents[2] / "offload_core"


class _Held(Store):
    """A store written against the contract with only the Mapping methods."""

    def __init__(self, tensors):
        self.tensors = tensors

    def __getitem__(self, name):
        return self.tensors[name]

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)


def test_a_store_gets_every_capability_at_its_default():
    tensor = torch.arange(12, dtype=torch.float32).view(3, 4)
    store = _Held({"w": tensor})
    assert store.spec("w") == (torch.Size([3, 4]), torch.float32)
    out = torch.empty(3, 4)
    store.read_into("w", out)
    assert torch.equal(out, tensor) and not store.reads_into and not store.pinned
    row = torch.empty(4)
    store.read_expert("w", 2, row)
    assert torch.equal(row, tensor[2]) and store.mapped_view("w") is None and store.drop("w") is False
    assert as_store(store) is store


def test_a_plain_mapping_is_a_store_that_supports_nothing_extra():
    tensors = {"w": torch.ones(2, 3)}
    store = as_store(tensors)
    assert isinstance(store, MappingStore) and store.tensors is tensors and list(store) == ["w"]
    assert store.warm("w") is False and store.offset("w") == 0 and store.mapped_view("w") is None
    assert (store.pinned, store.reads_into, store.packed("w"), store.moved_nbytes("w")) == (False, False, None, None)
    tensors["v"] = torch.zeros(1)  # a view of the mapping, not a copy
    assert len(store) == 2


def test_the_stores_that_build_a_tensor_on_read_say_so():
    assert all(cls.reads_into for cls in (FolderStore, InPlaceStore, GGUFStore, PackedMemoryStore))
    assert not HostMemoryStore.reads_into


def test_a_plain_checkpoint_declares_what_converted_ones_add():
    assert Checkpoint.is_gguf is False and Checkpoint.conversion_targets == frozenset()
    assert Checkpoint.parts(None, "w") is None and Checkpoint.part_ranges(None, "w") is None


def test_nothing_probes_a_store_or_a_checkpoint_with_getattr_or_hasattr():
    probe = re.compile(r"(getattr|hasattr)\((self\.)?(store|checkpoint|storage), *[\"']")  # by a member's name
    found = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if probe.search(line)
    ]
    assert not found, f"probing instead of the declared members: {found}"
