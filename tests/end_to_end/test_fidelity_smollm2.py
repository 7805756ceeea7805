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


@pytest.fixture(scope="module")
def reference():
    path = smollm2_checkpoint()
    tok = load_tokenizer(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    del model
    return path, ids, logits, tokens


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tmp_path_factory.mktemp("smollm2_offload")


@pytest.mark.parametrize("placement,store,policy", list(itertools.product(PLACEMENTS, STORES, POLICIES)))
def test_smollm2_matrix(reference, folders, placement, store, policy):
    path, ids, ref_logits, ref_tokens = reference
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32).eval()
    load_checkpoint_and_dispatch(model, path, device_map=placement, max_memory=BUDGET, storage=store,
                                 policy=get_registry().create("policy", policy), offload_folder=folders / "memmap",
                                 reserve={"cpu": 0}, progress=False)
    state = model.offload_state
    try:
        assert state.offloaded_bytes() > 200 * 2**20
        with torch.no_grad():
            logits = model(ids).logits
            tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
        assert torch.equal(logits, ref_logits)
        assert torch.equal(tokens, ref_tokens)
    finally:
        state.remove()
