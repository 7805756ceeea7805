"""``storage.codec=exponent`` on a real GPU: packed bf16 weights decoded by CUDA kernels bit for bit, and a model
streamed packed through ``hook=prefetch`` gives the in-memory model's logits and tokens; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from offload_core import init_empty_weights, load_checkpoint_and_dispatch
from offload_core.loading.writer import write_sharded_safetensors
from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig
from offload_core.storage import codec
from offload_core_plugins.storage_pinned_cpu import PinnedCpuConfig, PinnedCpuStorage

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONFIG = LlamaConfig(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=1024,
    tie_word_embeddings=False,
)
DEVICE_MAP = {
    "model.embed_tokens": 0,
    "model.layers.0": "cpu",
    "model.layers.1": 0,
    "model.layers.2": "cpu",
    "model.layers.3": "cpu",
    "model.norm": 0,
    "model.rotary_emb": 0,
    "lm_head": "cpu",
}


def test_cuda_decodes_every_bit_pattern():
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    weights = (torch.randn(3_000_001, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    spots = weights[::997]
    spots.copy_(every[torch.randperm(65536, generator=torch.Generator().manual_seed(1))[: spots.numel()]])
    packed = codec.encode(weights, 2**20, lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
    assert packed is not None and sum(c.exceptions for c in packed.chunks) > 1000
    out = torch.full((3_000_001,), float("nan"), dtype=torch.bfloat16, device="cuda")
    codec.decode_into(packed, out, codec.Scratch(torch.device("cuda"), 2**20))
    assert torch.equal(out.cpu().view(torch.int16), weights.view(torch.int16))


@pytest.mark.parametrize("depth", [1, 2])
def test_gpu_prefetch_of_packed_weights_matches_in_memory(depth, tmp_path):
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(CONFIG, dtype=torch.bfloat16).eval()
    write_sharded_safetensors(reference.state_dict(), tmp_path / "ckpt", max_shard_size=2_000_000)
    CONFIG.save_pretrained(tmp_path / "ckpt")
    ids = torch.randint(0, 1024, (1, 12), generator=torch.Generator().manual_seed(1)).cuda()
    reference.to("cuda")
    with torch.no_grad():
        logits = reference(ids).logits
        tokens = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    del reference
    torch.cuda.empty_cache()
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(CONFIG, dtype=torch.bfloat16).eval()
    load_checkpoint_and_dispatch(
        model,
        tmp_path / "ckpt",
        device_map=DEVICE_MAP,
        storage=PinnedCpuStorage(PinnedCpuConfig(codec="exponent", codec_chunk=65536)),
        policy=Prefetch(PrefetchConfig(depth=depth)),
        execution_device="cuda:0",
        progress=False,
    )
    state = model.offload_state
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(ids).logits, logits)
        assert torch.equal(
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False), tokens
        )
    assert state.handle.prefetcher.decoder.decoded > 0
    assert state.store.raw_nbytes and state.store.bytes_written < 0.8 * state.store.raw_nbytes
    state.remove()
