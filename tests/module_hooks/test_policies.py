"""Module-hook policies through the Python API: dispatch and remove restore the model; vLLM's budget rule; options."""

from __future__ import annotations

import re

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM, LlamaConfig

from offload_core import AlignDevicesHook, add_hook_to_module, dispatch_model, remove_hook_from_module
from offload_core.runner.config import register_configs
from offload_core.module_hooks.functional import offload_by_budget
from offload_core.runner.job import run

from tests import ROOT


def _tied_llama(seed=0):
    config = LlamaConfig(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


MAP = {
    "model.embed_tokens": "disk",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.norm": "disk",
    "model.rotary_emb": "cpu",
    "lm_head": "disk",
}


@pytest.mark.parametrize("storage", ["pinned_cpu", "memmap"])
@pytest.mark.parametrize("policy", ["align_per_call", "chained", "experts", "functional_call", "prefetch"])
def test_dispatch_then_remove_restores_outputs_and_state_dict(policy, storage, tmp_path):
    reference = _tied_llama()
    expected_state = {k: v.clone() for k, v in reference.state_dict().items()}
    ids = torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(ids).logits
    model = _tied_llama()
    dispatch_model(model, MAP, storage=storage, policy=policy, offload_folder=tmp_path / "off")
    assert model.model.layers[1].mlp.up_proj.weight.device.type == "meta"
    assert model.hf_device_map == MAP
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
    model.offload_state.remove()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    state = model.state_dict()
    assert state.keys() == expected_state.keys()
    assert all(torch.equal(state[k], expected_state[k]) for k in state)
    assert all("forward" not in m.__dict__ for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)


def test_offload_by_budget_follows_vllm_rule():
    model = _tied_llama()
    sizes = [(n, p.numel() * 4) for n, p in model.named_parameters()]
    budget = sizes[0][1] + sizes[1][1] + 1000  # the embedding, q_proj of layer 0, then only small tensors fit
    offloaded = offload_by_budget(model, budget, tier="disk")
    assert "model.embed_tokens.weight" in offloaded and "lm_head.weight" in offloaded  # the tie follows
    spent = sum(size for name, size in sizes if name in offloaded)
    assert spent <= budget
    # Later small parameters that still fit are taken: a module can end up half offloaded.
    assert any(n.endswith("input_layernorm.weight") for n in offloaded)


def _plan_only(tmp_path, *overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(
            config_name="config",
            overrides=[
                "model=synthetic",
                "hook=functional_call",
                "max_memory.cpu=1MiB",
                "plan_only=true",
                "progress=false",
                *overrides,
            ],
        )
    return run(cfg, output_dir=tmp_path)


def test_functional_call_cpu_offload_never_exceeds_the_cpu_budget(tmp_path):
    """Too little offloaded by ``hook.cpu_offload`` leaves more on cpu than its budget: refused in one line naming
    the option and the least value that fits; that value plans within the budget, one byte less does not."""
    from offload_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"hook.cpu_offload to at least (\d+)") as refused:
        _plan_only(tmp_path, "hook.cpu_offload=100KiB")
    message = str(refused.value)
    assert "\n" not in message and "over its" in message and "max_memory.cpu" in message
    least = int(re.search(r"hook.cpu_offload to at least (\d+)", message).group(1))
    result = _plan_only(tmp_path / "fits", f"hook.cpu_offload={least}")
    cpu = result.summary["devices"]["cpu"]
    assert cpu["bytes"] <= cpu["budget"] - result.plan["headroom"]
    with pytest.raises(ConfigError, match="hook.cpu_offload"):
        _plan_only(tmp_path / "short", f"hook.cpu_offload={least - 1}")


@pytest.mark.slow  # a whole run
def test_functional_call_cpu_offload_budget_through_the_runner(tmp_path):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(
            config_name="config",
            overrides=[
                "model=synthetic",
                "hook=functional_call",
                "hook.cpu_offload=300KiB",
                "max_new_tokens=4",
                "progress=false",
                "compare_in_memory=true",
            ],
        )
    result = run(cfg, output_dir=tmp_path)
    assert result.matches_in_memory is True
    assert 0 < result.figures["offloaded_bytes"] <= 300 * 1024
    # Half-offloaded modules: some of a layer's parameters offloaded, others resident.
    layer0 = {k: v for k, v in result.device_map.items() if k.startswith("model.layers.0.")}
    assert len(set(layer0.values())) == 2, layer0


def test_align_hook_places_submodules_and_moves_inputs():
    """On a CPU machine the meta device stands in for a second device: tensors and inputs both go there."""
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    handle = add_hook_to_module(block, AlignDevicesHook("meta", place_submodules=True, io_same_device=False))
    assert all(p.device.type == "meta" for p in block.parameters())
    out = block(torch.randn(3, 4))
    assert out.device.type == "meta" and out.shape == (3, 2)
    handle.remove()
    only_own = torch.nn.Sequential(torch.nn.Linear(4, 4))
    add_hook_to_module(only_own, AlignDevicesHook("meta", place_submodules=False))
    assert all(p.device.type == "cpu" for p in only_own.parameters())  # children move when they run
    remove_hook_from_module(only_own)
