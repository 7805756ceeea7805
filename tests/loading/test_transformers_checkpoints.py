"""Checkpoints that transformers itself saved (sharded, per-expert MoE tensors, renamed keys, encoders, seq2seq) load
through the Python API and give logits bit-identical to ``from_pretrained``'s, for every placement x store x policy.

The full matrix is marked ``slow``: ``python -m pytest -q -m slow tests/test_transformers_checkpoints.py``.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from offload_core import init_empty_weights, load_checkpoint_and_dispatch
from offload_core.errors import OffloadError
from offload_core.loading.checkpoint import Checkpoint
from offload_core.loading.conversion import key_conversion
from offload_core.loading.converted import ConvertedCheckpoint, convert_checkpoint
from offload_core.planning import compute_module_sizes

from tests.checkpoints import FAST, MODELS, PLACEMENTS, POLICIES, STORES, Saved, minilm_folder


def _dispatch(saved: Saved, placement, store, policy, folder, fraction=2):
    with init_empty_weights():
        model = saved.auto.from_config(saved.config).eval()
    total = compute_module_sizes(model)[""]
    load_checkpoint_and_dispatch(
        model,
        saved.path,
        device_map=placement,
        max_memory={"cpu": total // fraction},
        over_budget="warn",  # a tiny model's blocks are larger than a fraction of it
        storage=store,
        policy=policy,
        offload_folder=folder,
        execution_device="cpu",
        progress=False,
        headroom=0,
    )
    return model


def _check(saved: Saved, placement, store, policy, folder):
    model = _dispatch(saved, placement, store, policy, folder)
    assert "disk" in set(model.hf_device_map.values()), model.hf_device_map
    with torch.no_grad():
        got = model(**saved.inputs).logits
    model.offload_state.remove()
    assert torch.equal(got, saved.expected), (got - saved.expected).abs().max()


@pytest.mark.parametrize("name,store", FAST)
def test_transformers_checkpoint_bit_identical(saved, name, store, tmp_path):
    _check(saved(name), "sequential", store, "align_per_call", tmp_path / "off")


def _placed(offset: int, store: str, policy: str) -> str:
    """The placement run with ``store`` x ``policy``: without a GPU the three placements plan the same map (the
    balanced ones cap GPUs only, get_balanced_memory's docstring), so each store x policy runs once, the placement
    turning with it and with the model (``offset``) so that every placement x store, placement x policy and
    placement x model pairing runs, and every placement x store x policy on several models."""
    return PLACEMENTS[(offset + STORES.index(store) + POLICIES.index(policy)) % len(PLACEMENTS)]


MATRIX = [
    (name, _placed(i, store, policy), store, policy)
    for i, name in enumerate(MODELS)
    for store, policy in itertools.product(STORES, POLICIES)
]


@pytest.mark.slow
@pytest.mark.parametrize("name,placement,store,policy", MATRIX, ids=["-".join(m) for m in MATRIX])
def test_matrix(saved, name, placement, store, policy, tmp_path):
    _check(saved(name), placement, store, policy, tmp_path / "off")


def test_mixtral_conversion_uses_transformers_mapping_and_reads_experts_in_place(saved):
    mixtral = saved("mixtral")
    with init_empty_weights():
        model = mixtral.auto.from_config(mixtral.config)
    checkpoint = Checkpoint.open(mixtral.path)
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in checkpoint
    view = convert_checkpoint(model, checkpoint)
    assert isinstance(view, ConvertedCheckpoint)
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    assert fused in view.keys() and view.shape(fused) == tuple(model.state_dict()[fused].shape)
    # Placing the parts in place gives exactly what transformers' own converter builds.
    assembled = torch.empty(view.shape(fused), dtype=view.dtype(fused))
    for index, source in view.parts(fused):
        assembled[index].copy_(source)
    assert torch.equal(assembled, view.get(fused))
    summary = view.conversion.summary()
    assert summary.converted == 2 * mixtral.config.num_hidden_layers and summary.part_by_part == summary.converted
    assert any("built from several" in line for line in summary.lines())


def test_gpt_neox_renamed_keys(saved):
    neox = saved("gpt_neox")
    with init_empty_weights():
        model = neox.auto.from_config(neox.config)
    conversion = key_conversion(model, neox.path)
    # transformers saves GPT-NeoX's head under its legacy name; were that to change, this fails rather than
    # passing without checking the rename.
    assert "embed_out.weight" in Checkpoint.open(neox.path) and "lm_head.weight" not in Checkpoint.open(neox.path)
    assert conversion.renamed.get("lm_head.weight") == "embed_out.weight"


def test_safetensors_store_writes_nothing_for_fused_experts(saved, tmp_path):
    model = _dispatch(saved("qwen2_moe"), "sequential", "safetensors", "align_per_call", tmp_path / "off", fraction=3)
    store = model.offload_state.store
    assert store.assembled and store.bytes_written == 0
    assert not (tmp_path / "off").exists() or not any((tmp_path / "off").rglob("*.safetensors"))
    model.offload_state.remove()


def _rewrite(source: Path, target: Path, change) -> Path:
    """Copy a saved checkpoint with ``change(state)`` applied (one file, config kept)."""
    target.mkdir()
    state = {}
    for file in source.glob("*.safetensors"):
        state.update(load_file(file))
    change(state)
    save_file(state, target / "model.safetensors")
    (target / "config.json").write_text((source / "config.json").read_text())
    return target


def test_missing_expert_tensor_is_one_line_naming_it(saved, tmp_path):
    mixtral = saved("mixtral")
    gone = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    path = _rewrite(mixtral.path, tmp_path / "ckpt", lambda state: state.pop(gone))
    with pytest.raises(OffloadError, match=gone.replace(".", r"\.")) as info:
        with init_empty_weights():
            model = mixtral.auto.from_config(mixtral.config)
        load_checkpoint_and_dispatch(model, path, device_map="sequential", progress=False)
    assert "\n" not in str(info.value)


def test_fused_and_per_expert_tensors_together_is_one_line_naming_it(saved, tmp_path):
    mixtral = saved("mixtral")
    with init_empty_weights():
        model = mixtral.auto.from_config(mixtral.config)
    fused = "model.layers.0.mlp.experts.down_proj"
    shape = tuple(model.state_dict()[fused].shape)
    path = _rewrite(mixtral.path, tmp_path / "ckpt", lambda state: state.__setitem__(fused, torch.zeros(shape)))
    with pytest.raises(OffloadError, match=fused.replace(".", r"\.")) as info:
        load_checkpoint_and_dispatch(model, path, device_map="sequential", progress=False)
    assert "\n" not in str(info.value)


def test_functional_call_fires_block_hooks_once(saved, tmp_path):
    gpt2 = saved("gpt2")
    reference = gpt2.auto.from_pretrained(gpt2.path).eval()
    model = _dispatch(gpt2, "sequential", "memmap", "functional_call", tmp_path / "off", fraction=4)
    calls = []
    for layer in model.transformer.h:
        layer.register_forward_hook(lambda module, args, output: calls.append(module))
    with torch.no_grad():
        got = model(**gpt2.inputs, output_hidden_states=True)
        want = reference(**gpt2.inputs, output_hidden_states=True)
    assert len(calls) == gpt2.config.n_layer
    assert len(got.hidden_states) == len(want.hidden_states) == gpt2.config.n_layer + 1
    assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, want.hidden_states))
    model.offload_state.remove()


def test_functional_call_router_logits_as_in_memory(saved, tmp_path):
    mixtral = saved("mixtral")
    reference = mixtral.auto.from_pretrained(mixtral.path).eval()
    model = _dispatch(mixtral, "sequential", "safetensors", "functional_call", tmp_path / "off", fraction=3)
    with torch.no_grad():
        got = model(**mixtral.inputs, output_router_logits=True)
        want = reference(**mixtral.inputs, output_router_logits=True)
    assert len(got.router_logits) == len(want.router_logits) == mixtral.config.num_hidden_layers
    assert all(torch.equal(a, b) for a, b in zip(got.router_logits, want.router_logits))
    model.offload_state.remove()


def _embed(model, batch):
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


@pytest.fixture(scope="module")
def minilm():
    folder = minilm_folder()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")  # a local folder: nothing may be fetched from a model hub
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        reference = transformers.AutoModel.from_pretrained(folder).eval()
    batch = dict(
        tokenizer(
            ["offloading keeps only memory changing", "a second, longer sentence to embed here"],
            padding=True,
            return_tensors="pt",
        )
    )
    return folder, batch, _embed(reference, batch)


def _minilm_check(minilm, placement, store, policy, tmp_path):
    folder, batch, expected = minilm
    config = transformers.AutoConfig.from_pretrained(folder)
    with init_empty_weights():
        model = transformers.AutoModel.from_config(config).eval()
    total = compute_module_sizes(model)[""]
    load_checkpoint_and_dispatch(
        model,
        folder,
        device_map=placement,
        max_memory={"cpu": total // 2},
        over_budget="warn",
        storage=store,
        policy=policy,
        offload_folder=tmp_path / "off",
        execution_device="cpu",
        progress=False,
        headroom=0,
    )
    assert "disk" in set(model.hf_device_map.values())
    got = _embed(model, batch)
    model.offload_state.remove()
    assert torch.equal(got, expected), (got - expected).abs().max()


def test_minilm_embeddings_bit_identical(minilm, tmp_path):
    _minilm_check(minilm, "sequential", "safetensors", "prefetch", tmp_path)


MINILM_MATRIX = [(_placed(0, store, policy), store, policy) for store, policy in itertools.product(STORES, POLICIES)]


@pytest.mark.slow
@pytest.mark.parametrize("placement,store,policy", MINILM_MATRIX, ids=["-".join(m) for m in MINILM_MATRIX])
def test_minilm_matrix(minilm, placement, store, policy, tmp_path):
    _minilm_check(minilm, placement, store, policy, tmp_path)


def test_checkpoint_whose_names_match_is_not_wrapped(saved):
    llama = saved("llama")
    with init_empty_weights():
        model = llama.auto.from_config(llama.config)
    checkpoint = Checkpoint.open(llama.path)
    assert convert_checkpoint(model, checkpoint) is checkpoint
    assert key_conversion(model, checkpoint).summary().lines() == [
        "checkpoint names match the model: nothing converted"
    ]


def test_gpt2_tied_head_split_across_tiers(saved, tmp_path):
    gpt2 = saved("gpt2")
    model = _dispatch(
        gpt2,
        {
            "transformer.wte": "disk",
            "transformer.wpe": "cpu",
            "transformer.drop": "cpu",
            "transformer.h": "cpu",
            "transformer.ln_f": "cpu",
            "lm_head": "cpu",
        },
        "memmap",
        "align_per_call",
        tmp_path / "off",
    )
    assert model.hf_device_map["transformer.wte"] == "disk" and model.hf_device_map["lm_head"] == "cpu"
    with torch.no_grad():
        got = model(**gpt2.inputs).logits
    model.offload_state.remove()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(got, gpt2.expected)


def test_layer_without_one_kind_of_expert_tensor_is_one_line(saved, tmp_path):
    qwen = saved("qwen2_moe")
    path = _rewrite(
        qwen.path,
        tmp_path / "ckpt",
        lambda state: [
            state.pop(k)
            for k in list(state)
            if k.startswith("model.layers.2.") and ".up_proj." in k and ".experts." in k
        ],
    )
    with init_empty_weights():
        model = qwen.auto.from_config(qwen.config)
    with pytest.raises(OffloadError, match=r"up_proj.*model\.layers\.2\.mlp\.experts\.gate_up_proj") as info:
        load_checkpoint_and_dispatch(model, path, device_map="sequential", progress=False)
    assert "\n" not in str(info.value)


def test_memmap_writes_converted_experts_once_and_reuses_them(saved, tmp_path):
    qwen = saved("qwen2_moe")
    first = _dispatch(qwen, "sequential", "memmap", "align_per_call", tmp_path / "off", fraction=3)
    store = first.offload_state.store
    fused = [name for name in store if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert fused and store.bytes_written >= sum(store[name].numel() * store[name].element_size() for name in fused)
    first.offload_state.remove()
    again = _dispatch(qwen, "sequential", "memmap", "align_per_call", tmp_path / "off", fraction=3)
    assert again.offload_state.store.reused and again.offload_state.store.bytes_written == 0
    with torch.no_grad():
        assert torch.equal(again(**qwen.inputs).logits, qwen.expected)
    again.offload_state.remove()
