"""The three built-in placements on a tiny Llama built on meta: GPU budgets planned on CPU, ties, balance and
budgets."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from offload_core.loading.empty import init_empty_weights
from offload_core.errors import PluginError
from offload_core.registry.manager import build_registry, get_registry
from offload_core.planning import (
    PlacementRequest,
    check_device_map,
    compute_module_sizes,
    device_of,
    get_balanced_memory,
    infer_auto_device_map,
    largest_block_size,
    summarize_device_map,
)

NO_SPLIT = ["LlamaDecoderLayer"]
STRATEGIES = ["sequential", "balanced", "balanced_low_0"]


@pytest.fixture(scope="module")
def llama():
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        tie_word_embeddings=True,
    )
    with init_empty_weights():
        model = LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].mlp.up_proj.weight.device.type == "meta"
    return model


@pytest.fixture(scope="module")
def sizes(llama):
    return compute_module_sizes(llama)


def place(model, max_memory, no_split, strategy):
    """The device map the placement ``strategy`` makes (as dispatching by name does)."""
    request = PlacementRequest(model, max_memory, list(no_split))
    return get_registry().create("placement", strategy).make_device_map(request)


def layers_on(device_map, device, n=4):
    return [i for i in range(n) if device_of(device_map, f"model.layers.{i}.mlp.up_proj.weight") == device]


def test_builtin_placements_are_registered_with_their_configs():
    registry = build_registry(
        builtins=[f"offload_core_plugins.placement_{s}" for s in STRATEGIES], load_entry_points=False
    )
    assert registry.names("placement") == sorted(STRATEGIES)
    for name in STRATEGIES:
        strategy = registry.get("placement", name)
        assert strategy.config().name == name
        assert callable(registry.create("placement", name).make_device_map)


def test_unknown_strategy_names_the_available_ones(llama):
    with pytest.raises(PluginError, match="balanced_low_0"):
        place(llama, {"cpu": "1GB"}, NO_SPLIT, "roundrobin")


BUDGETS = [
    {0: 700_000, 1: 700_000, "cpu": 400_000},
    {0: 500_000, 2: 600_000, "cpu": "300KB"},
    {0: 2_000_000, 2: 2_000_000},
    {1: 400_000, 3: 400_000, 5: 400_000, "cpu": 500_000},
    {"cpu": 600_000},
    {0: 10_000_000},
    {0: 300_000, 1: 300_000, "cpu": 350_000},
]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("max_memory", BUDGETS, ids=[str(i) for i in range(len(BUDGETS))])
def test_maps_are_valid_tied_and_within_budget(llama, sizes, strategy, max_memory):
    device_map = place(llama, max_memory, NO_SPLIT, strategy)
    check_device_map(llama, device_map)
    assert device_of(device_map, "lm_head.weight") == device_of(device_map, "model.embed_tokens.weight")
    summary = summarize_device_map(llama, device_map, max_memory)
    devices = summary["devices"]
    assert sum(info["bytes"] for info in devices.values()) == sizes[""]
    for device, info in devices.items():
        assert device in {*max_memory, "disk"}
        if info["budget"] is not None:
            assert info["bytes"] <= info["budget"], (device, info)
    # layers are never split: each decoder layer sits on one device
    for i in range(4):
        assert len({device_of(device_map, n) for n in sizes if n.startswith(f"model.layers.{i}.")}) == 1
    # while something is on disk, the cpu keeps room for the largest offloaded unit to be brought in
    if "disk" in devices and "cpu" in devices:
        on_disk = [sizes[f"model.layers.{i}"] for i in layers_on(device_map, "disk")]
        if device_of(device_map, "model.embed_tokens.weight") == "disk":
            on_disk.append(sizes["model.embed_tokens"])
        assert devices["cpu"]["bytes"] + max(on_disk) <= devices["cpu"]["budget"]


def test_sequential_fills_in_order_and_balanced_spreads(llama, sizes):
    roomy = {0: 2_000_000, 1: 2_000_000}
    assert infer_auto_device_map(llama, roomy, NO_SPLIT) == {"": 0}
    balanced = place(llama, roomy, NO_SPLIT, "balanced")
    assert layers_on(balanced, 0) and layers_on(balanced, 1)
    bytes_per = {d: i["bytes"] for d, i in summarize_device_map(llama, balanced)["devices"].items()}
    assert set(bytes_per) == {0, 1}
    assert abs(bytes_per[0] - bytes_per[1]) <= largest_block_size(llama, NO_SPLIT) + sizes["model.embed_tokens"]


def test_balanced_uses_the_actual_ids_when_they_are_not_contiguous(llama):
    max_memory = {0: 2_000_000, 2: 2_000_000, 7: 2_000_000}
    device_map = place(llama, max_memory, NO_SPLIT, "balanced")
    used = set(device_map.values())
    assert used == {0, 2, 7}
    low = place(llama, max_memory, NO_SPLIT, "balanced_low_0")
    assert layers_on(low, 2) and layers_on(low, 7) and not layers_on(low, 0)
    assert 1 not in set(low.values())


def test_balanced_low_0_leaves_gpu_0_lighter(llama):
    max_memory = {0: 1_000_000, 1: 1_000_000, 2: 1_000_000}
    device_map = place(llama, max_memory, NO_SPLIT, "balanced_low_0")
    per = {d: i["bytes"] for d, i in summarize_device_map(llama, device_map)["devices"].items()}
    assert per.get(0, 0) < min(per[1], per[2])
    balanced = place(llama, max_memory, NO_SPLIT, "balanced")
    assert layers_on(balanced, 0) or device_of(balanced, "model.embed_tokens.weight") == 0


def test_balanced_caps(llama, sizes):
    request = PlacementRequest(llama, {0: 10**9, 3: 10**9, 5: 10**9, "cpu": 10**9}, NO_SPLIT)
    total, block = sizes[""], sizes["model.layers.0"]
    caps = get_balanced_memory(request)
    per_gpu = total // 3 + int(1.25 * block)
    assert caps == {0: per_gpu, 3: per_gpu, 5: 10**9, "cpu": 10**9}
    low = get_balanced_memory(request, low_zero=True)
    assert low[3] == total // 2 + int(1.25 * block) and low[5] == 10**9
    assert low[0] == 0  # GPUs 3 and 5 take the whole model
    tight = get_balanced_memory(PlacementRequest(llama, {0: 10**9, 1: 300_000, 2: 300_000}, NO_SPLIT), low_zero=True)
    assert tight[0] == total - 600_000
    assert get_balanced_memory(PlacementRequest(llama, {0: 777, "cpu": 10**9}, NO_SPLIT)) == {0: 777, "cpu": 10**9}


@pytest.mark.parametrize("max_memory", [{0: 500_000, "cpu": 600_000}, {"cpu": 500_000}, {3: 10**7}])
def test_one_gpu_or_none_balanced_is_sequential(llama, max_memory):
    maps = [place(llama, max_memory, NO_SPLIT, s) for s in STRATEGIES]
    assert maps[0] == maps[1] == maps[2]


def test_gpu_map_planned_on_cpu_with_strings_and_cuda_names(llama):
    device_map = infer_auto_device_map(
        llama, {"cuda:0": "400KB", "1": "1MB", "cpu": "1GB"}, NO_SPLIT, dtype=torch.float16
    )
    check_device_map(llama, device_map)
    assert set(device_map.values()) <= {0, 1, "cpu"}
    assert layers_on(device_map, 1)


def test_registry_builds_placements_from_config_mappings(llama):
    request = PlacementRequest(llama, {0: 2_000_000, 1: 2_000_000}, NO_SPLIT)
    balanced = get_registry().create("placement", "balanced", {"name": "balanced"}).make_device_map(request)
    sequential = get_registry().create("placement", "sequential", {"name": "sequential"}).make_device_map(request)
    check_device_map(llama, balanced)
    assert layers_on(balanced, 0) and layers_on(balanced, 1)  # spread over both devices
    assert not layers_on(sequential, 1)  # the first device holds it all: the two names are two strategies


class Block(nn.Sequential):
    """A no-split block of two 16 x 16 linears (2 x 272 floats: 2,176 bytes)."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(16, 16), nn.Linear(16, 16))


def test_balanced_caps_worked_by_hand():
    """Four 16 x 16 linears (1,088 bytes each, 4,352 in all); each cap is total / GPUs + 1.25 x the larger of the
    largest no-split block and the mean leaf module; the last GPU keeps its budget."""
    model = nn.Sequential(Block(), nn.Linear(16, 16), nn.Linear(16, 16))
    big = 10**6
    assert get_balanced_memory(model, {0: big, 1: big}) == {0: 2176 + 1360, 1: big}
    assert get_balanced_memory(model, {0: big, 1: big}, ["Block"]) == {0: 2176 + 2720, 1: big}
    assert get_balanced_memory(model, {0: big, 1: big, 2: big}) == {0: 1450 + 1360, 1: 1450 + 1360, 2: big}
    assert get_balanced_memory(model, {0: big, 1: big, 2: big}, low_zero=True) == {0: 0, 1: 3536, 2: big}
    assert get_balanced_memory(model, {0: 1000, 1: big, "cpu": 5}) == {0: 1000, 1: big, "cpu": 5}  # never raised
    assert get_balanced_memory(model, {0: 0, 1: big, 2: big}) == {0: 0, 1: 3536, 2: big}  # a GPU given 0 is skipped
    assert get_balanced_memory(model, {0: big, 1: big}, dtype=torch.float16) == {0: 1088 + 680, 1: big}
    # a no-split class the model lacks, or one without weights (not in the sizes), changes nothing
    assert get_balanced_memory(model, {0: big, 1: big}, ["Nope"]) == {0: 2176 + 1360, 1: big}
    relu = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))  # 2,176 bytes, leaves of 1,088
    assert get_balanced_memory(relu, {0: big, 1: big}, ["ReLU"]) == {0: 1088 + 1360, 1: big}
    weightless = nn.Sequential(nn.ReLU(), nn.ReLU())  # nothing to spread, no block, no leaf with bytes: caps of 0
    assert get_balanced_memory(weightless, {0: big, 1: big}) == {0: 0, 1: big}
    assert get_balanced_memory(weightless, {0: big, 1: big}, ["ReLU"]) == {0: 0, 1: big}
    assert get_balanced_memory(weightless, {0: big, 1: big}, ["Nope"]) == {0: 0, 1: big}


def test_fallback_allocation_puts_the_first_unit_that_fits_on_an_otherwise_empty_gpu():
    """The block (2,176 bytes) cannot go on GPU 0 beside the 2,176 bytes held back for streaming the largest
    layer; the small linear (80 bytes) can, once fallback_allocation looks past the block (breadth first)."""
    model = nn.Sequential(Block(), nn.Linear(4, 4), nn.Linear(16, 16))
    assert infer_auto_device_map(model, {0: 3000, "cpu": 10**6}, ["Block"]) == {"": "cpu"}
    assert infer_auto_device_map(model, {0: 3000, "cpu": 10**6}, ["Block"], fallback_allocation=True) == {
        "0": "cpu",
        "1": 0,
        "2": "cpu",
    }
    assert infer_auto_device_map(model, {0: 2000, "cpu": 10**6}, ["Block"], fallback_allocation=True) == {"": "cpu"}
