"""Models spread over two and four (fake) GPUs: every module resident on a GPU gets its inputs on its own
device when more than one device computes, and a model placed on GPU 1 alone runs there."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from offload_core import dispatch_model


def _tied_llama(layers=4):
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


IDS = torch.randint(0, 320, (2, 7), generator=torch.Generator().manual_seed(5))


def _expected():
    with torch.no_grad():
        return _tied_llama()(IDS).logits


def test_the_issue_map_rotary_and_norm_on_gpu_1_layers_and_head_on_gpu_0(fake_gpu):
    """The map get_balanced_memory gives a tied Llama over two GPUs: cos/sin made on GPU 1 reach layer 0 on
    GPU 0, and norm's output reaches lm_head on GPU 0."""
    fake = fake_gpu(count=2)
    model = _tied_llama(layers=2)
    device_map = {
        "model.embed_tokens": 0,
        "model.rotary_emb": 1,
        "model.layers.0": 0,
        "model.layers.1": 1,
        "model.norm": 1,
        "lm_head": 0,
    }
    dispatch_model(model, device_map)
    assert model.model.norm.weight.device == fake.device(1) and model.lm_head.weight.device == fake.device(0)
    with torch.no_grad():
        reference = _tied_llama(layers=2)(IDS).logits
        assert torch.equal(model(IDS.to(fake.device(0))).logits.cpu(), reference)
        assert torch.equal(model(IDS).logits, reference)  # host inputs: outputs come back to the host
    model.offload_state.remove()
    assert fake.memory_allocated(0) == fake.memory_allocated(1) == 0


@pytest.mark.parametrize("policy", ["align_per_call", "chained", "functional_call"])
@pytest.mark.parametrize("count", [2, 4])
def test_balanced_over_gpus_with_offloaded_blocks_matches_in_memory(count, policy, tmp_path, fake_gpu):
    fake = fake_gpu(count=count, memory="8MiB")
    model = _tied_llama()
    sizes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    # the balanced placement spreads the blocks over the GPUs (less the room held back for blocks in flight on
    # the main one)
    block = sum(t.numel() * t.element_size() for t in model.model.layers[0].state_dict().values())
    budgets = {i: sizes // count + block for i in range(count)} | {"cpu": 10 * sizes}
    dispatch_model(
        model,
        "balanced",
        max_memory=budgets,
        policy=policy,
        offload_folder=tmp_path / "off",
        no_split_module_classes=["LlamaDecoderLayer"],
    )
    used = {d for d in model.hf_device_map.values() if isinstance(d, int)}
    assert len(used) >= 2, model.hf_device_map
    expected = _expected()
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(IDS.to(fake.device(0))).logits.cpu(), expected)
    model.offload_state.remove()
    assert all(fake.memory_allocated(i) == 0 for i in range(count))


@pytest.mark.parametrize("storage", ["pinned_cpu", "memmap"])
@pytest.mark.parametrize("policy", ["align_per_call", "prefetch", "chained", "functional_call", "experts"])
def test_four_gpus_with_blocks_offloaded_between_them(policy, storage, tmp_path, fake_gpu):
    """Blocks resident on three GPUs with offloaded ones between them (they run on GPU 0, the main one)."""
    fake = fake_gpu(count=4)
    model = _tied_llama()
    device_map = {
        "model.embed_tokens": 0,
        "model.rotary_emb": 3,
        "model.layers.0": 1,
        "model.layers.1": "cpu",
        "model.layers.2": 2,
        "model.layers.3": "disk",
        "model.norm": 3,
        "lm_head": 0,
    }
    dispatch_model(model, device_map, storage=storage, policy=policy, offload_folder=tmp_path / "off")
    expected = _expected()
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(IDS).logits, expected)
    model.offload_state.remove()
    assert all(fake.memory_allocated(i) == 0 for i in range(4))


def test_a_model_placed_on_gpu_1_runs_there_by_default(fake_gpu):
    fake = fake_gpu(count=2)
    model = _tied_llama(layers=2)
    dispatch_model(model, {"": 1})
    assert model.offload_state.execution_device == fake.device(1)
    with torch.no_grad():
        out = model(IDS.to(fake.device(1))).logits
    assert out.device == fake.device(1)
    assert fake.memory_allocated(0) == 0  # nothing was brought to GPU 0
    assert torch.equal(out.cpu(), _expected_two_layers())
    model.offload_state.remove()


def _expected_two_layers():
    with torch.no_grad():
        return _tied_llama(layers=2)(IDS).logits
