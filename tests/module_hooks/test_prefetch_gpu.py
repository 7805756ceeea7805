"""prefetch on a GPU: the block pool on the device, the pinned staging ring on a side stream, events; skipped without
CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from offload_core import init_empty_weights, load_checkpoint_and_dispatch
from offload_core.loading.writer import write_sharded_safetensors
from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONFIG = LlamaConfig(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=1024,
    tie_word_embeddings=True,
)
# Everything but two layers lives off the GPU: cpu and disk are both streamed to cuda:0.
DEVICE_MAP = {
    "model.embed_tokens": "cpu",
    "model.layers.0": 0,
    "model.layers.1": "cpu",
    "model.layers.2": "disk",
    "model.layers.3": 0,
    "model.layers.4": "disk",
    "model.layers.5": "cpu",
    "model.norm": 0,
    "model.rotary_emb": 0,
    "lm_head": "cpu",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG, dtype=torch.bfloat16).eval()
    path = tmp_path_factory.mktemp("gpu_llama")
    write_sharded_safetensors(model.state_dict(), path, max_shard_size=2_000_000)
    CONFIG.save_pretrained(path)
    ids = torch.randint(0, 1024, (1, 12), generator=torch.Generator().manual_seed(1))
    model.to("cuda")
    with torch.no_grad():
        logits = model(ids.cuda()).logits
        tokens = model.generate(
            ids.cuda(), attention_mask=torch.ones_like(ids).cuda(), max_new_tokens=8, do_sample=False
        )
    del model
    torch.cuda.empty_cache()
    return path, ids.cuda(), logits, tokens


@pytest.mark.parametrize("store", ["pinned_cpu", "memmap", "safetensors"])
@pytest.mark.parametrize("depth", [1, 2])
def test_gpu_prefetch_matches_in_memory(checkpoint, store, depth, tmp_path):
    path, ids, ref_logits, ref_tokens = checkpoint
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(CONFIG, dtype=torch.bfloat16).eval()
    # A small staging chunk: every weight crosses in several chunks, through every buffer of the ring.
    policy = Prefetch(PrefetchConfig(depth=depth, staging_chunk="64KiB"))
    load_checkpoint_and_dispatch(
        model,
        path,
        device_map=DEVICE_MAP,
        storage=store,
        policy=policy,
        offload_folder=tmp_path / "off",
        execution_device="cuda:0",
        progress=False,
    )
    state = model.offload_state
    prefetcher = state.handle.prefetcher
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(ids).logits, ref_logits)
        state.stats.reset()
        assert torch.equal(model(ids).logits, ref_logits)
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert torch.equal(tokens, ref_tokens)
    blocks = prefetcher.block_pool
    assert blocks.count == depth + 1 and blocks.peak_in_use <= depth + 1
    assert all(b is None or b.device.type == "cuda" for b in blocks.buffers)
    # The tied embedding / lm_head weight crosses once a forward, not twice.
    assert prefetcher.borrowed >= 1
    if store == "pinned_cpu":
        assert prefetcher.staging is None  # straight from pinned memory
    else:
        assert prefetcher.staging.chunks > 0 and all(b.is_pinned() for b in prefetcher.staging.buffers)
        assert len(prefetcher.staging.buffers) <= 3
    assert prefetcher.misses <= len(prefetcher.units) + 1
    state.remove()


def test_gpu_memory_stays_inside_resident_plus_pool(tmp_path):
    # Blocks of ~25 MB, 6 of 8 offloaded (~150 MB): holding them all at once would break the bound below.
    config = LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    write_sharded_safetensors(
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).state_dict(),
        tmp_path / "ckpt",
        max_shard_size=50_000_000,
    )
    config.save_pretrained(tmp_path / "ckpt")
    device_map = {
        "model.embed_tokens": 0,
        "model.rotary_emb": 0,
        "model.norm": 0,
        "lm_head": 0,
        **{f"model.layers.{i}": (0 if i in (0, 4) else "disk") for i in range(8)},
    }
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    load_checkpoint_and_dispatch(
        model,
        tmp_path / "ckpt",
        device_map=device_map,
        storage="memmap",
        policy=Prefetch(PrefetchConfig(depth=2)),
        offload_folder=tmp_path / "off",
        execution_device="cuda:0",
        progress=False,
    )
    ids = torch.randint(0, 1024, (1, 12), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        # The first forward's GEMMs allocate cuBLAS's workspaces (once per handle and stream, several MiB):
        # allocated once, they are not a copy outliving its block.
        model(ids, use_cache=False)
    torch.cuda.synchronize()
    blocks = model.offload_state.handle.prefetcher.block_pool
    resident = torch.cuda.memory_allocated() - blocks.allocated_bytes  # the weights on the GPU and the workspaces
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        for _ in range(4):
            model(ids, use_cache=False)
    torch.cuda.synchronize()
    assert blocks.allocated_bytes == 3 * blocks.capacity and blocks.capacity > 20 * 2**20
    # Between forwards only the resident weights and the pool stay allocated: no copy outlives its block.
    assert torch.cuda.memory_allocated() <= resident + blocks.allocated_bytes + 2**20
    workspace_and_activations = 64 * 2**20  # logits and temporaries of a 12-token forward
    assert torch.cuda.max_memory_allocated() <= resident + blocks.allocated_bytes + workspace_and_activations
    model.offload_state.remove()
