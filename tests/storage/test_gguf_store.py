"""storage=gguf: tiny llama and qwen2 GGUF files (several tensor types) read in place with part of the model offloaded
give transformers' own in-memory GGUF model's logits and tokens bit for bit, under align_per_call and prefetch; the
other stores get the file converted; the plan and the counters count the quantized bytes."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

import offload_core
import offload_core.registry.manager
from offload_core.loading.checkpoint import Checkpoint
from tests.gguf_files import half_offloaded_map, transformers_model, write_gguf

TYPES = {
    "ffn_down": int(T.Q4_K),
    "ffn_up": int(T.Q8_0),
    "ffn_gate": int(T.Q5_0),
    "attn_v": int(T.Q6_K),
    "attn_output": int(T.Q5_K),
    "attn_k": int(T.Q4_0),
    "token_embd": int(T.F16),
    "output.weight": int(T.Q8_0),
}
IDS = torch.tensor([[256, 5, 77, 100, 258, 259, 33, 40]])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OFFLOAD_CORE_CACHE", str(folder / "cache"))
        built = {
            "llama": write_gguf(folder / "llama.gguf", "llama", TYPES, default=int(T.Q4_1)),
            "qwen2": write_gguf(folder / "qwen2.gguf", "qwen2", TYPES, default=int(T.Q5_1)),
        }
        yield {arch: (path, transformers_model(path)) for arch, path in built.items()}


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("resident", ["dequantized", "quantized"])
@pytest.mark.parametrize("policy", ["align_per_call", "prefetch"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_offloaded_gguf_is_transformers_in_memory_model_bit_for_bit(files, arch, policy, resident):
    path, reference = files[arch]
    storage = offload_core.registry.manager.get_registry().create("storage", "gguf", {"resident": resident})
    offload = {"storage": storage, "policy": policy, "device_map": half_offloaded_map(), "over_budget": "warn"}
    model = offload_core.from_pretrained(path, {"cpu": "3MiB"}, offload)
    try:
        assert {"cpu", "disk"} <= set(model.hf_device_map.values())  # part resident, part read from the file or held
        assert (model.offload_state.store.held_nbytes() > 0) == (resident == "quantized")
        assert torch.equal(_logits(model), _logits(reference))
        with torch.no_grad():
            want = reference.generate(IDS, max_new_tokens=4, do_sample=False)
            got = model.generate(IDS, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, want)
    finally:
        model.offload_state.release()


def test_a_gguf_without_its_suffix_as_ollama_keeps_it_runs(files, tmp_path, monkeypatch):
    """Ollama keeps a model as ``blobs/sha256-<digest>``: a file that opens as a GGUF is one, whatever its name."""
    path, reference = files["llama"]
    blob = tmp_path / "blobs" / "sha256-6a0746a1ec1a"
    blob.parent.mkdir()
    blob.write_bytes(path.read_bytes())
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    model = offload_core.from_pretrained(blob, {"cpu": "1MiB"}, {"storage": "gguf", "over_budget": "warn"})
    try:
        assert torch.equal(_logits(model), _logits(reference))
    finally:
        model.offload_state.release()


def test_a_folder_holding_the_file_and_the_default_store(files, tmp_path, monkeypatch):
    """A folder holding one GGUF plans as the file; the default store gets it converted once (float32 safetensors)
    and gives the same logits."""
    path, reference = files["qwen2"]
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / path.name).symlink_to(path)
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    in_place = offload_core.from_pretrained(
        folder, offload={"storage": "gguf", "headroom": 0, "over_budget": "warn"}, max_memory={"cpu": "1MiB"}
    )
    converted = offload_core.from_pretrained(
        folder, offload={"headroom": 0, "over_budget": "warn"}, max_memory={"cpu": "1MiB"}
    )
    try:
        assert torch.equal(_logits(in_place), _logits(reference))
        assert torch.equal(_logits(converted), _logits(reference))
        assert list((tmp_path / "cache").glob("gguf-f32-*/*.safetensors"))  # the default store's conversion
    finally:
        in_place.offload_state.release()
        converted.offload_state.release()


def test_bytes_moved_are_the_quantized_blocks(files):
    path, _ = files["llama"]
    model = offload_core.from_pretrained(
        path, offload={"storage": "gguf", "headroom": 0, "over_budget": "warn"}, max_memory={"cpu": "1MiB"}
    )
    try:
        with Checkpoint.open(path) as checkpoint:
            offloaded = [k for k in checkpoint.keys() if k in model.offload_state.store]
            quantized = sum(checkpoint.stored_nbytes(k) for k in offloaded)
            dequantized = sum(checkpoint.nbytes(k) for k in offloaded)
        assert offloaded and quantized * 3 < dequantized
        assert model.offload_plan.predicted_bytes_per_token == quantized
        stats = model.offload_state.stats
        stats.reset()
        _logits(model, IDS[:, :1])
        assert stats.bytes == quantized
        lines = "\n".join(model.offload_plan.conversion)
        assert "read quantized in place" in lines and "Q4_K x3" in lines
    finally:
        model.offload_state.release()


def test_checkpoint_tensors_are_transformers_tensors(files):
    path, reference = files["llama"]
    state = reference.state_dict()
    with Checkpoint.open(path) as checkpoint:
        assert checkpoint.is_gguf
        for key in checkpoint.keys():
            assert torch.equal(checkpoint.get(key), state[key]), key
            out = torch.empty(checkpoint.shape(key))
            checkpoint.read_into(key, out)
            assert torch.equal(out, state[key]), key


def test_the_store_round_trip(files):
    """What the store contract asks of every store, on a GGUF file: every tensor handed back as transformers holds it
    (``store[name]`` and into a caller's buffer), its spec from the header, nothing written, ``put`` refused."""
    from offload_core.errors import OffloadError
    from offload_core.storage import StoreContext

    path, reference = files["qwen2"]
    state = reference.state_dict()
    storage = offload_core.registry.manager.get_registry().create("storage", "gguf")
    with Checkpoint.open(path) as checkpoint:
        store = storage.open(StoreContext(names=checkpoint.keys(), checkpoint=checkpoint))
        for key in checkpoint.keys():
            store.add_from_checkpoint(key, checkpoint, key, None)
        store.finalize()
        assert set(store) == set(checkpoint.keys()) and store.bytes_written == 0
        for key in store:
            shape, dtype = store.spec(key)
            assert (shape, dtype) == (state[key].shape, state[key].dtype)
            assert torch.equal(store[key], state[key]), key
            buffer = torch.empty(shape, dtype=dtype)
            store.read_into(key, buffer)
            assert torch.equal(buffer, state[key]), key
            assert store.moved_nbytes(key) == checkpoint.stored_nbytes(key)
        with pytest.raises(OffloadError, match="only reads the GGUF file"):
            store.put("extra", torch.zeros(2))
        store.close()
