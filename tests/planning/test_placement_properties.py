"""Property test of the fill: random small models with ties, shared modules, no-split blocks and buffers, random
budgets."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_core.loading.empty import init_empty_weights
from offload_core.planning import (
    check_device_map,
    compute_module_sizes,
    device_of,
    infer_auto_device_map,
    tensor_aliases,
)

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


class Block(nn.Module):
    """A no-split block: two linears, and a buffer."""

    def __init__(self, width: int, buffer: bool) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width, bias=False)
        if buffer:
            self.register_buffer("scale", torch.ones(width))


def build(spec: list[tuple[str, int, bool]], width: int) -> nn.Module:
    with init_empty_weights(include_buffers=True):  # on meta from the start: moving a model there unties its tensors
        return _build(spec, width)


def _build(spec: list[tuple[str, int, bool]], width: int) -> nn.Module:
    """A model from ``spec``: (kind, tie_to, buffer) per child; kinds linear, block, shared, head."""
    model = nn.Module()
    model.embed = nn.Embedding(8, width)
    linears: list[nn.Linear] = []
    for index, (kind, tie_to, buffer) in enumerate(spec):
        if kind == "block":
            child = Block(width, buffer)
            linears.append(child.b)
        elif kind == "shared":
            layer = nn.Linear(width, width)
            child = nn.Sequential(layer, nn.ReLU(), layer)
        elif kind == "head":  # a no-split block whose decoder is tied to the embedding (RoBERTa-style)
            child = Block(width, buffer)
            child.b.weight = model.embed.weight
        else:
            child = nn.Linear(width, width)
            if tie_to and linears:
                child.weight = linears[tie_to % len(linears)].weight
            linears.append(child)
            if buffer:
                child.register_buffer("running", torch.zeros(width))
        setattr(model, f"m{index}", child)
    return model


SPEC = st.lists(
    st.tuples(st.sampled_from(["linear", "block", "shared", "head"]), st.integers(0, 3), st.booleans()),
    min_size=1,
    max_size=6,
)
BUDGET = st.integers(0, 3000)


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(
    spec=SPEC, gpus=st.lists(BUDGET, min_size=0, max_size=3), cpu=st.one_of(st.none(), BUDGET), reserve=st.booleans()
)
def test_every_map_is_valid_keeps_ties_together_and_stays_within_budget(spec, gpus, cpu, reserve):
    model = build(spec, 8)
    assert spec[-1][0] != "head" or model.get_submodule(f"m{len(spec) - 1}").b.weight is model.embed.weight
    budgets: dict = dict(enumerate(gpus))
    if cpu is not None:
        budgets["cpu"] = cpu
    budgets["disk"] = 10**9
    device_map = infer_auto_device_map(model, budgets, ["Block"], offload_buffers=True, reserve={} if reserve else None)
    check_device_map(model, device_map)
    aliases = tensor_aliases(model)
    for name, first in aliases.items():
        assert device_of(device_map, name) == device_of(device_map, first), f"{name} apart from {first}"
    sizes = compute_module_sizes(model)
    used: dict = {}
    for name, first in aliases.items():
        if name == first:
            device = device_of(device_map, name)
            used[device] = used.get(device, 0) + sizes[name]
    for device, nbytes in used.items():
        if device != "disk":
            assert nbytes <= budgets[device], f"{device}: {nbytes} bytes against a budget of {budgets[device]}"
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Linear):  # a module's direct tensors never split across devices
            assert len({device_of(device_map, f"{module_name}.{n}") for n, _ in module.named_parameters()}) == 1
