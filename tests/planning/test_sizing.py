"""Sizes of tensors and modules, tied parameters, size strings and max_memory parsing (seed 000's worked examples)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from offload_core.loading.empty import init_empty_weights
from offload_core.errors import ConfigError
from offload_core.planning import (
    compute_module_sizes,
    find_tied_parameters,
    get_max_layer_size,
    get_max_memory,
    largest_block_size,
    named_module_tensors,
)
from offload_core.values import parse_size


class FeedForward(nn.Module):
    def __init__(self, num_layer, in_dim, hidden_dim):
        super().__init__()
        layers = nn.Sequential()
        layers.append(nn.Linear(in_dim, hidden_dim))
        for _ in range(num_layer - 2):
            layers.append(nn.Linear(hidden_dim, hidden_dim))
        layers.append(nn.Linear(hidden_dim, in_dim))
        self.layers = layers
        self.activate = nn.ReLU()


class Head(nn.Module):
    def __init__(self, in_dim, num_class):
        super().__init__()
        self.out = nn.Linear(in_dim, num_class)
        self.softmax = nn.Softmax(dim=-1)


class ExampleModel(nn.Module):
    def __init__(self, vocab_size, in_dim, num_layer, num_class):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, in_dim)
        self.feed_forward = FeedForward(num_layer, in_dim, 4 * in_dim)
        self.head = Head(in_dim, num_class)


SEED_SIZES = {
    "": 26246,
    "embed": 3200,
    "embed.weight": 3200,
    "feed_forward": 22944,
    "feed_forward.layers": 22944,
    "feed_forward.layers.0": 4224,
    "feed_forward.layers.0.weight": 4096,
    "feed_forward.layers.0.bias": 128,
    "feed_forward.layers.1": 8320,
    "feed_forward.layers.1.weight": 8192,
    "feed_forward.layers.1.bias": 128,
    "feed_forward.layers.2": 8320,
    "feed_forward.layers.2.weight": 8192,
    "feed_forward.layers.2.bias": 128,
    "feed_forward.layers.3": 2080,
    "feed_forward.layers.3.weight": 2048,
    "feed_forward.layers.3.bias": 32,
    "head": 102,
    "head.out": 102,
    "head.out.weight": 96,
    "head.out.bias": 6,
}


def test_seed_example_sizes_number_for_number():
    model = ExampleModel(100, 16, 4, 3).half()
    sizes = compute_module_sizes(
        model, dtype=torch.float32, special_dtypes={"feed_forward.layers.0.weight": torch.float32}
    )
    assert dict(sizes) == SEED_SIZES


def test_sizes_on_meta_match_real_and_target_dtype_only_shrinks():
    with init_empty_weights():
        meta = ExampleModel(100, 16, 4, 3)
    real = ExampleModel(100, 16, 4, 3)
    assert dict(compute_module_sizes(meta)) == dict(compute_module_sizes(real))
    # the seed counts layer 0's weight (1024 elements) at 4 bytes, everything else at 2
    assert compute_module_sizes(real)[""] == 2 * (SEED_SIZES[""] - 2048)
    halved = compute_module_sizes(real, dtype="float16")
    assert halved["embed.weight"] == 3200
    assert compute_module_sizes(real.half(), dtype=torch.float32)["embed.weight"] == 3200


def test_int_and_bool_buffers_keep_their_width():
    module = nn.Module()
    module.register_buffer("ids", torch.zeros(10, dtype=torch.int64))
    module.register_buffer("mask", torch.zeros(16, dtype=torch.bool))
    module.weight = nn.Parameter(torch.zeros(10))
    sizes = compute_module_sizes(module, dtype=torch.float16)
    assert (sizes["ids"], sizes["mask"], sizes["weight"], sizes[""]) == (80, 2, 20, 102)


def test_shared_tensor_counts_once_at_its_first_name():
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight
    sizes = compute_module_sizes(model)
    assert sizes[""] == 64
    assert "1.weight" not in sizes and sizes["0.weight"] == 64
    names = [n for n, _ in named_module_tensors(model, recurse=True)]
    assert names == ["0.weight"]
    all_names = [n for n, _ in named_module_tensors(model, recurse=True, remove_duplicate=False)]
    assert all_names == ["0.weight", "1.weight"]


def test_named_module_tensors_direct_only_by_default():
    model = nn.BatchNorm1d(3)
    assert [n for n, _ in named_module_tensors(model)] == [
        "weight",
        "bias",
        "running_mean",
        "running_var",
        "num_batches_tracked",
    ]
    assert [n for n, _ in named_module_tensors(model, include_buffers=False)] == ["weight", "bias"]
    assert list(named_module_tensors(nn.Sequential(nn.Linear(2, 2)))) == []


class AliasedModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(3, 3)
        self.layer2 = self.layer1


class TiedParameters(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(3, 3)
        self.layer2 = nn.Linear(3, 3)
        self.layer2.weight = self.layer1.weight
        self.layer2.bias = self.layer1.bias


def test_seed_tied_parameters_example():
    # a module registered twice ties every parameter it has, as accelerate reports it
    assert find_tied_parameters(AliasedModule()) == [["layer1.bias", "layer2.bias"], ["layer1.weight", "layer2.weight"]]
    assert find_tied_parameters(TiedParameters()) == [
        ["layer1.bias", "layer2.bias"],
        ["layer1.weight", "layer2.weight"],
    ]


def test_tied_parameters_on_meta_three_way():
    with init_empty_weights():
        model = nn.ModuleDict({"c": nn.Linear(2, 2), "a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    model["a"].weight = model["c"].weight
    model["b"].weight = model["c"].weight
    assert model["c"].weight.device.type == "meta"
    assert find_tied_parameters(model) == [["a.weight", "b.weight", "c.weight"]]


def test_max_layer_size_respects_no_split_classes():
    model = ExampleModel(100, 16, 4, 3)
    sizes = compute_module_sizes(model)
    units = list(model.named_children())
    assert get_max_layer_size(units, sizes, []) == (
        sizes["feed_forward.layers.1"],
        ["feed_forward.layers.1", "feed_forward.layers.2"],
    )
    assert get_max_layer_size(units, sizes, ["FeedForward"]) == (sizes["feed_forward"], ["feed_forward"])
    assert largest_block_size(model, ["Sequential"]) == sizes["feed_forward.layers"]
    assert largest_block_size(model, [], dtype=torch.float16) == 8320


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1GiB", 2**30),
        ("1GB", 10**9),
        ("1.5MiB", 3 * 2**19),
        ("500MB", 500 * 10**6),
        ("2KiB", 2048),
        ("8Mb", 10**6),
        ("8Gib", 2**30),
        ("123", 123),
        (4096, 4096),
    ],
)
def test_parse_size_table(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["10G", "-5", -5, "GiB", "1.5 XB", True])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError):
        parse_size(bad)


def test_get_max_memory_parses_keys_and_orders_devices():
    budgets = get_max_memory({"cpu": "1GB", "cuda:2": "2GiB", 0: 100, "1": "1KB", "disk": 0}, check_devices=False)
    assert list(budgets) == [0, 1, 2, "cpu", "disk"]
    assert budgets == {0: 100, 1: 1000, 2: 2**31, "cpu": 10**9, "disk": 0}


@pytest.mark.parametrize("key", ["gpu0", "tpu", -1, "cuda:x"])
def test_get_max_memory_unknown_key_names_it_and_the_accepted_forms(key):
    with pytest.raises(ConfigError, match=r"unknown device .*cpu.*disk"):
        get_max_memory({key: 10, "cpu": 10}, check_devices=False)


def test_get_max_memory_duplicate_device_is_an_error():
    with pytest.raises(ConfigError, match="twice"):
        get_max_memory({0: 10, "cuda:0": 20}, check_devices=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without that many GPUs")
def test_get_max_memory_warns_of_missing_devices_unless_told_not_to(caplog, monkeypatch):
    # An in-process Hydra run earlier in the same worker may have configured logging with existing loggers
    # disabled; the warning is this module's, so make sure its logger is live and reaches caplog.
    logger = logging.getLogger("offload_core.planning.budgets")
    monkeypatch.setattr(logger, "disabled", False)
    monkeypatch.setattr(logger, "propagate", True)
    caplog.set_level(logging.WARNING, logger="offload_core.planning.budgets")
    assert get_max_memory({7: "1GB"}) == {7: 10**9}
    assert "Device 7 is not available" in caplog.text
    caplog.clear()
    assert get_max_memory({7: "1GB"}, check_devices=False) == {7: 10**9}
    assert not caplog.text


def test_get_max_memory_reads_the_machine():
    budgets = get_max_memory()
    assert budgets["cpu"] > 0
    assert all(isinstance(k, int) for k in budgets if k != "cpu")


# -- values, each checked against a number worked out by hand ----------------------------------------------


def test_format_size_in_powers_of_two():
    from offload_core.values import format_size

    assert [format_size(n) for n in (0, 1, 1023)] == ["0 B", "1 B", "1023 B"]
    assert (
        format_size(1024) == "1.00 KiB"
        and format_size(1536) == "1.50 KiB"
        and format_size(1024**2 - 1) == "1024.00 KiB"
    )
    assert format_size(5 * 1024**2) == "5.00 MiB" and format_size(3 * 1024**3 // 2) == "1.50 GiB"
    assert format_size(2 * 1024**4) == "2048.00 GiB"  # GiB is the largest unit
    assert format_size(-2048) == "-2.00 KiB"


class _Tied(nn.Module):
    """a.weight and b.weight are one Parameter; one int64 buffer registered twice (here and in a)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2, bias=False)
        self.b.weight = self.a.weight
        shared = torch.zeros(3, dtype=torch.int64)
        self.register_buffer("steps", shared)
        self.a.register_buffer("steps", shared)


def test_tie_groups_and_sizes_count_a_shared_tensor_once():
    from offload_core.planning.sizing import compute_module_sizes, tie_groups

    model = _Tied()
    assert tie_groups(model) == {"a.weight": ["a.weight", "b.weight"], "steps": ["steps", "a.steps"]}
    assert tie_groups(model, parameters_only=True) == {"a.weight": ["a.weight", "b.weight"]}
    assert find_tied_parameters(model) == [["a.weight", "b.weight"]]
    sizes = compute_module_sizes(model)
    # a.weight 8 x 4 B, a.bias 2 x 4 B; b.weight is a's; steps 3 x 8 B counted once, at its first name
    assert dict(sizes) == {"": 64, "a": 40, "a.weight": 32, "a.bias": 8, "steps": 24}
    half = compute_module_sizes(model, dtype=torch.float16)  # floats shrink, the int64 buffer keeps its width
    assert half[""] == 44 and half["a"] == 20 and half["steps"] == 24
    assert compute_module_sizes(model, dtype=torch.float64)[""] == 64  # never widened
    assert compute_module_sizes(model, special_dtypes={"a.bias": "float64"})[""] == 72  # a named tensor's own dtype
    assert dict(compute_module_sizes(model, buffers_only=True)) == {"": 24, "steps": 24}


def test_largest_block_size_is_the_largest_unit_a_placement_keeps_whole():
    from offload_core.planning.sizing import largest_block_size

    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 2), nn.Linear(2, 2)))
    # leaves: 0 = 40 floats, 1.0 = 18, 1.1 = 6; as a whole, block 1 = 24 floats
    assert largest_block_size(model, []) == 160
    assert largest_block_size(model, [], dtype=torch.float16) == 80
    assert largest_block_size(nn.Sequential(nn.Linear(2, 2), model[1]), ["Sequential"]) == 96  # kept whole
