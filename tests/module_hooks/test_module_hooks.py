"""Module-hook lifecycle: order of calls, symmetric add/remove, and the chained policy's transfer counts (seed 000)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from offload_core.module_hooks.base import ModuleHook, add_hook_to_module, module_hooks, remove_hook_from_module
from offload_core.loading.cpu_offload import cpu_offload_with_hook


class Recorder(ModuleHook):
    def __init__(self, name, log):
        self.name = name
        self.log = log

    def init_hook(self, module):
        self.log.append(f"{self.name}.attach")

    def pre_forward(self, module, args, kwargs):
        self.log.append(f"{self.name}.pre")
        return (args[0] + 1,), kwargs

    def call_forward(self, module, forward, args, kwargs):
        self.log.append(f"{self.name}.call")
        return forward(*args, **kwargs)

    def post_forward(self, module, output):
        self.log.append(f"{self.name}.post")
        return output * 2

    def on_error(self, module):
        self.log.append(f"{self.name}.error")

    def detach_hook(self, module):
        self.log.append(f"{self.name}.detach")


class Affine(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, scale: float = 1.0):
        """Doc kept."""
        return self.lin(x) * scale


def test_hooks_run_in_order_and_chain():
    log = []
    m = Affine()
    x = torch.randn(2, 3)
    expected = m(x + 2) * 4
    add_hook_to_module(m, Recorder("a", log))
    add_hook_to_module(m, Recorder("b", log))
    out = m(x)
    assert log == ["a.attach", "b.attach", "a.pre", "b.pre", "a.call", "b.call", "b.post", "a.post"]
    assert torch.allclose(out, expected)


def test_wrapped_forward_keeps_name_and_signature_and_remove_restores():
    m = Affine()
    before = inspect.signature(m.forward)
    handle = add_hook_to_module(m, Recorder("a", []))
    assert m.forward.__name__ == "forward"
    assert m.forward.__doc__ == "Doc kept."
    assert inspect.signature(m.forward) == before
    handle.remove()
    assert "forward" not in m.__dict__
    assert module_hooks(m) == []


def test_duplicate_name_is_an_error():
    m = Affine()
    add_hook_to_module(m, Recorder("a", []))
    with pytest.raises(ValueError, match="already has a module hook named 'a'"):
        add_hook_to_module(m, Recorder("a", []))


def test_remove_one_of_two_keeps_the_other():
    log = []
    m = Affine()
    add_hook_to_module(m, Recorder("a", log))
    add_hook_to_module(m, Recorder("b", log))
    remove_hook_from_module(m, name="a")
    log.clear()
    m(torch.randn(1, 3))
    assert log == ["b.pre", "b.call", "b.post"]
    remove_hook_from_module(m)
    assert "forward" not in m.__dict__


def test_error_in_forward_calls_on_error():
    log = []
    m = Affine()
    add_hook_to_module(m, Recorder("a", log))
    with pytest.raises(RuntimeError):
        m(torch.randn(2, 5))
    assert log[-1] == "a.error"


def test_instance_forward_is_restored():
    m = Affine()
    custom = lambda x: x  # noqa: E731
    m.forward = custom
    add_hook_to_module(m, Recorder("a", [])).remove()
    assert m.forward is custom


def test_chained_seed_example_moves_module_a_once():
    """Seed 000: module_a called 3 times then module_b 4 times moves module_a in once and out once."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    ref_a, ref_b = nn.Linear(4, 4), nn.Linear(4, 4)
    ref_a.load_state_dict(a.state_dict())
    ref_b.load_state_dict(b.state_dict())
    a, hook_a = cpu_offload_with_hook(a, "cpu")
    b, hook_b = cpu_offload_with_hook(b, "cpu", prev_module_hook=hook_a)
    assert a.weight.device.type == "cpu"  # resting on the cpu until called, as accelerate leaves it
    x = torch.randn(2, 4)
    for _ in range(3):
        y = a(x)
        assert torch.equal(y, ref_a(x))
    assert hook_a.stats.loads == 2 and hook_a.hook.offloads == 0  # weight + bias, brought in once
    for _ in range(4):
        z = b(y)
        assert torch.equal(z, ref_b(y))
    assert hook_a.stats.loads == 2 and hook_a.hook.offloads == 1
    assert hook_b.stats.loads == 2 and hook_b.hook.offloads == 0
    hook_b.offload()
    assert b.weight.device.type == "cpu" and hook_b.hook.offloads == 1
    hook_a.remove()
    hook_b.remove()
    assert torch.equal(a.weight, ref_a.weight) and torch.equal(b(x), ref_b(x))
    assert "forward" not in a.__dict__


def test_chained_hooks_move_weights_to_the_execution_device_and_back():
    """The meta device stands in for an accelerator: calling b moves a out (to the cpu) and b in; b stays on
    the execution device until offloaded explicitly."""
    a, hook_a = cpu_offload_with_hook(nn.Linear(4, 4), "meta")
    b, hook_b = cpu_offload_with_hook(nn.Linear(4, 4), "meta", prev_module_hook=hook_a)
    assert a.weight.device.type == "cpu" and b.weight.device.type == "cpu"  # resting until called
    y = a(torch.randn(2, 4))
    assert a.weight.device.type == "meta" and b.weight.device.type == "cpu"
    b(y)
    assert a.weight.device.type == "cpu" and b.weight.device.type == "meta"  # a moved out as b came in
    hook_b.offload()
    assert b.weight.device.type == "cpu"
    hook_a.remove()
    hook_b.remove()
