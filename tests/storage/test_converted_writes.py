"""A tensor stored in another dtype than the run's is cast a slice at a time where a store writes it, and in its
copy where it is loaded resident (never whole beside the weights already loaded); bit for bit the whole cast."""

from __future__ import annotations

import torch

from offload_core.storage import base
from offload_core.storage.base import CONVERT_SLICE, StoreContext, written
from offload_core.storage.filecopy import Slices
from offload_core.storage.folder import FolderStore


class Tensors:
    """A checkpoint of tensors by key, each read whole (not safetensors: an offload folder writes it from memory)."""

    is_safetensors = is_gguf = False
    conversion_targets: frozenset[str] = frozenset()

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def parts(self, key: str) -> None:
        return None

    def part_ranges(self, key: str) -> None:
        return None

    def fills(self, key: str) -> bool:
        return False

    def get(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].dtype


def test_a_converted_tensor_is_written_in_slices_equal_to_its_whole_cast():
    source = torch.randn(3 * CONVERT_SLICE // 4 + 5, dtype=torch.float32).to(
        torch.bfloat16
    )  # 3 slices and 20 bytes in float32
    data, dtype, offset = written(source, torch.float32, in_place=True)
    assert isinstance(data, Slices) and dtype == torch.float32 and offset == 0
    pieces = [bytes(piece) for piece in data.make()]
    assert [len(piece) for piece in pieces[:-1]] == [CONVERT_SLICE] * 3 and 0 < len(pieces[-1]) <= CONVERT_SLICE
    assert b"".join(pieces) == source.to(torch.float32).numpy().tobytes() and len(data) == sum(map(len, pieces))


def test_a_tensor_kept_in_its_dtype_is_written_whole_at_its_offset():
    base_tensor = torch.arange(40, dtype=torch.float16)
    tensor = base_tensor[3:]  # 6 bytes past an aligned address
    data, dtype, offset = written(tensor, torch.float16, in_place=True)
    assert bytes(data) == tensor.numpy().tobytes() and dtype == torch.float16 and offset == tensor.data_ptr() % 64
    assert written(tensor, None, in_place=False)[2] == 0  # copied into new memory by the in-memory load


def test_an_offload_folder_casts_a_checkpoint_tensor_slice_by_slice(tmp_path, monkeypatch):
    source = Tensors({"w": torch.randn(5, 1000, dtype=torch.float32).to(torch.float16)})
    casts = []
    real = torch.Tensor.to

    def counting(tensor, *args, **kwargs):
        out = real(tensor, *args, **kwargs)
        casts.append(out.nbytes)
        return out

    monkeypatch.setattr(base, "CONVERT_SLICE", 4096)
    monkeypatch.setattr(torch.Tensor, "to", counting)
    store = FolderStore(StoreContext(names=["w"], offload_folder=tmp_path / "off"))
    store.add_from_checkpoint("w", source, "w", torch.float32)
    monkeypatch.setattr(torch.Tensor, "to", real)
    assert casts and max(casts) <= 4096 and sum(casts) == 5 * 1000 * 4
    assert store["w"].dtype == torch.float32 and torch.equal(store["w"], source.tensors["w"].to(torch.float32))
    store.close()


def test_a_resident_tensor_is_cast_in_its_copy(monkeypatch):
    source = Tensors({"w": torch.randn(7, 300, dtype=torch.float32).to(torch.bfloat16)})
    expected = source.tensors["w"].to(torch.float32)
    casts = []
    real = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda tensor, *a, **k: casts.append(1) or real(tensor, *a, **k))
    held = base.read_tensor(
        source, "w", torch.float32, True, lambda shape, dtype, offset: torch.empty(shape, dtype=dtype)
    )
    monkeypatch.setattr(torch.Tensor, "to", real)
    assert not casts  # no converted copy beside the memory that holds it
    assert held.dtype == torch.float32 and torch.equal(held, expected)
