"""Which accelerator offload_core uses: a test not marked gpu runs on the CPU even on a machine with a GPU (the
active accelerator is the host, and processes the tests start are told so), GPU indices name the active
accelerator's devices, and a dispatched model's default execution device follows its map."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from offload_core import devices, dispatch_model
from offload_core.devices import select
from offload_core.devices.fake import FakeAccelerator
from offload_core.loading.execution_device import default_execution_device
from offload_core.values import budget_key, device_key


@pytest.fixture
def gpu_machine(monkeypatch):
    """This machine as if it had a GPU: the accelerator the device layer detects is a fake one."""
    fake = FakeAccelerator(count=2)
    monkeypatch.setattr(select, "_detected", fake)
    fake.install()
    yield fake
    fake.uninstall()


def test_a_cpu_test_stays_on_the_cpu_on_a_gpu_machine(gpu_machine):
    from transformers import AutoModelForCausalLM, LlamaConfig

    assert devices.active() is devices.HOST
    assert default_execution_device() == torch.device("cpu")
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    dispatch_model(
        model,
        {
            "model.embed_tokens": "cpu",
            "model.layers": "disk",
            "model.norm": "cpu",
            "model.rotary_emb": "cpu",
            "lm_head": "cpu",
        },
        offload_folder=None,
        storage="pinned_cpu",
    )
    assert model.offload_state.execution_device == torch.device("cpu")
    assert not model.offload_state.store.pinned
    model.offload_state.remove()
    # without the suite's choice, the detected accelerator would run it: the choice is what keeps the test on the cpu
    with devices.use(None):
        assert devices.active() is gpu_machine
        assert default_execution_device() == torch.device("fakegpu", 0)


@pytest.mark.slow  # a process
def test_processes_the_tests_start_use_the_cpu():
    assert os.environ.get(devices.ENV) == "cpu"
    code = "from offload_core import devices; print(devices.active().type)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "cpu"


@pytest.mark.parametrize("value,hidden", [("cpu", True), ("none", True), ("auto", False)])
def test_the_environment_hides_the_accelerator(value, hidden, monkeypatch, gpu_machine):
    from offload_core.devices import torch_backend

    monkeypatch.setattr(select, "_detected", None)
    monkeypatch.setattr(torch_backend, "detect", lambda: "cuda")  # a machine whose torch reports CUDA
    monkeypatch.setenv(devices.ENV, value)
    with devices.use(None):
        found = devices.active()
    assert (found is devices.HOST) == hidden
    assert hidden or found.type == "cuda"


def test_gpu_indices_name_the_active_accelerators_devices(fake_gpu):
    fake = fake_gpu(count=4)
    assert devices.gpu(3) == torch.device("fakegpu", 3)
    assert [device_key(v) for v in (2, "2", "cuda:2", "fakegpu:2", torch.device("fakegpu", 2), "fakegpu")] == [
        2,
        2,
        2,
        2,
        2,
        0,
    ]
    assert fake.normalize("fakegpu") == torch.device("fakegpu", 0)
    assert default_execution_device({"a": "cpu", "b": 3, "c": 1}) == torch.device("fakegpu", 3)
    assert default_execution_device({"a": "disk"}) == torch.device("fakegpu", 0)


@pytest.mark.parametrize(
    ("device", "key"),
    [("cpu", "cpu"), ("cuda", 0), ("cuda:0", 0), ("cuda:3", 3), ("fakegpu", 0), ("fakegpu:2", 2)],
)
def test_a_devices_budget_key_is_cpu_or_its_index_zero_for_a_bare_gpu(fake_gpu, device, key):
    """The budget key of an execution device: "cpu" for a CPU, its index otherwise (0 for a bare ``cuda``, never
    None), the key :func:`device_key` reads ``max_memory`` by."""
    fake_gpu(count=4)
    assert budget_key(torch.device(device)) == key
    assert device_key(torch.device(device)) == key == device_key(device)


def test_an_unindexed_accelerator_device_is_its_device_0(fake_gpu):
    from transformers import AutoModelForCausalLM, LlamaConfig

    fake = fake_gpu(count=2)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    dispatch_model(
        model,
        {"model.embed_tokens": 0, "model.layers": "cpu", "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0},
        execution_device="fakegpu",
    )
    assert model.offload_state.execution_device == fake.device(0)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        model(ids)
        moved = model.offload_state.stats.bytes
        model(ids)  # the offloaded layers cross once per forward, never again for a "fakegpu" vs "fakegpu:0" mismatch
    assert model.offload_state.stats.bytes == 2 * moved
    model.offload_state.remove()
