"""On a real GPU: a bitsandbytes 4-bit (and 8-bit) checkpoint that does not fit the GPU's budget, which
transformers' ``device_map`` offloading refuses, runs with part of it streamed packed from host memory, and gives the
logits and tokens of transformers' in-memory model of the same checkpoint on that GPU; a torchao int8 one too."""

from __future__ import annotations

import pytest
import torch
import transformers

import offload_core
from offload_core.loading.checkpoint import Checkpoint
from tests.quantized_checkpoints import quantized_folder
from tests.gpu_budgets import on_gpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

IDS = torch.tensor([[1, 5, 9, 17, 33, 2, 70]])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("quantized-gpu")


@pytest.mark.parametrize("storage", ["pinned_cpu", "safetensors"])
@pytest.mark.parametrize("method", ["bnb-nf4", "bnb-int8", "torchao-int8"])
def test_a_quantized_model_larger_than_the_gpu_budget_runs_packed_as_in_memory(root, method, storage):
    folder = quantized_folder(root, method)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, device_map={"": 0})
    ids = IDS.to("cuda:0")
    with torch.inference_mode():
        logits = reference(ids).logits
        tokens = reference.generate(ids, max_new_tokens=4, do_sample=False)
    del reference
    with Checkpoint.open(folder) as checkpoint:
        half = checkpoint.total_bytes() // 2
    if method.startswith("bnb"):  # the peer's refusal this case is about
        with pytest.raises(ValueError, match="dispatched on the CPU or the disk"):
            transformers.AutoModelForCausalLM.from_pretrained(
                folder, device_map="auto", max_memory={0: half, "cpu": 2**30}
            )
    # half the packed model, and room for the generation, one block and the units prefetch holds in flight (about
    # 150 kB on this model), less the quarter of it the plan holds back for the runtime
    budget = on_gpu((half + 160_000) * 4 // 3)
    model = offload_core.from_pretrained(
        folder,
        offload={"storage": storage, "policy": "prefetch", "progress": False},
        max_memory={0: budget, "cpu": 2**30},
    )
    assert "cpu" in set(model.offload_plan.device_map.values())  # part of it streams from host memory
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, logits)
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), tokens)
