"""Multi-token verification passes under every policy and store: the offloaded model gives the in-memory model's
tokens running the same speculation, bit for bit, and its figures add up (each target pass yields one token of its
own plus the drafted tokens it accepted)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import offload_core
from offload_core.errors import ConfigError
from offload_core.speculative import prepare

from tests.speculative import models

POLICIES = ["align_per_call", "chained", "experts", "functional_call", "prefetch"]
STORES = ["memmap", "pinned_cpu", "safetensors"]
NEW = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative")
    return {
        "target": models.target(root / "target"),
        "draft": models.draft(root / "draft"),
        "mixtral": models.mixtral(root / "mixtral"),
    }


def _spec(mode, checkpoints):
    """The speculation of ``mode``; drafting never stops (random weights accept few drafts: every pass checks some)."""
    spec = {
        "prompt_lookup": {"name": "prompt_lookup", "tokens": 4},
        "self": {"name": "self", "layers": 1, "tokens": 3},
        "draft": {"name": "draft", "path": str(checkpoints["draft"]), "tokens": 3},
        "same_draft": {"name": "draft", "path": str(checkpoints["target"]), "tokens": 3},
    }[mode]
    return {**spec, "min_acceptance": 0.0}


def _in_memory(path, spec=None, device="cpu", replay=None):
    model = AutoModelForCausalLM.from_pretrained(path).eval().to(device)
    speculation = prepare(spec, model, replay=replay)
    with torch.inference_mode():
        out = speculation.generate(models.PROMPT.to(device), max_new_tokens=NEW, do_sample=False)
    return out[0, models.PROMPT.shape[1] :].tolist(), speculation


def _offloaded(path, spec, policy, storage, device_map, tmp_path, device="cpu"):
    model = offload_core.from_pretrained(
        path,
        offload={
            "device_map": device_map,
            "storage": storage,
            "policy": policy,
            "offload_folder": tmp_path / "off",
            "speculative": spec,
            "execution_device": device,
        },
    )
    try:
        with torch.inference_mode():
            out = model.speculation.generate(models.PROMPT.to(device), max_new_tokens=NEW, do_sample=False)
        return out[0, models.PROMPT.shape[1] :].tolist(), model.speculation
    finally:
        model.offload_state.remove()


def _check(path, spec, policy, storage, device_map, tmp_path, device="cpu"):
    tokens, speculation = _offloaded(path, spec, policy, storage, device_map, tmp_path, device)
    figures = speculation.figures(len(tokens))
    # the drafts the offloaded run checked (decided by the passes it timed) checked again in memory
    expected, reference = _in_memory(path, spec, device, replay=figures["draft_decisions"])
    assert tokens == expected
    assert figures == reference.figures(len(expected))
    assert figures["target_passes"] + figures["accepted_tokens"] == len(tokens) == NEW
    assert figures["accepted_tokens"] <= figures["drafted_tokens"]
    return figures


@pytest.mark.parametrize(
    "mode, policy, storage",
    [
        ("prompt_lookup", "align_per_call", "memmap"),
        ("self", "prefetch", "safetensors"),
        ("draft", "chained", "pinned_cpu"),
    ],
)
def test_each_mode_matches_memory_with_the_same_speculation(checkpoints, tmp_path, mode, policy, storage):
    device_map = models.SELF_MAP if mode == "self" else models.STREAM_MAP
    _check(checkpoints["target"], _spec(mode, checkpoints), policy, storage, device_map, tmp_path)


MODES = ["prompt_lookup", "self", "draft"]
#: every mode x policy, the store turning with them so that each meets every store (a store serves a verification pass
#: of several tokens as it serves any pass; every store x policy is checked bit for bit in
#: tests/loading/test_transformers_checkpoints.py)
MODE_POLICY_STORE = [
    (mode, policy, STORES[(i + j) % len(STORES)]) for i, mode in enumerate(MODES) for j, policy in enumerate(POLICIES)
]


@pytest.mark.slow  # 3 modes x 5 policies of a tiny model
@pytest.mark.parametrize("mode, policy, storage", MODE_POLICY_STORE)
def test_every_policy_and_store_verifies_several_tokens_per_pass(checkpoints, tmp_path, mode, policy, storage):
    device_map = models.SELF_MAP if mode == "self" else models.STREAM_MAP
    _check(checkpoints["target"], _spec(mode, checkpoints), policy, storage, device_map, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["align_per_call", "prefetch"])
@pytest.mark.parametrize("mode", ["prompt_lookup", "self", "draft"])
def test_on_a_gpu_offloaded_parts_stream_from_cpu_and_disk(checkpoints, tmp_path, mode, policy):
    # the cpu entries of the cpu maps go on the GPU; the disk ones stream, from disk for self and from the cpu otherwise
    device_map = {
        k: 0 if v == "cpu" else ("disk" if mode == "self" else "cpu")
        for k, v in (models.SELF_MAP if mode == "self" else models.STREAM_MAP).items()
    }
    _check(checkpoints["target"], _spec(mode, checkpoints), policy, "pinned_cpu", device_map, tmp_path, "cuda:0")


def test_prompt_lookup_and_a_perfect_draft_check_several_tokens_per_pass(checkpoints, tmp_path):
    lookup = _check(
        checkpoints["target"],
        _spec("prompt_lookup", checkpoints),
        "prefetch",
        "memmap",
        models.STREAM_MAP,
        tmp_path / "a",
    )
    assert lookup["drafted_tokens"] > 0
    # the target as its own draft: greedy drafts are the target's own tokens, so (almost) every one is accepted
    same = _check(
        checkpoints["target"],
        _spec("same_draft", checkpoints),
        "align_per_call",
        "memmap",
        models.STREAM_MAP,
        tmp_path / "b",
    )
    assert same["tokens_per_pass"] >= 2.0 and same["acceptance_rate"] >= 0.6


@pytest.mark.parametrize("policy", ["experts", "prefetch"])
def test_moe_verification_routes_the_union_of_experts(checkpoints, tmp_path, policy):
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "disk",
        "model.layers.1": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    figures = _check(
        checkpoints["mixtral"], _spec("prompt_lookup", checkpoints), policy, "safetensors", device_map, tmp_path
    )
    assert figures["target_passes"] <= NEW


def test_sampling_keeps_the_in_memory_draws(checkpoints, tmp_path):
    spec = _spec("self", checkpoints)
    model = AutoModelForCausalLM.from_pretrained(checkpoints["target"]).eval()
    torch.manual_seed(5)
    with torch.inference_mode():
        expected = prepare(spec, model).generate(models.PROMPT, max_new_tokens=NEW, do_sample=True, top_k=0)
    offloaded = offload_core.from_pretrained(
        checkpoints["target"],
        offload={"device_map": models.SELF_MAP, "speculative": spec, "offload_folder": tmp_path / "off"},
    )
    torch.manual_seed(5)
    with torch.inference_mode():
        assert torch.equal(
            offloaded.speculation.generate(models.PROMPT, max_new_tokens=NEW, do_sample=True, top_k=0), expected
        )


def test_a_self_draft_whose_layers_are_offloaded_is_one_line(checkpoints, tmp_path):
    with pytest.raises(ConfigError) as caught:
        offload_core.from_pretrained(
            checkpoints["target"],
            offload={
                "device_map": models.STREAM_MAP,
                "offload_folder": tmp_path / "off",
                "speculative": {"name": "self", "layers": 1},
            },
        )
    assert "offloads model.embed_tokens (disk)" in str(caught.value) and "\n" not in str(caught.value)


def test_a_draft_larger_than_the_budget_is_one_line(checkpoints, tmp_path):
    with pytest.raises(ConfigError) as caught:
        offload_core.from_pretrained(
            checkpoints["target"],
            offload={
                "offload_folder": tmp_path / "off",
                "speculative": {"name": "draft", "path": str(checkpoints["draft"])},
                "headroom": 0,
            },
            max_memory={"cpu": "20KiB"},
        )
    assert (
        "needs" in str(caught.value) and "raise max_memory.cpu" in str(caught.value) and "\n" not in str(caught.value)
    )
