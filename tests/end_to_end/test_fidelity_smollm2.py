"""The fidelity matrix on the embedded model: SmolLM2 with a budget below its size, every placement × store × policy."""

from __future__ import annotations

import itertools

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


@pytest.mark.parametrize("placement,store,policy", list(itertools.product(PLACEMENTS, STORES, POLICIES)))
def test_smollm2_matrix(reference, folders, placement, store, policy):
    path, ids, ref_logits, ref_tokens = reference
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
    state = model.offload_state
    try:
        assert state.offloaded_bytes() > 200 * 2**20
        out = _generate(model, ids)
        assert torch.equal(out.sequences, ref_tokens)
        assert len(out.logits) == len(ref_logits) and all(torch.equal(a, b) for a, b in zip(out.logits, ref_logits))
    finally:
        state.remove()
