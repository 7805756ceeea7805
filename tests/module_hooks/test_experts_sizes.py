"""What the experts loader recognises as a fused experts module and the sizes it reports, worked by hand on small
modules of our own (float32 unless said)."""

from __future__ import annotations

import torch
from torch import nn

from offload_core.module_hooks.experts import is_fused_experts
from offload_core.module_hooks.experts.loader import expert_sizes, expert_slots, most_experts, routing_argument


class Fused(nn.Module):
    """``experts`` experts: gate_up [E, 8, width] and down [E, 3, 4] indexed by expert, an int8 [E, 5, 1] table, and a
    bias and a [3, 2, 2] mix that are not indexed by expert. One expert's rows: 8 x width + 12 floats and 5 bytes."""

    def __init__(self, experts: int = 4, width: int = 6) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, 8, width))
        self.down_proj = nn.Parameter(torch.zeros(experts, 3, 4))
        self.table = nn.Parameter(torch.zeros(experts, 5, 1, dtype=torch.int8), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(8))
        self.mix = nn.Parameter(torch.zeros(3, 2, 2))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


class Unrouted(Fused):
    def forward(self, hidden_states):
        return hidden_states


def test_a_fused_experts_module_is_called_with_the_routing_and_indexed_by_expert():
    fused = Fused()
    assert routing_argument(fused) == 1 and routing_argument(Unrouted()) is None
    assert routing_argument(nn.Linear(2, 2)) is None
    assert is_fused_experts(fused) and not is_fused_experts(Unrouted())
    odd = Fused()
    odd.num_experts = 5  # no parameter has 5 rows
    assert not is_fused_experts(odd)
    odd.num_experts = 4.0  # not an int
    assert not is_fused_experts(odd)
    assert not is_fused_experts(nn.Linear(4, 4))


def test_expert_sizes_are_one_experts_rows_in_the_largest_module_and_the_count_of_modules():
    model = nn.Sequential(Fused(8, 10), nn.Linear(4, 4), Fused(4, 6), Unrouted())
    # Fused(8, 10): 8 x 10 + 12 = 92 floats (368 bytes) and 5 int8 bytes; Fused(4, 6): 60 floats
    assert expert_sizes(model) == (368 + 5, 2)
    assert expert_sizes(model, torch.float16) == (184 + 5, 2)  # the int8 table keeps its size
    assert most_experts(model) == 8
    assert expert_sizes(nn.Linear(4, 4)) == (0, 0) and most_experts(nn.Linear(4, 4)) == 0


def test_expert_slots_are_the_offloaded_tensors_indexed_by_expert():
    fused = Fused()
    offloaded = {"moe.gate_up_proj": "k1", "moe.table": "k3", "moe.bias": "k4", "moe.mix": "k5"}
    slots = expert_slots("moe", fused, offloaded)
    assert [(s.local, s.full, s.key, s.is_param, s.owner is fused) for s in slots] == [
        ("gate_up_proj", "moe.gate_up_proj", "k1", True, True),
        ("table", "moe.table", "k3", True, True),
    ]
    assert slots[0].original is fused.gate_up_proj
    assert [s.full for s in expert_slots("", fused, {"down_proj": "k2"})] == ["down_proj"]


class Block(nn.Module):
    """A MoE block called with the routing whose experts are a child: not itself a fused experts module."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 4
        self.experts = Fused(4, 6)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.experts(hidden_states, top_k_index, top_k_weights)


def test_only_a_modules_own_parameters_make_it_fused_and_count_in_its_rows():
    block = Block()
    assert not is_fused_experts(block) and is_fused_experts(block.experts)
    assert expert_sizes(block) == (240 + 5, 1)  # 8 x 6 + 12 = 60 floats and the int8 table, in one module
    outer = Fused(4, 6)
    outer.inner = Fused(4, 10)  # each its own layer: 60 and 92 floats an expert, never added together
    assert expert_sizes(outer) == (368 + 5, 2)


def test_a_module_of_one_expert_has_one_row():
    assert expert_sizes(Fused(1, 6)) == (240 + 5, 1) and most_experts(Fused(1, 6)) == 1
