"""GGUF files of more architectures than llama's (qwen3, phi3 with its fused projections, gemma2 and gemma3 with their
norms shifted by one and their embedding tied to the LM head, starcoder2 and stablelm with biased layer norms): read
in place by storage=gguf and converted once by the default store, part of the model offloaded, each gives
transformers' own in-memory GGUF model's logits and tokens."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

import offload_core
from tests.gguf_files import half_offloaded_map, transformers_model, write_gguf

IDS = torch.tensor([[256, 5, 77, 100, 258, 259, 33, 40]])
LAYERS = 2


@pytest.fixture(scope="module", params=["qwen3", "phi3", "gemma2", "gemma3", "starcoder2", "stablelm"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"gguf-{request.param}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OFFLOAD_CORE_CACHE", str(folder / "cache"))
        types = {"attn_output": int(T.Q4_K), "ffn_down": int(T.Q8_0)}
        path = write_gguf(folder / "model.gguf", request.param, types, default=int(T.Q5_0), layers=LAYERS)
        yield path, transformers_model(path)


@pytest.mark.parametrize(("storage", "policy"), [("gguf", "prefetch"), (None, "align_per_call")])
def test_the_architecture_offloaded_is_transformers_in_memory_model(tiny, storage, policy):
    path, reference = tiny
    offload = {"policy": policy, "device_map": half_offloaded_map(LAYERS), "over_budget": "warn"}
    model = offload_core.from_pretrained(
        path, {"cpu": "3MiB"}, {**offload, **({"storage": storage} if storage else {})}
    )
    try:
        assert "disk" in set(model.hf_device_map.values())
        assert model.offload_state.store.__class__.__name__.startswith("GGUF") == (storage == "gguf")
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, reference(IDS).logits)
            want = reference.generate(IDS, max_new_tokens=4, do_sample=False)
            assert torch.equal(model.generate(IDS, max_new_tokens=4, do_sample=False), want)
    finally:
        model.offload_state.release()
