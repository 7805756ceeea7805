"""accelerate's big-model API on our functions: signatures, error types, keyword behaviours, and budgets kept with
ties."""

from __future__ import annotations

import logging
import inspect
import json
import warnings

import pytest
import torch
from torch import nn

import offload_core
from offload_core.errors import ConfigError, DeviceMapError, OffloadError
from offload_core.loading.dispatch import dispatch_model, load_checkpoint_and_dispatch
from offload_core.loading.empty import init_empty_weights, init_on_device
from offload_core.module_hooks.base import module_hooks
from offload_core.loading.cpu_offload import cpu_offload_with_hook
from offload_core.planning import (
    check_device_map,
    compute_module_sizes,
    device_of,
    find_tied_parameters,
    get_balanced_memory,
    get_max_memory,
    infer_auto_device_map,
)

from tests.logs import records_of

# accelerate 1.x's positional parameters, in order, for the functions we share a name with
ACCELERATE = {
    infer_auto_device_map: [
        "model",
        "max_memory",
        "no_split_module_classes",
        "dtype",
        "special_dtypes",
        "verbose",
        "clean_result",
        "offload_buffers",
        "fallback_allocation",
    ],
    dispatch_model: [
        "model",
        "device_map",
        "main_device",
        "state_dict",
        "offload_dir",
        "offload_index",
        "offload_buffers",
        "skip_keys",
        "preload_module_classes",
        "force_hooks",
    ],
    load_checkpoint_and_dispatch: [
        "model",
        "checkpoint",
        "device_map",
        "max_memory",
        "no_split_module_classes",
        "offload_folder",
        "offload_buffers",
        "dtype",
        "offload_state_dict",
        "skip_keys",
        "preload_module_classes",
        "force_hooks",
        "strict",
        "full_state_dict",
        "broadcast_from_rank0",
    ],
    get_balanced_memory: ["model", "max_memory", "no_split_module_classes", "dtype", "special_dtypes", "low_zero"],
    get_max_memory: ["max_memory"],
    check_device_map: ["model", "device_map"],
    compute_module_sizes: ["model", "dtype", "special_dtypes", "buffers_only"],
    cpu_offload_with_hook: ["model", "execution_device", "prev_module_hook"],
    init_empty_weights: ["include_buffers"],
    init_on_device: ["device", "include_buffers"],
}


@pytest.mark.parametrize("function", list(ACCELERATE), ids=lambda f: f.__name__)
def test_positional_parameters_are_accelerates_and_ours_are_keyword_only(function):
    params = inspect.signature(function).parameters.values()
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == ACCELERATE[function]


def test_defaults_match_accelerate():
    sig = inspect.signature(load_checkpoint_and_dispatch).parameters
    assert sig["device_map"].default is None and sig["strict"].default is False
    assert inspect.signature(dispatch_model).parameters["force_hooks"].default is False


def test_errors_are_also_the_builtin_exceptions_accelerate_raises():
    assert issubclass(DeviceMapError, ValueError) and issubclass(DeviceMapError, OffloadError)
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ValueError):
        check_device_map(nn.Linear(2, 2), {"weight": 0})


def test_get_max_memory_logs_a_missing_gpu_instead_of_raising():
    # Independent of test order: the records are taken on the module's logger itself (tests/logs.py), so neither a
    # Hydra run earlier in this process (disable_existing_loggers) nor a parent that stops propagating hides them.
    with records_of("offload_core.planning.budgets", logging.WARNING) as said:
        assert get_max_memory({99: 10, "cpu": "1KB"}) == {99: 10, "cpu": 1000}
    assert said == ["Device 99 is not available, available devices are []"]


def test_get_balanced_memory_takes_accelerates_arguments():
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    caps = get_balanced_memory(model, {0: 10**6, 1: 10**6, "cpu": 10**6})
    assert caps[0] < 10**6 and caps[1] == 10**6


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(16, 16)
        self.decoder = nn.Linear(16, 100)


class Tied(nn.Module):
    """RoBERTa-style: an embedding, a layer, and a no-split head whose decoder shares the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.layer = nn.Linear(16, 16)
        self.head = Head()
        self.head.decoder.weight = self.embed.weight


def used_bytes(model, device_map):
    sizes = compute_module_sizes(model)
    used: dict = {}
    for name, _ in model.named_parameters():
        device = device_of(device_map, name)
        used[device] = used.get(device, 0) + sizes[name]
    return used


def test_a_tied_no_split_block_that_does_not_fit_moves_on_with_its_partner():
    model = Tied()
    budgets = {0: 100, 1: 4096, "cpu": 10**9}
    device_map = infer_auto_device_map(model, budgets, ["Head"])
    used = used_bytes(model, device_map)
    assert all(used[d] <= budgets[d] for d in used if d != "disk")
    assert device_of(device_map, "head.decoder.weight") == device_of(device_map, "embed.weight")


def test_tied_partners_are_charged_when_the_first_member_is_placed():
    model = Tied()
    embed, head = 100 * 16 * 4, (16 * 16 + 16 + 100) * 4
    device_map = infer_auto_device_map(model, {0: embed + head + 10, 1: 10**6, "cpu": 10**6}, ["Head"], reserve={})
    # embed and its partner head go together on GPU 0; the layer, reached later, goes on to GPU 1
    assert device_of(device_map, "head.dense.weight") == 0 and device_of(device_map, "layer.weight") == 1


def test_a_module_registered_twice_is_one_module_everywhere():
    layer = nn.Linear(4, 4)
    model = nn.Sequential(layer, layer)
    assert find_tied_parameters(model) == [["0.bias", "1.bias"], ["0.weight", "1.weight"]]
    with pytest.raises(DeviceMapError, match="one module"):
        check_device_map(model, {"0": "cpu", "1": "disk"})
    reference = model(torch.ones(1, 4))
    dispatch_model(model, {"0": "cpu", "1": "cpu"}, main_device="cpu")
    assert torch.equal(model(torch.ones(1, 4)), reference)


def test_unplaced_buffers_of_offloaded_layers_warn_without_offload_buffers():
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64))
    with pytest.warns(UserWarning, match="offload_buffers=True"):
        infer_auto_device_map(model, {0: 100, "cpu": 10**6})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        infer_auto_device_map(model, {0: 100, "cpu": 10**6}, offload_buffers=True)


def test_clean_result_false_gives_one_key_per_unit():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert infer_auto_device_map(model, {"cpu": 10**6}, clean_result=False) == {"0": "cpu", "1": "cpu"}
    assert infer_auto_device_map(model, {"cpu": 10**6}) == {"": "cpu"}


def test_fallback_allocation_puts_a_fitting_unit_on_the_first_gpu():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(2, 2))
    budgets = {0: 100, "cpu": 10**6}
    assert infer_auto_device_map(model, budgets, reserve={}) == {"": "cpu"}
    fallback = infer_auto_device_map(model, budgets, reserve={}, fallback_allocation=True)
    assert device_of(fallback, "1.weight") == 0 and device_of(fallback, "0.weight") == "cpu"


def test_init_empty_weights_uses_the_meta_device_and_patches_nothing():
    register = nn.Module.register_parameter, nn.Module.register_buffer
    with init_empty_weights(include_buffers=True):
        assert (nn.Module.register_parameter, nn.Module.register_buffer) == register
        model = nn.BatchNorm1d(4)
    assert model.weight.device.type == "meta" and model.running_mean.device.type == "meta"
    with init_empty_weights():
        assert (nn.Module.register_parameter, nn.Module.register_buffer) == register
        model = nn.BatchNorm1d(4)
    assert model.weight.device.type == "meta" and model.running_mean.device.type == "cpu"
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # nothing stays in force after the block


def test_cpu_offload_with_hook_keeps_weights_on_cpu_until_called():
    """The meta device stands in for an accelerator: a weight moves there on the first call, stays until
    ``offload()``, then is back on the cpu with its values."""
    model = nn.Linear(4, 4)
    weight = model.weight.detach().clone()
    model, handle = cpu_offload_with_hook(model, execution_device="meta")
    assert model.weight.device.type == "cpu"
    out = model(torch.ones(1, 4))
    assert out.device.type == "meta" and model.weight.device.type == "meta"
    assert handle.stats.loads == 2 and handle.hook.offloads == 0  # weight and bias, brought in once
    handle.offload()
    assert model.weight.device.type == "cpu" and torch.equal(model.weight, weight) and handle.hook.offloads == 1


def test_dispatch_model_offload_dir_writes_a_real_folder_and_state_dict_feeds_offloaded_weights(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    reference = model(torch.ones(1, 4))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with init_empty_weights():
        empty = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    empty[0].load_state_dict({k[2:]: v for k, v in state.items() if k.startswith("0.")}, assign=True)
    dispatch_model(empty, {"0": "cpu", "1": "disk"}, "cpu", state, tmp_path / "off")
    assert any((tmp_path / "off").iterdir())
    assert torch.equal(empty(torch.ones(1, 4)), reference)


def test_dispatch_model_reads_an_accelerate_offload_index(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    reference = model(torch.ones(1, 4))
    index = {}
    for name in ("1.weight", "1.bias"):
        tensor = model.state_dict()[name]
        tensor.numpy().tofile(tmp_path / f"{name}.dat")
        index[name] = {"dtype": "float32", "shape": list(tensor.shape)}
    (tmp_path / "index.json").write_text(json.dumps(index))
    with torch.no_grad():
        model[1].weight.zero_()  # the folder, not the model, holds the offloaded values
    dispatch_model(
        model,
        {"0": "cpu", "1": "disk"},
        main_device="cpu",
        offload_dir=tmp_path,
        offload_index=index,
        storage="pinned_cpu",
    )
    assert torch.equal(model(torch.ones(1, 4)), reference)


def test_the_package_exports_accelerates_names():
    for name in (
        "dispatch_model",
        "load_checkpoint_and_dispatch",
        "infer_auto_device_map",
        "init_empty_weights",
        "cpu_offload_with_hook",
        "find_tied_parameters",
        "check_device_map",
        "get_max_memory",
    ):
        assert callable(getattr(offload_core, name))


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x, mask=None):
        return self.b(self.a(x))


def test_preload_module_classes_loads_those_modules_whole_and_skip_keys_reach_the_policy():
    model = nn.Sequential(Pair(), Pair())
    reference = model(torch.ones(1, 4))
    dispatch_model(
        model, {"": "disk"}, main_device="cpu", preload_module_classes=["Pair"], skip_keys="mask", storage="pinned_cpu"
    )
    assert [unit.name for unit in model.offload_state.handle.units] == ["0", "1"]
    assert all(hook.skip_keys == {"mask"} for hook in module_hooks(model[0]) if hasattr(hook, "skip_keys"))
    assert any(hasattr(hook, "skip_keys") for hook in module_hooks(model[0]))
    assert torch.equal(model(torch.ones(1, 4)), reference)
    model.offload_state.remove()
    dispatch_model(model, {"": "disk"}, main_device="cpu", storage="pinned_cpu")
    assert [unit.name for unit in model.offload_state.handle.units] == ["0.a", "0.b", "1.a", "1.b"]


def test_load_checkpoint_and_dispatch_strict_and_device_map_none(tmp_path):
    from safetensors.torch import save_file

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    reference = model(torch.ones(1, 4))
    save_file({**model.state_dict(), "extra": torch.zeros(1)}, tmp_path / "model.safetensors")
    with init_empty_weights():
        empty = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(offload_core.errors.CheckpointError, match="strict=False"):
        load_checkpoint_and_dispatch(empty, tmp_path / "model.safetensors", strict=True, progress=False)
    with init_empty_weights():
        empty = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    load_checkpoint_and_dispatch(empty, tmp_path / "model.safetensors", progress=False)
    assert empty.hf_device_map == {"": "cpu"} and empty[0].weight.device.type == "cpu"
    assert torch.equal(empty(torch.ones(1, 4)), reference)
