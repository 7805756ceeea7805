"""Every module-hook policy on the fake accelerator: the GPU paths (pinned stores, the prefetch pool and its
staging ring, the side stream and its events, asynchronous copies) run, give the CPU in-memory model's
logits bit for bit, see no hazard, and give every byte of device memory back at remove()."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from offload_core import dispatch_model
from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig


def _tied_llama(seed=0):
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


#: resident parts on GPU 0, the rest offloaded to host memory or disk
MAP = {
    "model.embed_tokens": "disk",
    "model.layers.0": 0,
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.norm": 0,
    "model.rotary_emb": 0,
    "lm_head": "disk",
}
IDS = torch.randint(0, 320, (2, 6), generator=torch.Generator().manual_seed(3))


def _run_and_check(fake, model, expected, passes=3):
    with torch.no_grad():
        for _ in range(passes):
            logits = model(IDS.to(fake.device(0))).logits
            assert logits.device == fake.device(0)
            assert torch.equal(logits.cpu(), expected)


@pytest.mark.parametrize("storage", ["pinned_cpu", "memmap"])
@pytest.mark.parametrize("policy", ["align_per_call", "chained", "experts", "functional_call", "prefetch"])
def test_every_policy_on_a_gpu_matches_in_memory_and_frees_the_device(policy, storage, tmp_path, fake_gpu):
    fake = fake_gpu(count=1, memory="64MiB")
    reference = _tied_llama()
    with torch.no_grad():
        expected = reference(IDS).logits
    model = _tied_llama()
    dispatch_model(model, MAP, storage=storage, policy=policy, offload_folder=tmp_path / "off")
    assert model.offload_state.execution_device == fake.device(0)
    assert model.model.layers[0].mlp.up_proj.weight.device == fake.device(0)
    _run_and_check(fake, model, expected)
    if storage == "pinned_cpu":
        assert model.offload_state.store.pinned and model.offload_state.stats.bytes > 0
    model.offload_state.remove()
    # remove() brings the weights back to the host and lets every device buffer go, without waiting for
    # garbage collection (a sweep's next job may need the memory)
    assert fake.memory_allocated(0) == 0
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("storage", ["pinned_cpu", "memmap", "safetensors"])
def test_prefetch_pool_and_staging_on_a_gpu(depth, storage, tmp_path, fake_gpu):
    """Read-ahead on the side stream into the pool (through the pinned staging ring from a store that is not
    pinned): the compute stream waits for each block's event, a buffer is rewritten only after the compute
    stream let go of it; the fake runs the copies late and fails on any unordered use."""
    from offload_core import init_empty_weights, load_checkpoint_and_dispatch
    from offload_core.loading.writer import write_sharded_safetensors

    fake = fake_gpu(count=1, memory="64MiB")
    reference = _tied_llama()
    write_sharded_safetensors(reference.state_dict(), tmp_path / "ckpt", max_shard_size=200_000)
    reference.config.save_pretrained(tmp_path / "ckpt")
    with torch.no_grad():
        expected = reference(IDS).logits
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(reference.config).eval()
    policy = Prefetch(PrefetchConfig(depth=depth, staging_chunk="4KiB"))
    load_checkpoint_and_dispatch(
        model,
        tmp_path / "ckpt",
        device_map=MAP,
        storage=storage,
        policy=policy,
        offload_folder=tmp_path / "off",
        progress=False,
    )
    prefetcher = model.offload_state.handle.prefetcher
    _run_and_check(fake, model, expected, passes=4)
    assert prefetcher.hits > 0
    if storage != "pinned_cpu":  # pageable memory crosses through the pinned staging ring
        assert prefetcher.staging is not None and prefetcher.staging.chunks > 10
    assert prefetcher.block_pool.buffers[0].device == fake.device(0)
    model.offload_state.remove()
    assert fake.memory_allocated(0) == 0


def test_cpu_offload_with_hook_chains_two_models_through_pinned_memory(fake_gpu):
    """accelerate's model chaining on a GPU: each model rests in (pinned) host memory and moves to the GPU when
    called, until the next model of the chain is called."""
    from offload_core.loading.cpu_offload import cpu_offload_with_hook

    fake = fake_gpu(count=1)
    torch.manual_seed(0)
    first, second = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()), torch.nn.Linear(64, 32)
    x = torch.randn(3, 64)
    with torch.no_grad():
        expected = second(first(x))
    first, first_handle = cpu_offload_with_hook(first)
    second, second_handle = cpu_offload_with_hook(second, prev_module_hook=first_handle)
    assert first_handle.policy.context.store.pinned and fake.pinned_bytes > 0
    with torch.no_grad():
        hidden = first(x.to(fake.device(0)))
        assert fake.memory_allocated(0) > 0 and hidden.device == fake.device(0)
        out = second(hidden)  # the first model leaves the GPU
    assert torch.equal(out.cpu(), expected)
    second_handle.offload()
    del hidden, out
    assert fake.memory_allocated(0) == 0
    assert first[0].weight.device.type == "cpu" and second.weight.device.type == "cpu"
