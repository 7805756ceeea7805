"""The interleaved placement keeps every k-th block resident, stays within budget, and passes offload_core's contract
checks."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, LlamaConfig

from offload_core.loading.empty import init_empty_weights
from offload_core.errors import ConfigError
from offload_core.planning import PlacementRequest, compute_module_sizes, device_of
from offload_core.testing import check_placement
from offload_interleaved import Interleaved, InterleavedConfig

NO_SPLIT = ["LlamaDecoderLayer"]


@pytest.fixture(scope="module")
def model():
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


def _layers(device_map, device):
    return [i for i in range(6) if device_of(device_map, f"model.layers.{i}.mlp.up_proj.weight") == device]


@pytest.mark.parametrize("k,resident", [(1, [0, 1, 2, 3, 4, 5]), (2, [0, 2, 4]), (3, [0, 3])])
def test_every_kth_block_resident_on_a_cpu_run(model, k, resident):
    request = PlacementRequest(model, {"cpu": 10 * compute_module_sizes(model)[""]}, NO_SPLIT, reserve={"cpu": 0})
    device_map = check_placement(Interleaved(InterleavedConfig(k=k)), request)
    assert _layers(device_map, "cpu") == resident
    assert _layers(device_map, "disk") == [i for i in range(6) if i not in resident]
    assert device_of(device_map, "model.embed_tokens.weight") == "cpu" == device_of(device_map, "lm_head.weight")


def test_gpu_plan_offloads_to_cpu_then_disk(model):
    sizes = compute_module_sizes(model)
    block = sizes["model.layers.0"]
    request = PlacementRequest(model, {0: sizes[""], "cpu": 2 * block}, NO_SPLIT, reserve={0: block, "cpu": 0})
    device_map = check_placement(Interleaved(InterleavedConfig(k=2)), request)
    assert _layers(device_map, 0) == [0, 2, 4]
    assert _layers(device_map, "cpu") == [1, 3] and _layers(device_map, "disk") == [5]


def test_a_tight_budget_offloads_blocks_it_would_keep(model):
    sizes = compute_module_sizes(model)
    budget = sizes["model.embed_tokens"] + sizes["model.norm"] + sizes["model.rotary_emb"] + sizes["model.layers.0"]
    request = PlacementRequest(model, {"cpu": budget}, NO_SPLIT, reserve={"cpu": 0})
    device_map = check_placement(Interleaved(InterleavedConfig(k=2)), request)
    assert _layers(device_map, "cpu") == [0]


def test_reference_reservation_holds_back_a_block(model):
    request = PlacementRequest(model, {"cpu": compute_module_sizes(model)[""]}, NO_SPLIT)
    check_placement(Interleaved(InterleavedConfig(k=2)), request)


def test_k_below_one_is_a_config_error():
    with pytest.raises(ConfigError, match="placement.k=0"):
        Interleaved(InterleavedConfig(k=0))
