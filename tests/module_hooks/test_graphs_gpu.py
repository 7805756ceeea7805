"""graphs=true on a real GPU: a tiny bf16 Llama offloaded with prefetch from pinned memory, its decoding steps captured
in CUDA graphs and replayed, generates the tokens and logits of the in-memory model with the same static cache (eager,
and with graphs); skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import offload_core
from offload_core.loading.writer import write_sharded_safetensors
from offload_core.module_hooks.graphs import DecodeGraphs, StaticRing, apply_graphs, graph_pool_bytes
from tests.gpu_budgets import on_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONFIG = LlamaConfig(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=1024,
    max_position_embeddings=256,
)


def _generate(model, ids, tokens=12):
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            do_sample=False,
            cache_implementation="static",
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences, torch.stack(out.logits)


def _hook(model) -> DecodeGraphs:
    return next(h for h in model.__dict__["_offload_module_hooks"] if isinstance(h, DecodeGraphs))


def test_gpu_graphs_generate_what_the_in_memory_model_does(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG, dtype=torch.bfloat16).eval()
    write_sharded_safetensors(model.state_dict(), tmp_path, max_shard_size=2_000_000)
    CONFIG.save_pretrained(tmp_path)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, 1024, (1, 12), generator=torch.Generator().manual_seed(1)).cuda()
    model.cuda()
    model.generation_config.disable_compile = True  # the eager model (transformers compiles a static cache's on a GPU)
    want_ids, want_logits = _generate(model, ids)
    apply_graphs(model)  # in memory, with graphs
    got_ids, got_logits = _generate(model, ids)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_logits, want_logits)
    assert _hook(model).replays == 10
    del model
    torch.cuda.empty_cache()
    budget = total // 3 + graph_pool_bytes(CONFIG, dtype=torch.bfloat16)
    offloaded = offload_core.from_pretrained(
        tmp_path,
        offload={"storage": "pinned_cpu", "graphs": True, "execution_device": "cuda:0"},
        max_memory={0: on_gpu(budget)},
    )
    try:
        assert isinstance(offloaded.offload_state.handle.prefetcher, StaticRing)
        assert set(offloaded.hf_device_map.values()) - {0}, offloaded.hf_device_map  # part of it is streamed
        for _ in range(2):
            got_ids, got_logits = _generate(offloaded, ids)
            assert torch.equal(got_ids, want_ids)
            assert torch.equal(got_logits, want_logits)
        hook = _hook(offloaded)
        assert (hook.captures, hook.replays) == (2, 21)  # a warm-up step once, then each call's captured step
    finally:
        offloaded.offload_state.remove()
