"""The prefetch hook moves a call's inputs, positional and keyword, to the execution device (the fake GPU here):
an offloaded block called with host tensors computes on the device, on its store's weights."""

from __future__ import annotations

import torch
from torch import nn

from offload_core import dispatch_model
from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig


def _stack():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def test_host_inputs_of_an_offloaded_block_are_moved_to_the_execution_device(fake_gpu):
    fake = fake_gpu(count=1, memory="64MiB")
    device = fake.device(0)
    reference = _stack()
    model = _stack()
    dispatch_model(model, {"0": "cpu", "1": 0}, storage="pinned_cpu", policy=Prefetch(PrefetchConfig(depth=1)))
    assert model.offload_state.execution_device == device
    x = torch.arange(8, dtype=torch.float32).view(2, 4)  # on the host
    try:
        with torch.no_grad():
            expected = reference[0](x)
            for got in (model[0](x), model[0](input=x)):
                assert got.device == device and torch.equal(got.cpu(), expected)
            assert torch.equal(model(x).cpu(), reference(x))
    finally:
        model.offload_state.remove()
