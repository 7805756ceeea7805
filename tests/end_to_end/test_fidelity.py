"""The fidelity matrix: every store × module-hook policy, each placement with every store and every policy, gives
the in-memory model's tokens and bit-identical logits."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, BertConfig, LlamaConfig

from offload_core import init_empty_weights, load_checkpoint_and_dispatch
from offload_core.loading.writer import write_sharded_safetensors
from offload_core.planning import compute_module_sizes

PLACEMENTS = ["sequential", "balanced", "balanced_low_0"]
STORES = ["pinned_cpu", "memmap", "safetensors"]
POLICIES = [
    ("align_per_call", {}),
    ("align_per_call", {"granularity": "block"}),
    ("chained", {}),
    ("functional_call", {}),
    ("prefetch", {}),
    ("prefetch", {"pool": True}),
]
#: each store x policy once, the placement turning with them so that every placement meets every store and every
#: policy: without a GPU the three placements plan the same map (the balanced ones cap GPUs only)
MATRIX = [
    (PLACEMENTS[(i + j) % len(PLACEMENTS)], store, policy)
    for (i, store), (j, policy) in itertools.product(enumerate(STORES), enumerate(POLICIES))
]


def _ids(policy):
    name, cfg = policy
    return "-".join([name, *(f"{k}={v}" for k, v in cfg.items())])


def _policy(policy):
    from offload_core.registry.manager import get_registry

    name, options = policy
    return get_registry().create("policy", name, {"name": name, **options})


def _save(model, config, directory, shard=200_000):
    directory.mkdir(parents=True, exist_ok=True)
    write_sharded_safetensors(model.state_dict(), directory, max_shard_size=shard)
    config.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory):
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    path = _save(model, config, tmp_path_factory.mktemp("tied_llama"))
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    return path, config, ids, logits, tokens


def _offloaded_llama(path, config, placement, store, policy, tmp_path):
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config).eval()
    total = compute_module_sizes(model)[""]
    # A CPU budget of about half the model: the rest goes to disk.
    load_checkpoint_and_dispatch(
        model,
        path,
        device_map=placement,
        max_memory={"cpu": total // 2},
        storage=store,
        policy=_policy(policy),
        offload_folder=tmp_path / "offload",
        progress=False,
        headroom=0,
        over_budget="warn",  # pinned_cpu holds the disk tier in memory, over half the model
    )
    return model


@pytest.mark.parametrize("placement,store,policy", MATRIX, ids=[f"{p}-{s}-{_ids(h)}" for p, s, h in MATRIX])
def test_tied_llama_matrix(tied_llama, placement, store, policy, tmp_path):
    path, config, ids, ref_logits, ref_tokens = tied_llama
    model = _offloaded_llama(path, config, placement, store, policy, tmp_path)
    state = model.offload_state
    assert "disk" in set(model.hf_device_map.values()), model.hf_device_map
    assert state.offloaded_bytes() > 0
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(tokens, ref_tokens)
    assert state.stats.bytes > 0
    # Removing the module hooks leaves a model equal to the original, ties kept.
    state.remove()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref_logits)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    config = BertConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        vocab_size=400,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    ref = AutoModel.from_config(config).eval()
    path = _save(ref, config, tmp_path_factory.mktemp("bert"))
    ids = torch.randint(0, 400, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ref(ids).last_hidden_state
    return path, config, ids, expected


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("policy", POLICIES, ids=_ids)
def test_bert_encoder_hidden_states(bert, store, policy, tmp_path):
    path, config, ids, expected = bert
    with init_empty_weights():
        model = AutoModel.from_config(config).eval()
    total = compute_module_sizes(model)[""]
    load_checkpoint_and_dispatch(
        model,
        path,
        device_map="sequential",
        max_memory={"cpu": total // 3},
        no_split_module_classes=["BertLayer"],
        storage=store,
        policy=_policy(policy),
        offload_folder=tmp_path / "off",
        progress=False,
        headroom=0,
        over_budget="warn",  # pinned_cpu holds the disk tier in memory, over a third of the model
    )
    assert "disk" in set(model.hf_device_map.values())
    with torch.no_grad():
        got = model(ids).last_hidden_state
    assert torch.equal(got, expected)
