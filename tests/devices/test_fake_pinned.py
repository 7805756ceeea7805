"""Pinned host memory on a GPU run: one arena per store, sub-allocated, within 5% of the bytes stored (PyTorch's
pinned allocator would round each tensor up to a power of two), and given back when the store closes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from offload_core import dispatch_model, init_empty_weights, load_checkpoint_and_dispatch


def _llama(hidden=96, seed=0):
    # 3 * 96 = 288-byte rows: tensors whose sizes are not powers of two
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=500,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


OFFLOAD_ALL_BLOCKS = {
    "model.embed_tokens": 0,
    "model.layers": "cpu",
    "model.norm": 0,
    "model.rotary_emb": 0,
    "lm_head": "cpu",
}
IDS = torch.randint(0, 500, (1, 5), generator=torch.Generator().manual_seed(2))


def _check_arena(fake, store, expected):
    stored = sum(store[k].numel() * store[k].element_size() for k in store)
    assert store.pinned and stored > 500_000
    assert fake.pinned_bytes <= 1.05 * stored
    assert len(store.arena.arenas) == 1  # sized once, from what the loader said the store would hold
    assert store.pinned_bytes <= 1.05 * stored
    assert all(fake.is_pinned(store[k]) for k in store)


def test_dispatch_model_pins_one_arena_within_five_percent(fake_gpu):
    fake = fake_gpu(count=1)
    reference = _llama()
    with torch.no_grad():
        expected = reference(IDS).logits
    model = _llama()
    dispatch_model(model, OFFLOAD_ALL_BLOCKS, storage="pinned_cpu", policy="align_per_call")
    store = model.offload_state.store
    _check_arena(fake, store, expected)
    with torch.no_grad():
        assert torch.equal(model(IDS.to(fake.device(0))).logits.cpu(), expected)
    model.offload_state.remove()
    assert fake.pinned_bytes == 0  # the store's close() unpinned its arena


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_load_checkpoint_sizes_the_arena_from_the_checkpoint(dtype, tmp_path, fake_gpu):
    """The store's bytes come from the checkpoint's shapes and dtypes (converted to the run's dtype)."""
    from offload_core.loading.writer import write_sharded_safetensors

    fake = fake_gpu(count=1)
    reference = _llama()
    write_sharded_safetensors(reference.state_dict(), tmp_path / "ckpt", max_shard_size=300_000)
    reference.config.save_pretrained(tmp_path / "ckpt")
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(reference.config).eval()
    load_checkpoint_and_dispatch(
        model,
        tmp_path / "ckpt",
        device_map=OFFLOAD_ALL_BLOCKS,
        storage="pinned_cpu",
        policy="prefetch",
        dtype=dtype,
        progress=False,
    )
    store = model.offload_state.store
    _check_arena(fake, store, None)
    if dtype is not None:
        assert all(store[k].dtype == dtype for k in store)
    in_memory = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=dtype or torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(model(IDS.to(fake.device(0))).logits.cpu(), in_memory(IDS).logits)
    model.offload_state.remove()
    assert fake.pinned_bytes == 0
