"""A policy that reads the routed experts only (``experts``) gets a map that keeps the weights read whole every token
where the run computes before any expert: fewer bytes read per token, within the same budgets, and the same logits."""

from __future__ import annotations

import pytest
import torch

from offload_core import from_pretrained, init_empty_weights
from offload_core.module_hooks.experts import Experts, ExpertsConfig
from offload_core.planning import compute_module_sizes, device_of, infer_auto_device_map, summarize_device_map
from offload_core.planning.shares import redeal_by_reads
from offload_core.runner.job import run


def _meta(saved):
    moe = saved("mixtral")
    with init_empty_weights():
        return moe.auto.from_config(moe.config).eval()


def _shares(model):
    """What the ``experts`` policy reads of each expert tensor a token."""
    return Experts(ExpertsConfig()).read_shares(model)


def _is_expert(name: str) -> bool:
    return ".experts." in name


def _read_per_token(model, device_map, computes) -> float:
    sizes, shares = compute_module_sizes(model), _shares(model)
    return sum(
        sizes[name] * shares.get(name, (1.0, 1))[0]
        for name, _ in model.named_parameters()
        if device_of(device_map, name) != computes
    )


def test_a_cpu_run_keeps_every_weight_read_whole_before_any_expert(saved):
    model = _meta(saved)
    sizes = compute_module_sizes(model)
    whole = sum(sizes[name] for name, _ in model.named_parameters() if not _is_expert(name))
    layer = sizes["model.layers.0.mlp.experts"]
    budget = whole + layer + layer // 2  # one layer's experts fit beside the rest, not two
    placed = infer_auto_device_map(model, {"cpu": budget, "disk": 1 << 40}, ["MixtralDecoderLayer"], reserve={})
    shares = _shares(model)
    redeal = redeal_by_reads(model, placed, shares, torch.device("cpu"), {"cpu": budget}, {}, None)
    assert redeal is not None
    mapped = redeal.device_map
    for name, _ in model.named_parameters():
        if not _is_expert(name):
            assert device_of(mapped, name) == "cpu", name
    experts = [name for name, _ in model.named_parameters() if _is_expert(name)]
    kept = [name for name in experts if device_of(mapped, name) == "cpu"]
    # the room left is filled in module order, each expert tensor on its own: all of layer 0's, and then what fits
    assert kept[:2] == ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    used = summarize_device_map(model, mapped)["devices"]["cpu"]["bytes"]
    assert used <= budget
    assert budget - used < min(sizes[name] for name in experts if name not in kept)
    before, after = _read_per_token(model, placed, "cpu"), _read_per_token(model, mapped, "cpu")
    assert redeal.read_before == pytest.approx(before) and redeal.read_after == pytest.approx(after)
    assert after < before
    assert "kept where it computes" in redeal.line()


def test_the_room_held_back_for_units_in_flight_stays_free(saved):
    model = _meta(saved)
    sizes = compute_module_sizes(model)
    budget, held = sizes[""] // 2, sizes[""] // 4
    placed = infer_auto_device_map(
        model, {"cpu": budget, "disk": 1 << 40}, ["MixtralDecoderLayer"], reserve={"cpu": held}
    )
    redeal = redeal_by_reads(model, placed, _shares(model), torch.device("cpu"), {"cpu": budget}, {"cpu": held}, None)
    assert redeal is not None
    assert summarize_device_map(model, redeal.device_map)["devices"]["cpu"]["bytes"] <= budget - held


def test_a_gpu_run_keeps_what_the_placement_put_on_the_gpu_at_most(saved):
    # the computing GPU holds no more than the placement put there (a placement that keeps it low stays low); the
    # weights read whole move up to it first, the experts go to the cpu tier, then the disk (a token reads a tenth
    # of each expert tensor here: many experts, few routed)
    model = _meta(saved)
    sizes = compute_module_sizes(model)
    cpu = sizes[""] // 3
    placed = {
        "model.embed_tokens": 0,
        "model.layers.0": 0,
        "model.layers.1": "cpu",
        "model.layers.2": "disk",
        "model.norm": "disk",
        "model.rotary_emb": "disk",
        "lm_head": "disk",
    }
    shares = {name: (0.1, 2) for name in _shares(model)}
    used = summarize_device_map(model, placed)["devices"][0]["bytes"]
    redeal = redeal_by_reads(model, placed, shares, torch.device("cuda", 0), {0: used * 4, "cpu": cpu}, {}, None)
    assert redeal is not None
    devices = summarize_device_map(model, redeal.device_map)["devices"]
    assert devices[0]["bytes"] <= used and devices["cpu"]["bytes"] <= cpu
    for name, _ in model.named_parameters():
        if not _is_expert(name):
            assert device_of(redeal.device_map, name) == 0, name
    assert redeal.read_after < redeal.read_before


def test_nothing_moves_without_tensors_read_in_part_or_when_nothing_is_gained(saved):
    model = _meta(saved)
    sizes = compute_module_sizes(model)
    placed = infer_auto_device_map(model, {"cpu": sizes[""] // 3, "disk": 1 << 40}, ["MixtralDecoderLayer"])
    assert redeal_by_reads(model, placed, {}, torch.device("cpu"), {"cpu": sizes[""] // 3}, {}, None) is None
    everything = {"": "cpu"}
    assert redeal_by_reads(model, everything, _shares(model), torch.device("cpu"), {"cpu": 1}, {}, None) is None


def test_the_experts_policy_plans_it_and_answers_as_in_memory(saved, compose_run, tmp_path):
    moe = saved("mixtral")
    sizes = compute_module_sizes(_meta(saved))
    budget = sizes[""] // 3
    plans = {}
    for hook in ("experts", "prefetch"):
        overrides = [
            "plan_only=true",
            "model=local",
            "model.tokenizer=bytes",
            f"model.path={moe.path}",
            f"max_memory.cpu={budget}",
            "headroom=0",
            f"hook={hook}",
            "storage=memmap",
            "execution_device=cpu",
            "progress=false",
        ]
        plans[hook] = run(compose_run(overrides), output_dir=tmp_path / hook, plot=False)
    experts, prefetch = plans["experts"], plans["prefetch"]
    assert "kept where it computes" in experts.plan["redealt"] and not prefetch.plan["redealt"]
    assert device_of(experts.device_map, "model.layers.2.self_attn.q_proj.weight") == "cpu"
    assert device_of(prefetch.device_map, "model.layers.2.self_attn.q_proj.weight") == "disk"
    split = {  # an experts module with one tensor kept and the other offloaded: the policy reads only that one
        device_of(experts.device_map, f"model.layers.0.mlp.experts.{name}") for name in ("gate_up_proj", "down_proj")
    }
    assert split == {"cpu", "disk"}
    model = from_pretrained(
        moe.path,
        offload={
            "storage": "memmap",
            "policy": "experts",
            "offload_folder": tmp_path / "off",
            "execution_device": "cpu",
            "headroom": 0,
        },
        max_memory={"cpu": budget},
    )
    try:
        assert model.hf_device_map == experts.device_map
        with torch.no_grad():
            got = model(**moe.inputs).logits
        assert torch.equal(got, moe.expected)
    finally:
        model.offload_state.remove()
