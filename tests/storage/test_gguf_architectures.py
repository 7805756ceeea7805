"""GGUF files of more architectures than llama's (qwen3, phi3 with its fused projections, gemma2 and gemma3 with their
norms shifted by one and their embedding tied to the LM head, starcoder2 and stablelm with biased layer norms): read
in place by storage=gguf (and gemma2's converted once by the default store), part of the model offloaded, each gives
transformers' own in-memory GGUF model's logits and tokens."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

import offload_core
from tests.gguf_files import half_offloaded_map, transformers_model, write_gguf

pytestmark = pytest.mark.slow

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


def _same(model, reference):
    try:
        assert "disk" in set(model.hf_device_map.values())
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, reference(IDS).logits)
            want = reference.generate(IDS, max_new_tokens=4, do_sample=False)
            assert torch.equal(model.generate(IDS, max_new_tokens=4, do_sample=False), want)
    finally:
        model.offload_state.release()


def test_the_architecture_read_in_place_is_transformers_in_memory_model(tiny):
    path, reference = tiny
    offload = {"storage": "gguf", "policy": "prefetch", "device_map": half_offloaded_map(LAYERS), "over_budget": "warn"}
    model = offload_core.from_pretrained(path, {"cpu": "3MiB"}, offload)
    assert type(model.offload_state.store).__name__ == "GGUFStore"
    _same(model, reference)


def test_a_tied_head_converted_once_is_transformers_in_memory_model(tmp_path, monkeypatch):
    """The default store converts the file (transformers' own GGUF load, written as safetensors): gemma2's LM head
    tied to its embedding, which the file holds once."""
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "gemma2.gguf", "gemma2", default=int(T.Q8_0), layers=LAYERS)
    offload = {"policy": "align_per_call", "device_map": half_offloaded_map(LAYERS), "over_budget": "warn"}
    _same(offload_core.from_pretrained(path, {"cpu": "3MiB"}, offload), transformers_model(path))
