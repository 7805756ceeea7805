"""Prefetch's reservation and its pool agree: the placement holds back what the prefetcher's block pool takes
(depth + the deepest nesting of units, each as padded), not fewer blocks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_core import dispatch_model
from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig
from offload_core.planning.reservation import InFlight
from offload_core.planning import largest_block_size


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 48), nn.Linear(48, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Scaled(nn.Module):
    """A container with a weight of its own above its blocks: its unit stays loaded while each block runs."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.blocks = nn.Sequential(Block(), Block(), Block())

    def forward(self, x):
        return self.blocks(x * self.scale)


@pytest.mark.parametrize("depth", [1, 2])
def test_the_reservation_holds_the_pool_the_prefetcher_makes(depth, tmp_path):
    torch.manual_seed(0)
    reference = Scaled().eval()
    x = torch.randn(2, 16)
    with torch.no_grad():
        expected = reference(x)
    model = Scaled().eval()
    model.load_state_dict(reference.state_dict())
    policy = Prefetch(PrefetchConfig(depth=depth, pool=True))
    block = largest_block_size(model, ["Block"])
    reserve = policy.reserve(
        InFlight(torch.device("cpu"), block, block, model=model, no_split_module_classes=("Block",))
    )
    dispatch_model(
        model,
        {"": "disk"},
        storage="memmap",
        policy=policy,
        offload_folder=tmp_path / "off",
        no_split_module_classes=["Block"],
        execution_device="cpu",
    )
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    pool = model.offload_state.handle.prefetcher.block_pool
    model.offload_state.remove()
    assert pool.count == depth + 2  # the container's unit and a block are loaded at once
    assert pool.allocated_bytes <= reserve["cpu"] < pool.allocated_bytes + pool.count * 4096


@pytest.mark.fake_gpu
def test_a_gpu_run_reserves_the_pool_on_its_gpu(fake_gpu):
    model = Scaled()
    block = largest_block_size(model, ["Block"])
    policy = Prefetch(PrefetchConfig(depth=2))
    gpu = fake_gpu(count=2).device(1)
    need = InFlight(gpu, block, block, store_pinned=True, model=model, no_split_module_classes=("Block",))
    reserve = policy.reserve(need)
    assert reserve["cpu"] == 0 and reserve[1] >= 4 * block  # depth 2 + the container and a block
