"""A module whose forward reads its children's weights itself (mamba's mixer multiplies by ``dt_proj.weight`` without
calling ``dt_proj``) is brought in whole, its subtree's tensors with its own, by every policy: the mamba model
offloaded equals transformers' in-memory one, and the plan reserves such a unit."""

from __future__ import annotations

import pytest
import torch

import offload_core
from offload_core.module_hooks.units import find_units
from offload_core.planning import largest_module_size
from offload_core.planning.sizing import compute_module_sizes, reads_its_children
from tests.outputs import assert_same_outputs

IDS = torch.tensor([[1, 2, 3, 4, 5]])


@pytest.fixture(scope="module")
def mamba(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    config = transformers.MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=96, state_size=8)
    model = transformers.MambaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("mamba") / "model"
    model.save_pretrained(folder)
    return folder, model


def test_the_mixer_is_one_unit_of_its_subtree_and_the_plan_reserves_it(mamba):
    _, model = mamba
    mixer = model.backbone.layers[1].mixer
    assert reads_its_children(mixer) and not reads_its_children(model.backbone.layers[1])
    offloaded = {name: name for name, _ in model.named_parameters() if name.startswith("backbone.layers.1.")}
    units = {unit.name: {slot.full for slot in unit.slots} for unit in find_units(model, offloaded)}
    assert units["backbone.layers.1.mixer"] == {n for n in offloaded if ".mixer." in n}  # dt_proj's, A_log ...
    assert not any(name.startswith("backbone.layers.1.mixer.") for name in units)  # no unit of its children
    assert largest_module_size(model) >= compute_module_sizes(model)["backbone.layers.1.mixer"]


def test_a_module_owning_a_scale_beside_deeper_towers_is_not_read_whole():
    """A model with a parameter of its own (CLIP's ``logit_scale``) beside towers of layers stays split in units."""
    towers = torch.nn.Module()
    towers.tower = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    towers.logit_scale = torch.nn.Parameter(torch.ones(()))
    assert not reads_its_children(towers)
    offloaded = {name: name for name, _ in towers.named_parameters()}
    assert {unit.name for unit in find_units(towers, offloaded)} == {"", "tower.0", "tower.1"}


@pytest.mark.slow  # whole runs (the unit above stays in the quick subset)
@pytest.mark.parametrize("policy", ["align_per_call", "functional_call", "prefetch"])
def test_mamba_offloaded_is_transformers_in_memory_model(mamba, policy, tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    folder, reference = mamba
    device_map = {
        "backbone.embeddings": "cpu",
        "backbone.layers.0": "cpu",
        "backbone.layers.1": "disk",
        "backbone.norm_f": "cpu",
        "lm_head": "disk",
    }
    offload = {"policy": policy, "device_map": device_map, "over_budget": "warn"}
    model = offload_core.from_pretrained(folder, {"cpu": "3MiB"}, offload)
    try:
        assert_same_outputs(model, reference, IDS, tokens=3)
    finally:
        model.offload_state.release()
