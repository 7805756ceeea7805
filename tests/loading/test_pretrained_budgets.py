"""``from_pretrained``'s ``max_memory`` as users give it: a dict by device, or one size (a string or a number of bytes)
for the execution device; any other value is one ``ConfigError`` naming it, as every other bad size is."""

from __future__ import annotations

import pytest
import torch

import offload_core
from offload_core.errors import ConfigError
from offload_core.planning.budgets import read_max_memory
from offload_core.testing import tiny_tied_llama


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    tiny_tied_llama(path)
    return path


def _plan(path, max_memory):
    model = offload_core.from_pretrained(
        path, max_memory, offload={"storage": "safetensors", "execution_device": "cpu", "headroom": 0}
    )
    try:
        return model.hf_device_map, torch.equal(
            model(torch.tensor([[1, 2, 3]])).logits, model(torch.tensor([[1, 2, 3]])).logits
        )
    finally:
        model.offload_state.remove()


def test_one_size_is_the_execution_devices_budget(checkpoint):
    """The tiny Llama (about 30 KB) with a budget under its size: a string, an int and a float of bytes plan as the
    dict ``{"cpu": size}`` does, part of it on disk."""
    expected, _ = _plan(checkpoint, {"cpu": 12_000})
    assert "disk" in expected.values() and "cpu" in expected.values()
    for one in ("12KB", 12_000, 1.2e4):
        device_map, runs = _plan(checkpoint, one)
        assert device_map == expected and runs


def test_one_size_on_a_gpu_run_is_that_gpus_budget_beside_the_available_ram():
    budgets = read_max_memory("2GiB", torch.device("cuda", 1))
    assert budgets[1] == 2 * 2**30 and list(budgets) == [1, "cpu"] and budgets["cpu"] > 0
    assert read_max_memory(2e8, torch.device("cpu")) == {"cpu": 200_000_000}
    assert read_max_memory(None, torch.device("cpu")) is None


@pytest.mark.parametrize(
    "bad,said",
    [
        ("lots", "max_memory='lots' is not a size"),
        (-5, "max_memory=-5 is negative"),
        (True, "max_memory=True is not a size"),
        (float("nan"), "max_memory=nan is not a size"),
        (["1GB"], "max_memory=['1GB'] is not a size nor a dict of sizes by device"),
        ({"cpu": "lots"}, "max_memory['cpu']='lots' is not a size"),
    ],
)
def test_a_bad_max_memory_is_one_line_naming_it(checkpoint, bad, said):
    with pytest.raises(ConfigError) as caught:
        offload_core.from_pretrained(checkpoint, offload={"execution_device": "cpu", "headroom": 0}, max_memory=bad)
    message = str(caught.value)
    assert message.startswith(said) and "\n" not in message
