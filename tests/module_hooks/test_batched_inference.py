"""Offloaded weights under ``torch.inference_mode``, as generation runs: a batch takes no more memory than its plan
and gives the in-memory model's tokens, with the output embedding brought in from disk by every policy."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from offload_core.loading.dispatch import load_checkpoint_and_dispatch
from offload_core.loading.empty import init_empty_weights
from offload_core.loading.writer import write_sharded_safetensors
from offload_core.planning.batch_memory import batch_memory
from offload_core.registry import get_registry
from offload_core.jobs.metrics import MemoryMonitor
from tests.memory_peak import KernelPeak

#: allocator and thread-pool slack beside what the plan counts
SLACK = 32 * 2**20
ROWS, PROMPT, NEW = 8, 20, 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 2-layer bf16 Llama whose untied output embedding (32000 x 256: 16 MiB; a copy per row is 128 MiB) dwarfs the
    slack."""
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32000,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    folder = tmp_path_factory.mktemp("wide_head")
    write_sharded_safetensors(model.state_dict(), folder, max_shard_size=64 * 2**20)
    config.save_pretrained(folder)
    return folder, config, model


def _generate(model, ids, mask):
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0
    )


@pytest.mark.parametrize("hook", ["align_per_call", "functional_call", "chained", "prefetch"])
def test_a_batch_from_disk_takes_its_planned_memory_and_the_in_memory_tokens(checkpoint, hook, tmp_path):
    folder, config, reference = checkpoint
    ids = torch.randint(1, config.vocab_size, (ROWS, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    with torch.inference_mode():
        expected = _generate(reference, ids, mask)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    registry = get_registry()
    device_map = {"model": "cpu", "lm_head": "disk"}
    load_checkpoint_and_dispatch(
        model,
        folder,
        device_map=device_map,
        storage=registry.create("storage", "memmap"),
        policy=registry.create("policy", hook),
        offload_folder=tmp_path / "offload",
        dtype=torch.bfloat16,
        execution_device="cpu",
        progress=False,
    )
    planned = batch_memory(config, ROWS, PROMPT, NEW, torch.bfloat16)
    try:
        with torch.inference_mode(), KernelPeak() as peak, MemoryMonitor(interval=0.001) as memory:
            got = _generate(model, ids, mask)
        assert model.offload_state.stats.bytes > 0
    finally:
        model.offload_state.remove()
    assert torch.equal(got, expected)
    assert memory.anon_delta <= planned.total + SLACK, (
        f"{memory.anon_delta / 2**20:.0f} MiB taken, {planned.total / 2**20:.0f} MiB planned"
    )
    # The kernel's high-water mark misses no spike; it also counts the mapped file pages of lm_head (on disk).
    head = config.vocab_size * config.hidden_size * 2
    assert peak.rise <= planned.total + SLACK + head, (
        f"{peak.rise / 2**20:.0f} MiB peak, {planned.total / 2**20:.0f} MiB planned"
    )
