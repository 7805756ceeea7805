"""The fidelity matrix on the embedded model: SmolLM2 with a budget below its size, every store × policy on every
distinct device map the placements make (each placement also run once)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from offload_core import init_empty_weights, load_checkpoint_and_dispatch
from offload_core.loading.sources import load_tokenizer, smollm2_checkpoint
from offload_core.registry.manager import get_registry

PLACEMENTS = ["sequential", "balanced", "balanced_low_0"]
STORES = ["pinned_cpu", "memmap", "safetensors"]
POLICIES = ["align_per_call", "chained", "functional_call", "prefetch"]
BUDGET = {"cpu": 160 * 2**20}  # the model is 513 MiB in float32


def _generate(model, ids):
    """Three greedy tokens and the logits of every step (the prompt's last position, then each decoding step)."""
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=3,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )


@pytest.fixture(scope="module")
def reference():
    path = smollm2_checkpoint()
    tok = load_tokenizer(path)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = _generate(model, ids)
    del model
    return path, ids, out.logits, out.sequences


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tmp_path_factory.mktemp("smollm2_offload")


def _dispatch(path, folders, placement: str, store: str, policy: str):
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32).eval()
    load_checkpoint_and_dispatch(
        model,
        path,
        device_map=placement,
        max_memory=BUDGET,
        storage=store,
        policy=get_registry().create("policy", policy),
        offload_folder=folders / "memmap",
        reserve={"cpu": 0},
        progress=False,
    )
    return model


def _check(model, reference) -> None:
    _, ids, ref_logits, ref_tokens = reference
    state = model.offload_state
    try:
        assert state.offloaded_bytes() > 200 * 2**20
        out = _generate(model, ids)
        assert torch.equal(out.sequences, ref_tokens)
        assert len(out.logits) == len(ref_logits) and all(torch.equal(a, b) for a, b in zip(out.logits, ref_logits))
    finally:
        state.remove()


@pytest.fixture(scope="module")
def placed(reference, folders) -> dict[str, dict]:
    """Each placement's device map, each checked once end to end (safetensors, align_per_call)."""
    maps = {}
    for placement in PLACEMENTS:
        model = _dispatch(reference[0], folders, placement, "safetensors", "align_per_call")
        maps[placement] = dict(model.hf_device_map)
        _check(model, reference)
    return maps


@pytest.mark.parametrize("store,policy", list(itertools.product(STORES, POLICIES)))
def test_smollm2_matrix(reference, folders, placed, store, policy):
    """Every store x policy on each distinct device map the placements make (placements that make the same map, as
    all three do on a machine without a GPU, differ in nothing the dispatch then does: the map is checked equal)."""
    distinct: dict[str, str] = {}
    for placement, device_map in placed.items():
        distinct.setdefault(json.dumps(device_map, sort_keys=True), placement)
    for device_map, placement in distinct.items():
        model = _dispatch(reference[0], folders, placement, store, policy)
        assert json.dumps(dict(model.hf_device_map), sort_keys=True) == device_map, placement
        _check(model, reference)
