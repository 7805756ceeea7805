"""The loader: single, sharded and legacy .bin checkpoints; the in-place store writes nothing; dtype conversion;
ties."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from offload_core import init_empty_weights, load_checkpoint_and_dispatch
from offload_core.loading.checkpoint import Checkpoint
from offload_core.loading.writer import write_sharded_safetensors
from offload_core.errors import CheckpointError, StorageError
from offload_core.storage import StoreContext
from offload_core.storage.inplace import InPlaceStore

from offload_core.testing import round_trip_tensors as sample_tensors

CONFIG = LlamaConfig(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    tie_word_embeddings=True,
)
MAP = {
    "model.embed_tokens": "disk",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "disk",
}


def _reference():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIG).eval()


def _empty(dtype=None):
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(CONFIG, dtype=dtype).eval()


def _write(kind: str, model, directory):
    directory.mkdir()
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    if kind == "sharded":
        write_sharded_safetensors(state, directory, max_shard_size=20_000)
    elif kind == "single":
        save_file({k: v.contiguous() for k, v in state.items()}, directory / "model.safetensors")
    elif kind == "bin":
        torch.save(state, directory / "pytorch_model.bin")
    return directory


@pytest.mark.parametrize(
    "kind,storage",
    [
        ("sharded", "safetensors"),
        ("single", "safetensors"),
        ("sharded", "memmap"),
        ("single", "pinned_cpu"),
        ("bin", "memmap"),
        ("bin", "pinned_cpu"),
    ],
)
def test_checkpoint_kinds_load_and_match(kind, storage, tmp_path):
    reference = _reference()
    path = _write(kind, reference, tmp_path / "ckpt")
    if kind == "sharded":
        assert len(Checkpoint.open(path).files) > 1
    model = _empty()
    load_checkpoint_and_dispatch(model, path, MAP, storage=storage, offload_folder=tmp_path / "off", progress=False)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    model.offload_state.remove()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie is one tensor again


def test_safetensors_store_on_a_bin_checkpoint_says_what_to_do(tmp_path):
    path = _write("bin", _reference(), tmp_path / "ckpt")
    with pytest.raises(StorageError, match="use storage=memmap"):
        load_checkpoint_and_dispatch(_empty(), path, MAP, storage="safetensors", progress=False)


def test_in_place_store_round_trips_every_dtype_and_writes_nothing(tmp_path):
    tensors = {k: v.contiguous() for k, v in sample_tensors().items()}
    save_file(tensors, tmp_path / "model.safetensors")
    before = sorted(os.listdir(tmp_path))
    ckpt = Checkpoint.open(tmp_path)
    store = InPlaceStore(StoreContext(names=list(tensors), checkpoint=ckpt))
    for name in tensors:
        store.add_from_checkpoint(name, ckpt, name, None)
    store.finalize()
    for name, t in tensors.items():
        assert store[name].dtype == t.dtype and torch.equal(store[name], t), name
    assert store.bytes_written == 0 and sorted(os.listdir(tmp_path)) == before
    assert store.warm("f32") is True


def test_in_place_store_converts_on_read_when_dtypes_differ(tmp_path):
    reference = _reference().to(torch.bfloat16)
    path = _write("sharded", reference, tmp_path / "ckpt")
    model = _empty(torch.float32)
    load_checkpoint_and_dispatch(model, path, MAP, storage="safetensors", dtype=torch.float32, progress=False)
    store = model.offload_state.store
    assert store.converting and all(store[k].dtype == torch.float32 for k in store.converting)
    assert store.warm(next(iter(store.converting))) is False  # nothing to warm: the reader fetches copies
    ids = torch.tensor([[3, 1, 4]])
    with torch.no_grad():
        upcast = _reference()
        upcast.load_state_dict({k: v.float() for k, v in reference.state_dict().items()})
        expected = upcast(ids).logits
        assert torch.equal(model(ids).logits, expected)


def test_missing_and_misshapen_weights_are_clear_errors(tmp_path):
    reference = _reference()
    state = {k: v for k, v in reference.state_dict().items() if k not in ("lm_head.weight", "model.norm.weight")}
    (tmp_path / "a").mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "a" / "model.safetensors")
    with pytest.raises(CheckpointError, match="lacks 1 weight.*model.norm.weight"):
        load_checkpoint_and_dispatch(_empty(), tmp_path / "a", MAP, storage="memmap", progress=False)
    state["model.norm.weight"] = torch.ones(7)
    (tmp_path / "b").mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "b" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.norm.weight'.*shape \[7\].*expects \[32\]"):
        load_checkpoint_and_dispatch(_empty(), tmp_path / "b", MAP, storage="memmap", progress=False)
