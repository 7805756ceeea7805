"""The block pool's layout worked by hand: ``pool_shape`` (what planning reserves before any prefetcher exists) and
where a prefetcher puts each of a unit's tensors in a block buffer (``unit_bytes``, the views a loaded unit runs on)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_core.module_hooks.prefetch import Prefetcher
from offload_core.module_hooks.prefetch.layout import ALIGN, pool_shape
from offload_core.module_hooks.units import TransferStats, find_units
from offload_core.storage.base import Store

CPU, GPU = torch.device("cpu"), torch.device("cuda")  # a device object only: nothing is allocated on it


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(16))  # 64 bytes in float32
        self.register_buffer("b", torch.zeros(3, dtype=torch.int32))  # 12 bytes


class Block(nn.Module):
    """The no-split block: a projection, an integer buffer, and a module shared with the other block."""

    def __init__(self, n: int, shared: Shared) -> None:
        super().__init__()
        self.proj = nn.Linear(n, n, bias=False)  # n * n float32
        self.register_buffer("steps", torch.zeros(40, dtype=torch.int64))  # 320 bytes
        self.shared = shared


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(64))  # 256 bytes, a direct tensor of a container: a unit of its own
        shared = Shared()
        self.blocks = nn.ModuleList([Block(8, shared), Block(16, shared)])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(3))  # 12 bytes: the root's own unit, named ""
        self.h = Stack()


def test_the_units_the_shape_counts():
    """Units "" (gain), "h" (scale), "h.blocks.0" and "h.blocks.1" (each with the shared module under its own name):
    "h.blocks.1" sits in "h", which sits in "": three units loaded at once at most."""
    net = Net()
    names = {name: name for name, _ in net.named_parameters(remove_duplicate=False)}
    names.update({name: name for name, _ in net.named_buffers(remove_duplicate=False)})
    units = find_units(net, names, ["Block"], "block")
    assert [u.name for u in units] == ["", "h", "h.blocks.0", "h.blocks.1"]
    assert units[3].keys == ["h.blocks.1.steps", "h.blocks.1.proj.weight", "h.blocks.1.shared.w", "h.blocks.1.shared.b"]


@pytest.mark.parametrize(
    ("device", "dtype", "capacity"),
    [
        # On a CPU each tensor may start at its reference offset (< ALIGN): ALIGN more, then aligned.
        # block 1: proj 16*16*4 = 1024 + 256 -> 1280; steps 320 + 256 -> 768; shared.w 64 + 256 -> 512;
        # shared.b 12 + 256 -> 512: 3072 (block 0: 512 + 768 + 512 + 512 = 2304; "h" 512; "" 512)
        (CPU, None, 3072),
        # Elsewhere only aligned: 1024 + 512 + 256 + 256 = 2048
        (GPU, None, 2048),
        # A float16 run halves the floating tensors only: proj 512 -> 512; steps (int64) 320 -> 512;
        # shared.w 32 -> 256; shared.b (int32) 12 -> 256: 1536
        (GPU, torch.float16, 1536),
        # ... and on a CPU: 512 + 256 -> 768; 320 + 256 -> 768; 32 + 256 -> 512; 12 + 256 -> 512: 2560
        (CPU, torch.float16, 2560),
    ],
)
def test_pool_shape_worked_by_hand(device, dtype, capacity):
    assert pool_shape(Net(), ["Block"], dtype, device) == (3, capacity)


def test_a_unit_of_exactly_aligned_bytes_takes_no_more():
    # 64 float32 = 256 bytes = ALIGN exactly: 256 on a GPU, 256 + 256 = 512 on a CPU; one unit, no nesting
    assert pool_shape(nn.Linear(8, 8, bias=False), [], None, GPU) == (1, ALIGN)
    assert pool_shape(nn.Linear(8, 8, bias=False), [], None, CPU) == (1, 2 * ALIGN)


def test_pool_shape_of_a_model_without_tensors():
    assert pool_shape(nn.Sequential(nn.ReLU(), nn.ReLU()), ["ReLU"], None, CPU) == (1, 0)


def test_without_a_no_split_class_each_leaf_is_a_block():
    """Then "h.blocks.1" is a unit of its direct buffer only (320 -> 512 bytes), with its leaves "h.blocks.1.proj"
    (1024 bytes, the largest) and "h.blocks.1.shared" (64 -> 256, 12 -> 256) units inside it: 4 deep."""
    assert pool_shape(Net(), [], None, GPU) == (4, 1024)


def _prefetcher(model, store, device=CPU, depth=1, copy=None):
    units = find_units(model, {name: name for name in store}, ["Block"], "block")
    return Prefetcher(units, store, device, depth, TransferStats(), copy=copy)


def test_unit_bytes_lays_each_tensor_out_at_the_next_aligned_offset():
    """A dict store (not a Store: no reference offsets): tensors in the unit's order, each at the next multiple of
    ALIGN after the previous one ends."""
    net = Net()
    store = {name: t.detach().clone() for name, t in net.state_dict(keep_vars=True).items()}
    prefetcher = _prefetcher(net, store)
    sizes = {u.name: prefetcher.unit_bytes(u) for u in prefetcher.units}
    # "h.blocks.1": steps [0, 320) -> proj at 512, [512, 1536) -> shared.w at 1536, [1536, 1600) -> shared.b at 1792,
    # [1792, 1804) -> 2048 in all; "h.blocks.0": steps [0, 320), proj [512, 768), w [768, 832), b [1024, 1036) -> 1280
    assert sizes == {"": 256, "h": 256, "h.blocks.0": 1280, "h.blocks.1": 2048}
    blocks = prefetcher.blocks
    assert (blocks.count, blocks.capacity) == (1 + 3, 2048)  # depth 1 + three units nested at most


def test_a_loaded_unit_runs_on_views_at_those_offsets():
    net = Net()
    store = {name: torch.arange(t.numel()).to(t.dtype).view(t.shape) for name, t in net.state_dict().items()}
    prefetcher = _prefetcher(net, store, depth=0)
    index = [u.name for u in prefetcher.units].index("h.blocks.1")
    with torch.inference_mode(False):
        prefetcher.load(index)
    try:
        block = net.h.blocks[1]
        buffer = prefetcher.block_pool.buffers[prefetcher.held[index].buffers[0]]
        at = {
            name: t.data_ptr() - buffer.data_ptr()
            for name, t in [
                ("steps", block.steps),
                ("proj", block.proj.weight),
                ("w", block.shared.w),
                ("b", block.shared.b),
            ]
        }
        assert at == {"steps": 0, "proj": 512, "w": 1536, "b": 1792}
        assert torch.equal(block.proj.weight, store["h.blocks.1.proj.weight"])
        assert torch.equal(block.steps, store["h.blocks.1.steps"]) and block.steps.dtype == torch.int64
        assert prefetcher.misses == 1 and prefetcher.stats.bytes == 320 + 1024 + 64 + 12
    finally:
        prefetcher.close()


class _OffsetStore(Store):
    """A store whose tensors the in-memory model would place at these reference offsets (modulo ALIGN)."""

    def __init__(self, tensors, offsets):
        self.tensors, self.offsets = tensors, offsets

    def __getitem__(self, key):
        return self.tensors[key]

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)

    def offset(self, name):
        return self.offsets[name]


def test_on_a_cpu_each_tensor_starts_at_its_reference_offset_past_the_aligned_end():
    """steps at 0 + 16 = 16, ends 336; proj at 512 + 8 = 520, ends 1544; shared.w at 1792 + 100 = 1892, ends 1956;
    shared.b at 2048 + 4 = 2052, ends 2064: 2304 in all (2048 without the offsets)."""
    net = Net()
    tensors = {name: torch.arange(t.numel()).to(t.dtype).view(t.shape) for name, t in net.state_dict().items()}
    offsets = dict.fromkeys(tensors, 0)
    offsets.update({"h.blocks.1.steps": 16, "h.blocks.1.proj.weight": 8, "h.blocks.1.shared.w": 100})
    offsets["h.blocks.1.shared.b"] = 4
    prefetcher = _prefetcher(net, _OffsetStore(tensors, offsets), depth=0, copy=True)  # into the pool, not mapped
    index = [u.name for u in prefetcher.units].index("h.blocks.1")
    assert prefetcher.unit_bytes(prefetcher.units[index]) == 2304
    with torch.inference_mode(False):
        prefetcher.load(index)
    try:
        block = net.h.blocks[1]
        buffer = prefetcher.block_pool.buffers[prefetcher.held[index].buffers[0]]
        starts = [t.data_ptr() - buffer.data_ptr() for t in (block.steps, block.proj.weight, block.shared.w)]
        assert starts + [block.shared.b.data_ptr() - buffer.data_ptr()] == [16, 520, 1892, 2052]
        assert torch.equal(block.shared.w, tensors["h.blocks.1.shared.w"])
    finally:
        prefetcher.close()
