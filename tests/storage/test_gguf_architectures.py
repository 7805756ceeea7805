"""GGUF files of more architectures than llama's: qwen3, phi3 with its fused projections, gemma2 and gemma3 with their
norms shifted by one and their embedding tied to the LM head, starcoder2 and stablelm with biased layer norms, mistral
(a llama file by its name), bloom's regrouped q/k/v, falcon's and bloom's head written twice, nemotron's shifted norms,
mamba's state-space layers and minimax-m2's experts: read in place by storage=gguf, part of the model offloaded, and
converted once by the default store (with gpt2's transposed projections and lfm2's, which transformers loads through
its own GGUF path: refused in place in one line), and t5's and umt5's encoder-decoders, each gives transformers'
own in-memory GGUF model's logits and tokens."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

import offload_core
from offload_core.errors import CheckpointError
from tests.gguf_files import ARCHS, half_offloaded_map, transformers_model, write_gguf
from tests.outputs import assert_same_outputs

pytestmark = pytest.mark.slow

IDS = torch.tensor([[256, 5, 77, 100, 258, 259, 33, 40]])
LAYERS = 2
#: read in place (the first six: also read as they were before; their conversion is gemma2's below)
IN_PLACE = [
    *("qwen3", "phi3", "gemma2", "gemma3", "starcoder2", "stablelm"),
    *("mistral", "bloom", "falcon", "nemotron", "mamba", "minimax_m2"),
]
#: transformers changes their tensors as it loads them in ways this reader does not: converted only, and why
CONVERTED_ONLY = {"gpt2": "changes the layout of its tensors as it loads", "lfm2": "loads it through its own GGUF path"}


def _types(arch: str) -> tuple[dict[str, int], int]:
    """The GGML types of ``arch``'s file: K-quants and Q8_0 beside a default one (lfm2's, which transformers reads
    through its own GGUF path: a type that path dequantizes)."""
    return {"attn_output": int(T.Q4_K), "ffn_down": int(T.Q8_0)}, int(T.Q4_0 if arch == "lfm2" else T.Q5_0)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``arch`` -> its tiny GGUF file and transformers' in-memory model of it (each built once)."""
    found = {}

    def build(arch: str):
        if arch not in found:
            types, default = _types(arch)
            path = write_gguf(tmp_path_factory.mktemp(f"gguf-{arch}") / "model.gguf", arch, types, default, LAYERS)
            found[arch] = path, transformers_model(path)
        return found[arch]

    return build


def _same(model, reference):
    try:
        assert "disk" in set(model.hf_device_map.values())
        assert_same_outputs(model, reference, IDS)
    finally:
        model.offload_state.release()


@pytest.mark.parametrize("arch", IN_PLACE)
def test_the_architecture_read_in_place_is_transformers_in_memory_model(arch, built, tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    path, reference = built(arch)
    offload = {
        "storage": "gguf",
        "policy": "prefetch",
        "device_map": half_offloaded_map(LAYERS, arch),
        "over_budget": "warn",
    }
    model = offload_core.from_pretrained(path, {"cpu": "3MiB"}, offload)
    assert type(model.offload_state.store).__name__ == "GGUFStore"
    _same(model, reference)


@pytest.mark.parametrize("arch", [*IN_PLACE[6:], *CONVERTED_ONLY])
def test_the_architecture_converted_once_is_transformers_in_memory_model(arch, built, tmp_path, monkeypatch):
    """The default store converts the file (transformers' own GGUF load, written as float32 safetensors)."""
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    path, reference = built(arch)
    offload = {"policy": "align_per_call", "device_map": half_offloaded_map(LAYERS, arch), "over_budget": "warn"}
    model = offload_core.from_pretrained(path, {"cpu": "3MiB"}, offload)
    assert type(model.offload_state.store).__name__ != "GGUFStore"
    _same(model, reference)


@pytest.mark.parametrize("arch", CONVERTED_ONLY)
def test_an_architecture_transformers_changes_as_it_loads_is_refused_in_place_in_one_line(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    types, default = _types(arch)
    path = write_gguf(tmp_path / "model.gguf", arch, types, default, LAYERS)
    with pytest.raises(CheckpointError) as error:
        offload_core.from_pretrained(path, {"cpu": "3MiB"}, {"storage": "gguf", "over_budget": "warn"})
    message = str(error.value)
    assert "\n" not in message and str(path) in message and CONVERTED_ONLY[arch] in message
    assert "leave storage at its default" in message


@pytest.mark.parametrize("arch", ["t5", "umt5"])
def test_t5_read_in_place_and_converted_is_transformers_in_memory_encoder_decoder(arch, tmp_path, monkeypatch):
    """A T5 (or UMT5) file, an encoder-decoder: transformers' ``AutoModelForSeq2SeqLM`` of it, its layers offloaded
    by the placement under a small budget, read in place and converted once."""
    from transformers import AutoModelForSeq2SeqLM

    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "t5.gguf", arch, {"attn_o": int(T.Q4_K)}, default=int(T.Q5_0), layers=LAYERS)
    reference = AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path), gguf_file=path.name).eval()
    assert type(reference).__name__ == ARCHS[arch].model
    decoded = torch.tensor([[0, 5, 9, 77]])
    for storage in ("gguf", None):
        offload = {"over_budget": "warn", **({"storage": storage} if storage else {})}
        model = offload_core.from_pretrained(path, {"cpu": "1MiB"}, offload)
        try:
            assert type(model).__name__ == ARCHS[arch].model and "disk" in model.hf_device_map.values()
            with torch.no_grad():
                got = model(input_ids=IDS, decoder_input_ids=decoded).logits
                assert torch.equal(got, reference(input_ids=IDS, decoder_input_ids=decoded).logits)
                want = reference.generate(IDS, max_new_tokens=4, do_sample=False)
                assert torch.equal(model.generate(IDS, max_new_tokens=4, do_sample=False), want)
        finally:
            model.offload_state.release()


def test_a_tied_head_converted_once_is_transformers_in_memory_model(tmp_path, monkeypatch):
    """The default store converts the file (transformers' own GGUF load, written as safetensors): gemma2's LM head
    tied to its embedding, which the file holds once."""
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "gemma2.gguf", "gemma2", default=int(T.Q8_0), layers=LAYERS)
    offload = {"policy": "align_per_call", "device_map": half_offloaded_map(LAYERS), "over_budget": "warn"}
    _same(offload_core.from_pretrained(path, {"cpu": "3MiB"}, offload), transformers_model(path))
