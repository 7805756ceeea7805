"""``storage=pinned_cpu storage.codec=exponent`` on the fake GPU: bf16 weights held packed, copied packed through
``hook=prefetch`` and decoded on the device's side stream (hazards checked), with the same logits and tokens as the
in-memory model, fewer bytes moved per token as the plan predicts, and damaged packed bytes found on read."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from offload_core import init_empty_weights, load_checkpoint_and_dispatch
from offload_core.errors import StorageError
from offload_core.loading.checkpoint import Checkpoint
from offload_core.loading.moves import stored_bytes
from offload_core.storage import codec
from offload_core_plugins.storage_pinned_cpu import PinnedCpuConfig, PinnedCpuStorage

OFFLOAD_BLOCKS = {
    "model.embed_tokens": 0,
    "model.layers": "cpu",
    "model.norm": 0,
    "model.rotary_emb": 0,
    "lm_head": "cpu",
}
IDS = torch.randint(0, 500, (1, 6), generator=torch.Generator().manual_seed(3))
CHUNK = 8192  # several chunks per MLP weight (128 x 384)


def _checkpoint(tmp_path):
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=500,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).eval()
    reference.save_pretrained(tmp_path / "ckpt")  # float32: the run converts to bf16, then packs
    return tmp_path / "ckpt"


def _load(path, codec_name="exponent", policy="prefetch"):
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(path)).eval()
    storage = PinnedCpuStorage(PinnedCpuConfig(codec=codec_name, codec_chunk=CHUNK))
    load_checkpoint_and_dispatch(
        model, path, device_map=OFFLOAD_BLOCKS, storage=storage, policy=policy, dtype=torch.bfloat16, progress=False
    )
    return model


def _in_memory(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        return model(IDS).logits, model.generate(IDS, max_new_tokens=4, do_sample=False)


@pytest.mark.slow  # whole runs (the quick subset stays under a minute)
def test_packed_weights_decode_on_the_device_bit_identical(tmp_path, fake_gpu):
    fake = fake_gpu(count=1)
    path = _checkpoint(tmp_path)
    logits, tokens = _in_memory(path)
    model = _load(path)
    state = model.offload_state
    store = state.store
    assert store.packs and store.pinned and fake.is_pinned(store.packed("model.layers.0.mlp.up_proj.weight").blob)
    assert len(store._packed) == 3 * 7 + 1  # every projection and the head; norms (128 elements) stay raw
    with torch.no_grad():
        assert torch.equal(model(IDS.to(fake.device(0))).logits.cpu(), logits)
        assert torch.equal(model.generate(IDS.to(fake.device(0)), max_new_tokens=4, do_sample=False).cpu(), tokens)
    held = sum(store.moved_nbytes(k) or store[k].numel() * store[k].element_size() for k in store)
    assert fake.pinned_bytes <= 1.1 * held  # the arena sized for the packed bytes
    prefetcher = state.handle.prefetcher
    assert prefetcher.decoder.decoded >= 22  # decoded on the device, not on the host
    assert prefetcher.decoder.nbytes == codec.scratch_bytes(CHUNK)
    state.remove()
    assert fake.pinned_bytes == 0


def test_bytes_moved_per_forward_fall_as_the_plan_predicts(tmp_path, fake_gpu):
    fake = fake_gpu(count=1)
    path = _checkpoint(tmp_path)
    moved = {}
    for name in ("none", "exponent"):
        model = _load(path, name)
        stats = model.offload_state.stats
        with torch.no_grad():
            model(IDS.to(fake.device(0)))
            stats.reset()
            model(IDS.to(fake.device(0)))
        moved[name] = stats.bytes
        store = model.offload_state.store
        if name == "exponent":
            held = sum(store.moved_nbytes(k) or store[k].numel() * store[k].element_size() for k in store)
            assert moved[name] == held  # every offloaded tensor read once per forward, packed ones packed
        model.offload_state.remove()
    assert 0.7 * moved["none"] < moved["exponent"] < 0.85 * moved["none"]
    predicted = stored_bytes(Checkpoint.open(path), PinnedCpuStorage(PinnedCpuConfig(codec="exponent")), torch.bfloat16)
    packed_now = {k: v for k, v in predicted.items() if not k.startswith("model.embed") and "norm" not in k}
    raw = sum(torch.Size(Checkpoint.open(path).shape(k)).numel() * 2 for k in packed_now)
    assert sum(packed_now.values()) / raw == pytest.approx(moved["exponent"] / moved["none"], abs=0.03)


def test_other_policies_read_the_decoded_tensors(tmp_path, fake_gpu):
    """``align_per_call`` copies ``store[name]`` (decoded on the host): the same logits, no device decoding."""
    fake = fake_gpu(count=1)
    path = _checkpoint(tmp_path)
    logits, _ = _in_memory(path)
    model = _load(path, policy="align_per_call")
    with torch.no_grad():
        assert torch.equal(model(IDS.to(fake.device(0))).logits.cpu(), logits)
    model.offload_state.remove()


def test_damaged_packed_bytes_stop_the_run(tmp_path, fake_gpu):
    fake = fake_gpu(count=1)
    model = _load(_checkpoint(tmp_path))
    store = model.offload_state.store
    packed = store.packed("model.layers.1.mlp.down_proj.weight")
    packed.blob[packed.chunks[-1].offset + 8] ^= 4  # the exception count in a chunk's header
    with pytest.raises(StorageError, match="model.layers.1.mlp.down_proj.weight.*damaged"), torch.no_grad():
        model(IDS.to(fake.device(0)))
    with pytest.raises(StorageError, match="damaged"):
        store.verify()
    packed.blob[packed.chunks[-1].offset + 8] ^= 4
    store.verify()
    model.offload_state.remove()
