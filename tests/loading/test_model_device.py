"""A dispatched model reports the device it runs on, as the in-memory model does, even when its first weight is
offloaded: ``generate`` then takes the same decisions (a Mixture-of-Experts model keeps its experts' kernel)."""

from __future__ import annotations

from functools import lru_cache
from itertools import product

import pytest
import torch
from torch import nn

import offload_core
from offload_core import load_checkpoint_and_dispatch
from tests.checkpoints import POLICIES, STORES, Saved


def _generate(model: nn.Module, moe: Saved) -> tuple[torch.Tensor, list[torch.Tensor], set[str]]:
    """Greedy tokens, each step's logits, and the experts implementations the experts modules ran with."""
    seen: set[str] = set()
    handles = [
        module.register_forward_pre_hook(lambda mod, args: seen.add(mod.config._experts_implementation))
        for name, module in model.named_modules()
        if name.endswith("mlp.experts")
    ]
    ids = moe.inputs["input_ids"]
    start = {"decoder_start_token_id": 0} if model.config.is_encoder_decoder else {}
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
            **start,
        )
    for handle in handles:
        handle.remove()
    return out.sequences, list(out.logits), seen


@lru_cache(maxsize=None)
def _reference(moe: Saved) -> tuple[type, torch.Tensor, list[torch.Tensor], set[str]]:
    """The in-memory model's class and generation (one per tiny model, shared by the tests)."""
    reference = moe.auto.from_pretrained(moe.path).eval()
    return (type(reference), *_generate(reference, moe))


def _matrix(*axes: list[str]) -> list:
    """Every combination of ``axes``; all but the first marked slow (the quick subset keeps one)."""
    combos = list(product(*axes))
    return [pytest.param(*combo, marks=() if i == 0 else pytest.mark.slow) for i, combo in enumerate(combos)]


@pytest.mark.parametrize("policy,store", _matrix(POLICIES, STORES))
def test_fully_offloaded_moe_generates_as_in_memory(saved, policy, store, tmp_path):
    """Every step's logits bit for bit, under ``inference_mode`` as ``generate`` runs; then a plain call."""
    moe = saved("mixtral")
    cls, want_tokens, want_logits, want_impl = _reference(moe)
    model = offload_core.from_pretrained(
        moe.path,
        offload={
            "device_map": {"": "disk"},
            "storage": store,
            "policy": policy,
            "offload_folder": tmp_path / "off",
            "execution_device": "cpu",
        },
    )
    assert next(model.parameters()).device.type == "meta"
    assert model.device == torch.device("cpu")
    tokens, logits, impl = _generate(model, moe)
    assert impl == want_impl == {"grouped_mm"}
    assert torch.equal(tokens, want_tokens)
    for step, (got, want) in enumerate(zip(logits, want_logits)):
        assert torch.equal(got, want), f"step {step}: {(got - want).abs().max()}"
    with torch.no_grad():  # the weights read under inference_mode are usable outside it
        assert torch.equal(model(**moe.inputs).logits, moe.expected)
    model.offload_state.remove()
    assert type(model) is cls
    assert model.device == torch.device("cpu")


@pytest.mark.parametrize("policy,name", _matrix(POLICIES, ["llama", "gpt2", "gemma3", "qwen2_moe", "t5"]))
def test_generation_steps_are_bit_identical(saved, name, policy, tmp_path):
    moe = saved(name)
    _, want_tokens, want_logits, _ = _reference(moe)
    model = offload_core.from_pretrained(
        moe.path,
        offload={"device_map": {"": "disk"}, "storage": "safetensors", "policy": policy, "execution_device": "cpu"},
    )
    tokens, logits, _ = _generate(model, moe)
    model.offload_state.remove()
    assert torch.equal(tokens, want_tokens)
    for step, (got, want) in enumerate(zip(logits, want_logits)):
        assert torch.equal(got, want), f"step {step}: {(got - want).abs().max()}"


def test_a_model_with_a_resident_first_weight_reports_that_weight_s_device(saved, tmp_path):
    moe = saved("mixtral")
    model = offload_core.from_pretrained(
        moe.path,
        offload={
            "device_map": {
                "model.embed_tokens": "cpu",
                "model.layers": "disk",
                "model.norm": "disk",
                "lm_head": "disk",
            },
            "storage": "memmap",
            "offload_folder": tmp_path / "off",
            "execution_device": "cpu",
        },
    )
    assert model.device == torch.device("cpu")
    model.offload_state.remove()


def test_a_plain_module_keeps_its_class(tmp_path):
    from safetensors.torch import save_file

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    load_checkpoint_and_dispatch(
        model, tmp_path, device_map={"": "disk"}, storage="safetensors", execution_device="cpu", progress=False
    )
    assert type(model) is nn.Sequential
    assert model(torch.ones(1, 4)).shape == (1, 2)
    model.offload_state.remove()


def test_weights_resting_on_the_cpu_report_the_device_they_run_on(saved, fake_gpu):
    """A fake GPU stands in for a real one on every machine (``-m gpu`` runs a real one in tests/gpu)."""
    moe = saved("mixtral")
    device = fake_gpu().device(0)
    model = offload_core.from_pretrained(
        moe.path, offload={"device_map": {"": "cpu"}, "storage": "pinned_cpu", "execution_device": device}
    )
    try:
        assert model.device == device
        assert {p.device.type for p in model.parameters()} <= {"cpu", "meta"}  # resting off the GPU, not moved ahead
    finally:
        model.offload_state.remove()
