"""Every built-in placement, store and module-hook policy passes the contract checks plugin authors use
(offload_core.testing)."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, LlamaConfig

from offload_core.loading.empty import init_empty_weights
from offload_core.planning import PlacementRequest, compute_module_sizes
from offload_core.registry.manager import build_registry
from offload_core.testing import (
    check_placement,
    check_policy_preserves_outputs,
    check_policy_reservation,
    check_store_round_trip,
)

REGISTRY = build_registry(load_entry_points=False)


def _meta_llama():
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
    )
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config)


def _requests():
    model = _meta_llama()
    total = compute_module_sizes(model)[""]
    block = compute_module_sizes(model)["model.layers.0"]
    no_split = ["LlamaDecoderLayer"]
    return {
        "cpu-and-disk": PlacementRequest(model, {"cpu": total // 2}, no_split, reserve={"cpu": 0}),
        "cpu-reserve": PlacementRequest(model, {"cpu": total // 2}, no_split, reserve={"cpu": block}),
        "two-gpus": PlacementRequest(
            model, {0: total // 3, 1: total // 3, "cpu": total // 4}, no_split, reserve={0: block, 1: 0, "cpu": 0}
        ),
        "reference-rule": PlacementRequest(model, {0: total // 2, "cpu": total // 4}, no_split),
    }


@pytest.mark.parametrize("name", REGISTRY.names("placement"))
@pytest.mark.parametrize("request_name", ["cpu-and-disk", "cpu-reserve", "two-gpus", "reference-rule"])
def test_builtin_placement_contract(name, request_name):
    device_map = check_placement(REGISTRY.create("placement", name), _requests()[request_name])
    assert device_map


@pytest.mark.parametrize(
    "name",
    # a store reading GGUF files takes no safetensors checkpoint: tests/storage/test_gguf_store.py holds it to the
    # same round trip on GGUF files
    [name for name in REGISTRY.names("storage") if not REGISTRY.create("storage", name).reads_gguf],
)
def test_builtin_store_contract(name, tmp_path):
    check_store_round_trip(REGISTRY.create("storage", name), tmp_path)


@pytest.mark.parametrize("name", REGISTRY.names("policy"))
def test_builtin_policy_contract(name, tmp_path):
    check_policy_preserves_outputs(REGISTRY.create("policy", name), tmp_path)
    check_policy_reservation(REGISTRY.create("policy", name))


def test_reservation_contract_catches_a_negative_or_missing_answer():
    class Negative:
        def attach(self, model, context):
            raise NotImplementedError

        def reserve(self, need):
            return {"cpu": -1}

    class Elsewhere(Negative):  # says nothing about the GPU it runs on
        def reserve(self, need):
            return {"cpu": need.block_bytes}

    with pytest.raises(AssertionError, match="-1 bytes"):
        check_policy_reservation(Negative())
    with pytest.raises(AssertionError, match="execution device 1"):
        check_policy_reservation(Elsewhere())


def test_contract_catches_a_placement_over_budget():
    class Greedy:
        def make_device_map(self, request):
            return {"": "cpu"}

    request = _requests()["cpu-and-disk"]
    with pytest.raises(AssertionError, match="over its budget"):
        check_placement(Greedy(), request)


def test_contract_catches_a_lossy_store(tmp_path):
    from offload_core.storage.memory import HostMemoryStore

    class Lossy(HostMemoryStore):
        def __getitem__(self, name):
            value = super().__getitem__(name)
            return value.round() if value.is_floating_point() else value

    with pytest.raises(AssertionError, match="other values"):
        check_store_round_trip(Lossy, tmp_path)
