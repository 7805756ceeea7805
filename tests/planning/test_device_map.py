"""The fill algorithm (seed 000's ModelA table, using the budget, ties, reservations) and checking device maps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_core.loading.empty import init_empty_weights
from offload_core.errors import DeviceMapError
from offload_core.planning import (
    PlacementRequest,
    check_device_map,
    compress_device_map,
    compute_module_sizes,
    device_of,
    infer_auto_device_map,
    normalize_device_map,
    plan_device_map,
    summarize_device_map,
)


class ModelA(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.rand(1000, 1000))
        self.b = nn.Parameter(torch.rand(1000, 1000))
        self.layer = nn.Linear(1000, 1000)


@pytest.fixture(scope="module")
def model_a():
    with init_empty_weights():
        return ModelA()


@pytest.mark.parametrize(
    "cpu, expected",
    [
        (1000 * 1000 * 6, {"": "disk"}),
        (1000 * 1000 * 8 + 3999, {"": "disk"}),
        (1000 * 1000 * 8 + 4000, {"a": "cpu", "b": "disk", "layer": "disk"}),
        (1000 * 1000 * 10, {"a": "cpu", "b": "disk", "layer": "disk"}),
    ],
)
def test_seed_model_a_table(model_a, cpu, expected):
    assert infer_auto_device_map(model_a, max_memory={"cpu": cpu}) == expected
    assert plan_device_map(PlacementRequest(model_a, {"cpu": cpu})) == expected


def test_explicit_reserve_replaces_the_seed_rule(model_a):
    request = PlacementRequest(model_a, {"cpu": 1000 * 1000 * 8 + 3999}, reserve={"cpu": 0})
    assert plan_device_map(request) == {"a": "cpu", "b": "cpu", "layer": "disk"}
    # a fixed 4.004 MB held back leaves room for nothing
    request = PlacementRequest(model_a, {"cpu": 1000 * 1000 * 8 + 3999}, reserve={"cpu": 4_004_000})
    assert plan_device_map(request) == {"": "disk"}
    assert plan_device_map(PlacementRequest(model_a, {"cpu": "13MB"}, reserve={"cpu": 0})) == {"": "cpu"}


class BigThenSmall(nn.Module):
    """Two 4.004 MB layers, then two small ones: the first cannot stay on a 4.1 MB cpu."""

    def __init__(self):
        super().__init__()
        self.big1 = nn.Linear(1000, 1000)
        self.big2 = nn.Linear(1000, 1000)
        self.small1 = nn.Linear(10, 10)
        self.small2 = nn.Linear(10, 10)


def test_later_units_still_use_the_cpu_budget():
    with init_empty_weights():
        model = BigThenSmall()
    budget = 4_100_000
    device_map = plan_device_map(PlacementRequest(model, {"cpu": budget}))
    # strict sequential order (accelerate) sends big1 to disk and everything after it too: 0 bytes on cpu
    assert device_map == {"big1": "disk", "big2": "disk", "small1": "cpu", "small2": "cpu"}
    summary = summarize_device_map(model, device_map, {"cpu": budget})
    sizes = compute_module_sizes(model)
    assert summary["devices"]["cpu"]["bytes"] == sizes["small1"] + sizes["small2"] > 0
    # the cpu still holds room for the largest offloaded layer
    assert summary["devices"]["cpu"]["bytes"] + sizes["big1"] <= budget


def test_gpus_stay_in_strict_order():
    with init_empty_weights():
        model = BigThenSmall()
    # GPU 0 (main device) reserves the largest remaining unit: big1 does not fit with it, goes to GPU 1;
    # the small layers must not go back to GPU 0.
    device_map = plan_device_map(PlacementRequest(model, {0: 5_000_000, 1: 9_000_000, "cpu": 0}))
    assert device_map == {"": 1}


def test_tied_leaf_follows_its_first_occurrence():
    with init_empty_weights():
        model = nn.ModuleDict(
            {"embed": nn.Embedding(1000, 100), "body": nn.Linear(100, 100), "head": nn.Linear(100, 1000, bias=False)}
        )
    model["head"].weight = model["embed"].weight
    sizes = compute_module_sizes(model)
    assert sizes["head"] == 0
    budget = sizes["embed"] + sizes["body"] - 1  # embed fits on GPU 0, body does not fit after it
    device_map = plan_device_map(PlacementRequest(model, {0: budget, 1: 10**9}, reserve={}))
    assert device_map == {"embed": 0, "body": 1, "head": 0}
    check_device_map(model, device_map)


def test_a_tied_leaf_goes_with_its_partner_and_keeps_its_bias():
    with init_empty_weights():
        model = nn.ModuleDict(
            {"embed": nn.Embedding(1000, 100), "tail": nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 1000))}
        )
    model["tail"][1].weight = model["embed"].weight
    # embed (400 kB) and its partner tail.1 (4 kB more: its bias) are placed and charged together:
    # they do not fit GPU 0 together, so both move on, and tail.1's weight and bias are never split
    device_map = plan_device_map(PlacementRequest(model, {0: 400_000, 1: 10**9}, reserve={}))
    assert device_map == {"": 1}
    roomy = plan_device_map(PlacementRequest(model, {0: 404_000, 1: 10**9}, reserve={}))
    assert roomy == {"embed": 0, "tail.0": 1, "tail.1": 0}
    check_device_map(model, device_map)
    assert device_of(device_map, "tail.1.weight") == device_of(device_map, "embed.weight")


def test_no_split_class_is_never_split():
    model = nn.Sequential(nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 100)), nn.Linear(10, 10))
    split = plan_device_map(PlacementRequest(model, {0: 50_000, "cpu": 10**9}, reserve={}))
    assert split == {"0.0": 0, "0.1": "cpu", "1": "cpu"}
    whole = plan_device_map(
        PlacementRequest(model, {0: 50_000, "cpu": 10**9}, no_split_module_classes=["Sequential"], reserve={})
    )
    assert whole == {"": "cpu"}


def test_aliased_module_is_covered_and_checks():
    class Aliased(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer1 = nn.Linear(3, 3)
            self.layer2 = self.layer1
            self.other = nn.Linear(300, 300)

    model = Aliased()
    device_map = plan_device_map(PlacementRequest(model, {0: 100, "cpu": 10**9}, reserve={}))
    assert device_map == {"layer1": 0, "layer2": 0, "other": "cpu"}
    check_device_map(model, device_map)


# -- check_device_map ---------------------------------------------------------------------------


@pytest.fixture
def two_layer():
    return nn.ModuleDict({"fc": nn.Linear(2, 2), "out": nn.Linear(2, 2)})


@pytest.mark.parametrize(
    "device_map",
    [
        {"": "cpu"},
        {"": 0},
        {"fc": 0, "out": "disk"},
        {"fc.weight": "cuda:1", "fc.bias": "0", "out": "mps"},
        {"fc": 0, "fc.weight": 0, "out": "cpu"},  # overlapping but agreeing
    ],
)
def test_valid_maps_pass(two_layer, device_map):
    check_device_map(two_layer, device_map)


def test_seed_overlap_that_disagrees_is_rejected(two_layer):
    with pytest.raises(DeviceMapError, match=r"'fc\.bias' \(cpu\) inside 'fc' \(0\)"):
        check_device_map(two_layer, {"fc": 0, "fc.weight": 0, "fc.bias": "cpu", "out": 0})
    with pytest.raises(DeviceMapError, match="overlap"):
        check_device_map(two_layer, {"": "cpu", "fc": 0})


def test_unknown_names_warn_as_in_accelerate_and_are_rejected_with_strict(two_layer):
    with pytest.warns(UserWarning, match=r"'fc\.scale'.*does not have"):
        check_device_map(two_layer, {"": 0, "fc.scale": 0})
    with pytest.raises(DeviceMapError, match=r"'fc\.scale'.*does not have"):
        check_device_map(two_layer, {"": 0, "fc.scale": 0}, strict=True)


@pytest.mark.parametrize("device", ["gpu", -1, "cuda:x", 1.5, True, None])
def test_unknown_devices_are_rejected(two_layer, device):
    with pytest.raises(DeviceMapError, match=r"unknown device.*'fc'"):
        check_device_map(two_layer, {"fc": device, "out": 0})


def test_missing_coverage_is_rejected(two_layer):
    with pytest.raises(DeviceMapError, match=r"2 tensor\(s\).*'out\.weight', 'out\.bias'"):
        check_device_map(two_layer, {"fc": 0})
    with pytest.raises(DeviceMapError, match=r"'fc\.bias'"):
        check_device_map(two_layer, {"fc.weight": 0, "out": 0})


def test_error_is_one_line(two_layer):
    with pytest.raises(DeviceMapError) as info:
        check_device_map(two_layer, {"fc": 0, "fc.bias": "cpu", "nope": 1})
    assert "\n" not in str(info.value)


def test_tied_duplicates_must_be_covered_too():
    model = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    model["b"].weight = model["a"].weight
    with pytest.raises(DeviceMapError, match=r"'b\.weight'"):
        check_device_map(model, {"a": 0, "b.bias": 0})


def test_normalize_device_map_from_json_values():
    assert normalize_device_map(
        {"a": "0", "b": "cuda:3", "c": "CPU", "d": 2, "e": torch.device("cuda", 1), "f": "disk"}
    ) == {"a": 0, "b": 3, "c": "cpu", "d": 2, "e": 1, "f": "disk"}


def test_device_of_takes_the_longest_prefix():
    device_map = {"": "disk", "model": "cpu", "model.layers.1": 0, "model.layers.10": 1}
    assert device_of(device_map, "model.layers.1.weight") == 0
    assert device_of(device_map, "model.layers.10.weight") == 1
    assert device_of(device_map, "model.layers.2.weight") == "cpu"
    assert device_of(device_map, "lm_head.weight") == "disk"
    with pytest.raises(DeviceMapError):
        device_of({"model": 0}, "lm_head.weight")


def test_compress_merges_uniform_modules():
    assert compress_device_map({"a.w": 0, "a.b": 0, "c.w": 0}) == {"": 0}
    assert compress_device_map({"a.x.w": 0, "a.y.w": 0, "a.z.w": 1, "c.w": 1}) == {"a.x": 0, "a.y": 0, "a.z": 1, "c": 1}


def test_summary_counts_bytes_keys_and_budget():
    model = nn.ModuleDict({"fc": nn.Linear(10, 10), "out": nn.Linear(10, 10)})
    summary = summarize_device_map(model, {"fc": 0, "out.weight": "cpu", "out.bias": "disk"}, {0: 880, "cpu": "1KB"})
    devices = summary["devices"]
    assert list(devices) == [0, "cpu", "disk"]
    assert devices[0] == {"bytes": 440, "modules": 1, "tensors": 2, "budget": 880, "fraction": 0.5}
    assert devices["cpu"]["bytes"] == 400 and devices["cpu"]["fraction"] == 0.4
    assert devices["disk"] == {"bytes": 40, "modules": 1, "tensors": 1, "budget": None, "fraction": None}
    assert summary["total_bytes"] == 880


def test_uncovered_tensors_are_named_five_at_most():
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(4)])
    with pytest.raises(DeviceMapError) as six:
        check_device_map(model, {"0": "cpu"})
    assert str(six.value) == (
        "device map covers no device for 6 tensor(s) ('1.weight', '1.bias', '2.weight', '2.bias', "
        "'3.weight' and 1 more): add keys for them or their modules, or use '' for the whole model"
    )
    with pytest.raises(DeviceMapError) as two:
        check_device_map(model, {"0": "cpu", "1": "cpu", "2": "cpu"})
    assert "for 2 tensor(s) ('3.weight', '3.bias'): add keys" in str(two.value)
    with pytest.raises(DeviceMapError) as five:
        check_device_map(model, {"0.weight": "cpu", "3": "cpu"})
    assert "for 5 tensor(s) ('0.bias', '1.weight', '1.bias', '2.weight', '2.bias'): add keys" in str(five.value)


def test_summary_worked_by_hand():
    from offload_core.planning.device_map import summarize_device_map

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 2))  # 20, 10 and 6 floats
    summary = summarize_device_map(model, {"0": "disk", "1": "cpu", "2": 0}, {0: 100, "cpu": 80})
    assert list(summary["devices"]) == [0, "cpu", "disk"]  # GPUs by id, then cpu, then disk
    assert summary["devices"] == {
        0: {"bytes": 24, "modules": 1, "tensors": 2, "budget": 100, "fraction": 0.24},
        "cpu": {"bytes": 40, "modules": 1, "tensors": 2, "budget": 80, "fraction": 0.5},
        "disk": {"bytes": 80, "modules": 1, "tensors": 2, "budget": None, "fraction": None},
    }
    assert summary["total_bytes"] == 144
    whole = summarize_device_map(model, {"": "cpu"})
    assert whole == {
        "devices": {"cpu": {"bytes": 144, "modules": 1, "tensors": 6, "budget": None, "fraction": None}},
        "total_bytes": 144,
    }
