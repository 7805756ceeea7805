"""The expert-granular policy on a GPU: routed experts copied from host memory (pinned) or mapped files to the device,
logits bit-identical to the in-memory model on the same GPU."""

from __future__ import annotations

import pytest
import torch

from offload_core import init_empty_weights, load_checkpoint_and_dispatch
from offload_core.module_hooks.experts import Experts, ExpertsConfig
from offload_core.planning import compute_module_sizes
from tests.checkpoints import Saved

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("store", ["pinned_cpu", "memmap", "safetensors"])
@pytest.mark.parametrize("guess", ["router", "previous"])
def test_experts_policy_on_gpu_bit_identical(store, guess, dtype, tmp_path):
    # bfloat16 is what MoE checkpoints run in, and where transformers' experts take their grouped_mm kernel
    moe = Saved("mixtral", tmp_path / "saved")
    reference = moe.auto.from_pretrained(moe.path, dtype=dtype).eval().to("cuda")
    ids = moe.inputs["input_ids"][:1].cuda()
    with torch.no_grad():
        want = [reference(input_ids=ids).logits, reference(input_ids=ids[:, :1]).logits]
    with init_empty_weights():
        model = moe.auto.from_config(moe.config, dtype=dtype).eval()
    total = compute_module_sizes(model)[""]
    load_checkpoint_and_dispatch(
        model,
        moe.path,
        device_map="sequential",
        max_memory={0: total // 4, "cpu": total // 4},
        storage=store,
        policy=Experts(ExpertsConfig(cache_slots=2, guess=guess)),
        offload_folder=tmp_path / "off",
        execution_device="cuda:0",
        dtype=dtype,
        progress=False,
    )
    with torch.no_grad():
        got = [model(input_ids=ids).logits, model(input_ids=ids[:, :1]).logits, model(input_ids=ids[:, :1]).logits]
    counters = model.offload_state.handle.counters()
    model.offload_state.remove()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[1])
    assert counters["expert_hits"] + counters["expert_guess_hits"] > 0
