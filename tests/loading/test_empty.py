"""Empty init: parameters (and buffers if asked) land on the meta device; nothing of nn.Module is patched, nothing
outlives the block."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_core.loading.empty import init_empty_weights, init_on_device

ORIGINAL_REGISTER_PARAMETER = nn.Module.register_parameter
ORIGINAL_REGISTER_BUFFER = nn.Module.register_buffer


def test_parameters_go_to_meta_buffers_stay():
    with init_empty_weights():
        model = nn.Sequential(nn.Linear(10_000, 10_000), nn.BatchNorm1d(10_000))
    assert model[0].weight.device.type == "meta"
    assert model[0].weight.shape == (10_000, 10_000)
    assert isinstance(model[0].weight, nn.Parameter) and model[0].weight.requires_grad
    assert model[1].running_mean.device.type == "cpu"
    assert model[1].running_mean.shape == (10_000,)


def test_include_buffers_moves_buffers_too():
    with init_empty_weights(include_buffers=True):
        norm = nn.BatchNorm1d(8)
    assert {t.device.type for t in (*norm.parameters(), *norm.buffers())} == {"meta"}
    assert "running_mean" in norm.state_dict()


def test_non_persistent_buffers_keep_their_flag():
    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("freq", torch.ones(4), persistent=False)

    with init_empty_weights(include_buffers=True):
        module = WithBuffer()
    assert module.freq.device.type == "meta"
    assert "freq" not in module.state_dict()


def test_requires_grad_is_kept():
    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.zeros(3), requires_grad=False)

    with init_empty_weights():
        module = Frozen()
    assert module.table.device.type == "meta" and not module.table.requires_grad


def test_init_on_device_cpu_and_restores_module_methods():
    with init_on_device("cpu"):
        layer = nn.Linear(2, 2)
    assert layer.weight.device.type == "cpu"
    assert nn.Module.register_parameter is ORIGINAL_REGISTER_PARAMETER
    assert nn.Module.register_buffer is ORIGINAL_REGISTER_BUFFER


@pytest.mark.parametrize("include_buffers", [False, True])
def test_nothing_is_patched_and_nothing_outlives_a_block_that_raises(include_buffers):
    with pytest.raises(RuntimeError, match="boom"):
        with init_empty_weights(include_buffers=include_buffers):
            assert nn.Module.register_parameter is ORIGINAL_REGISTER_PARAMETER
            assert nn.Module.register_buffer is ORIGINAL_REGISTER_BUFFER
            assert nn.Linear(2, 2).weight.device.type == "meta"
            raise RuntimeError("boom")
    assert nn.Module.register_parameter is ORIGINAL_REGISTER_PARAMETER
    assert nn.Module.register_buffer is ORIGINAL_REGISTER_BUFFER
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_nested_contexts_unwind_in_order():
    with init_empty_weights():
        with init_on_device("cpu"):
            inner = nn.Linear(2, 2)
        outer = nn.Linear(2, 2)
    assert inner.weight.device.type == "cpu"
    assert outer.weight.device.type == "meta"
    assert nn.Module.register_parameter is ORIGINAL_REGISTER_PARAMETER


def test_parameter_subclass_keeps_its_class():
    class Tagged(nn.Parameter):
        pass

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = Tagged(torch.zeros(2))

    with init_empty_weights():
        holder = Holder()
    assert type(holder.w) is Tagged and holder.w.device.type == "meta"


def test_another_thread_is_not_affected():
    import threading

    made = []
    with init_empty_weights():
        worker = threading.Thread(target=lambda: made.append(nn.Linear(2, 2)))
        worker.start()
        worker.join()
    assert made[0].weight.device.type == "cpu"
