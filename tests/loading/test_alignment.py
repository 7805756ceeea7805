"""Weights are handed to the model at the address offset its in-memory load gives them: single-token (matrix-vector)
float32 logits equal transformers' ``from_pretrained`` bit for bit, whatever the store and policy, on a checkpoint
whose tensors lie at offsets that are not 16-byte aligned (AVX-512 kernels sum those in another order)."""

from __future__ import annotations

import itertools
import json
import struct

import pytest
import torch
from torch.overrides import TorchFunctionMode
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

import offload_core
from offload_core import init_empty_weights, load_checkpoint_and_dispatch
from offload_core.alignment import (
    ALIGNMENT,
    address_offset,
    assume_kernels_depend_on_alignment,
    empty_at,
    kernels_depend_on_alignment,
    misplaced,
    placed,
)
from offload_core.storage.base import StoreContext
from offload_core.storage.folder import FolderStore
from offload_core.storage.memory import HostMemoryStore

STORES = ["memmap", "safetensors", "pinned_cpu"]
POLICIES = ["align_per_call", "prefetch", "chained", "functional_call", "experts"]
#: every store x policy; the quick subset keeps each policy once, the store turning (so each store too), the rest slow
GRID = [
    pytest.param(store, policy, marks=() if i == j % len(STORES) else pytest.mark.slow)
    for (i, store), (j, policy) in itertools.product(enumerate(STORES), enumerate(POLICIES))
]


def _file_offsets(path) -> list[int]:
    """Each tensor's byte offset in a safetensors file."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return [8 + length + info["data_offsets"][0] for name, info in header.items() if name != "__metadata__"]


class LinearWeightOffsets(TorchFunctionMode):
    """Records the address offset of the weight of every ``linear`` call, in call order: where the kernels find it."""

    def __init__(self) -> None:
        super().__init__()
        self.offsets: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            self.offsets.append(address_offset(weight))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A float32 llama saved by transformers in shards, some tensors 8 bytes off a 16-byte boundary; its logits
    for one token as ``from_pretrained`` computes them."""
    folder = tmp_path_factory.mktemp("aligned") / "ckpt"
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="40KB")
    offsets = [o for shard in folder.glob("*.safetensors") for o in _file_offsets(shard)]
    assert any(o % 16 for o in offsets), "the checkpoint must hold tensors off a 16-byte boundary"
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[5]])
    with torch.no_grad(), LinearWeightOffsets() as seen:
        logits = reference(ids).logits
    assert any(o % 16 for o in seen.offsets), "some weights are used in place off a 16-byte boundary"
    return folder, ids, logits, seen.offsets


def _offloaded(folder, store, policy, tmp_path):
    """The tiny model with every store and policy, part of it on disk (pinned_cpu holds that in memory: over the
    budget, warned)."""
    options = {"storage": store, "policy": policy, "offload_folder": tmp_path / "off", "execution_device": "cpu"}
    return offload_core.from_pretrained(folder, {"cpu": 60_000}, {**options, "headroom": 0, "over_budget": "warn"})


@pytest.mark.parametrize("store,policy", GRID)
def test_single_token_logits_equal_from_pretrained(llama, store, policy, tmp_path):
    folder, ids, want, _ = llama
    model = _offloaded(folder, store, policy, tmp_path)
    try:
        assert {"cpu", "disk"} <= set(model.hf_device_map.values())
        assert model.generation_config.disable_compile  # generate() never compiles through the hooks
        with torch.no_grad():
            got = model(ids).logits
    finally:
        model.offload_state.remove()
    assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("store,policy", GRID)
def test_weights_reach_the_kernels_at_their_reference_offsets(llama, store, policy, tmp_path):
    """Where the kernels depend on alignment (the probe's answer forced, so on every machine), every offloaded or
    resident weight is handed to ``linear`` at the address offset ``from_pretrained`` gives it."""
    folder, ids, want, reference = llama
    with assume_kernels_depend_on_alignment(True):
        model = _offloaded(folder, store, policy, tmp_path)
        try:
            with torch.no_grad(), LinearWeightOffsets() as seen:
                got = model(ids).logits
        finally:
            model.offload_state.remove()
    assert seen.offsets == reference
    assert torch.equal(got, want)


def test_where_the_kernels_do_not_care_a_memmap_folder_still_lies_at_the_reference_offsets(llama, tmp_path):
    """Without the need (the probe's answer forced to no) nothing is copied, yet the memmap store's files put each
    tensor at its reference offset, so the kernels see what ``from_pretrained`` gives them on any machine."""
    folder, ids, want, reference = llama
    with assume_kernels_depend_on_alignment(False):
        model = _offloaded(folder, "memmap", "align_per_call", tmp_path)
        try:
            with torch.no_grad(), LinearWeightOffsets() as seen:
                got = model(ids).logits
        finally:
            model.offload_state.remove()
    assert seen.offsets == reference
    assert torch.equal(got, want)


def test_the_probes_answer_can_be_assumed_for_a_block_in_every_thread():
    measured = kernels_depend_on_alignment(torch.float32)
    for answer in (True, False):
        with assume_kernels_depend_on_alignment(answer):
            seen = []
            worker = __import__("threading").Thread(
                target=lambda: seen.append(kernels_depend_on_alignment(torch.float32))
            )
            worker.start()
            worker.join(timeout=30)
            assert seen == [answer] and kernels_depend_on_alignment(torch.bfloat16) is answer
            assert kernels_depend_on_alignment(torch.int64) is False  # integer kernels never round
        assert kernels_depend_on_alignment(torch.float32) is measured


def test_a_plain_module_loaded_from_a_file_matches_its_load_state_dict(tmp_path):
    """A module that is not a transformers model is loaded in memory with ``load_state_dict``, which copies
    every tensor into aligned memory: offloaded or resident, it computes as that copy does."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(24, 40), torch.nn.Linear(40, 24), torch.nn.Linear(24, 40)]
    reference = torch.nn.Sequential(*layers).eval()
    path = tmp_path / "model.safetensors"
    for pad in range(16):  # a header length that puts the tensors 8 bytes off a 16-byte boundary
        save_file(dict(reference.state_dict()), str(path), metadata={"pad": "x" * pad})
        if all(o % 16 for o in _file_offsets(path)):
            break
    assert all(o % 16 for o in _file_offsets(path))
    x = torch.randn(1, 24)
    with torch.no_grad():
        want = reference(x)
    for store in STORES:
        with init_empty_weights():
            model = torch.nn.Sequential(
                torch.nn.Linear(24, 40), torch.nn.Linear(40, 24), torch.nn.Linear(24, 40)
            ).eval()
        load_checkpoint_and_dispatch(
            model,
            tmp_path,
            device_map={"0": "cpu", "1": "disk", "2": "disk"},
            storage=store,
            offload_folder=tmp_path / f"off-{store}",
            execution_device="cpu",
            progress=False,
        )
        with torch.no_grad():
            got = model(x)
        model.offload_state.remove()
        assert torch.equal(got, want), store


def test_empty_at_starts_where_asked():
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        for offset in range(0, ALIGNMENT, dtype.itemsize * 4):
            tensor = empty_at((3, 5), dtype, offset)
            assert address_offset(tensor) == offset and tensor.shape == (3, 5) and tensor.dtype == dtype


@pytest.mark.parametrize("kernels_care", [True, False])
def test_placed_copies_only_where_the_kernels_care(kernels_care):
    raw = torch.randn(200)
    view = raw[2 : 2 + 64].view(8, 8)  # 8 bytes past an aligned start
    assert address_offset(view) == (address_offset(raw) + 8) % ALIGNMENT
    with assume_kernels_depend_on_alignment(kernels_care):
        for target in (0, 24, address_offset(view) + ALIGNMENT):
            moved = placed(view, target)
            assert torch.equal(moved, view)
            if kernels_care and target % ALIGNMENT != address_offset(view):
                assert misplaced(view, target)
                assert address_offset(moved) == target % ALIGNMENT and moved.data_ptr() != view.data_ptr()
            else:
                assert not misplaced(view, target) and moved is view
        assert placed(view, address_offset(view)) is view
        assert not misplaced(torch.empty(0), 8)  # no bytes to place
        ints = torch.arange(16)[1:9]
        assert placed(ints, 0) is ints  # integer kernels never round


@pytest.mark.parametrize("kind", ["memmap", "pinned_cpu"])
def test_stores_hand_out_a_put_tensor_at_its_own_offset(kind, tmp_path):
    """An in-memory model's tensor keeps its address offset (its in-memory reference) through a store."""
    raw = torch.randn(600)
    weight = raw[2 : 2 + 48 * 10].view(48, 10)  # 8 bytes off
    context = StoreContext(names=["w"], offload_folder=tmp_path / "off", fingerprint={"t": 1})
    store = FolderStore(context) if kind == "memmap" else HostMemoryStore(context)
    store.put("w", weight)
    store.finalize()
    x = torch.randn(1, 10)
    assert store.offset("w") == address_offset(weight) != 0
    with assume_kernels_depend_on_alignment(True):
        assert address_offset(store["w"]) == address_offset(weight)
    if kind == "memmap":  # its file puts it at that offset: no copy is needed where the kernels do not care
        with assume_kernels_depend_on_alignment(False):
            assert address_offset(store["w"]) == address_offset(weight)
    assert torch.equal(torch.nn.functional.linear(x, store["w"]), torch.nn.functional.linear(x, weight))
    store.close()


@pytest.mark.parametrize(
    "store,policy",
    [
        ("memmap", "align_per_call"),
        ("safetensors", "prefetch"),
        ("pinned_cpu", "functional_call"),
        ("memmap", "chained"),
    ],
)
def test_remove_restores_the_address_offsets_from_pretrained_gives(llama, store, policy, tmp_path):
    """After ``offload_state.remove()`` every weight sits at the address offset ``from_pretrained`` gives it and
    the model computes as that one does, bit for bit."""
    folder, ids, want, _ = llama
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    offsets = {name: address_offset(p) for name, p in reference.named_parameters()}
    assert len(set(offsets.values())) > 1, "the checkpoint must put weights at several offsets"
    model = _offloaded(folder, store, policy, tmp_path)
    assert "disk" in model.hf_device_map.values()
    model.offload_state.remove()
    assert {name: address_offset(p) for name, p in model.named_parameters()} == offsets
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)


def test_remove_restores_a_bert_encoder_as_from_pretrained_loads_it(tmp_path):
    """The same for an encoder (no tied head, layer norms with biases), saved in shards by transformers."""
    from transformers import AutoModel, BertConfig

    config = BertConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=200
    )
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(tmp_path / "bert", max_shard_size="40KB")
    reference = AutoModel.from_pretrained(tmp_path / "bert").eval()
    offsets = {name: address_offset(p) for name, p in reference.named_parameters()}
    model = _offloaded(tmp_path / "bert", "memmap", "align_per_call", tmp_path)
    assert "disk" in model.hf_device_map.values()
    model.offload_state.remove()
    assert {name: address_offset(p) for name, p in model.named_parameters()} == offsets
    ids = torch.tensor([[3, 7, 11]])
    with torch.no_grad():
        assert torch.equal(model(ids).last_hidden_state, reference(ids).last_hidden_state)


def test_a_memmap_folder_maps_each_tensor_at_its_reference_offset_without_a_copy(llama, tmp_path):
    """Each file holds its tensor's bytes at its reference offset, so the mapping itself is handed out (no copy per
    forward) at the offset ``from_pretrained`` gives the tensor, in a new folder and a reused one."""
    folder, _, _, _ = llama
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    want = {name: address_offset(p) for name, p in reference.state_dict().items()}
    for build in ("new", "reused"):
        model = offload_core.from_pretrained(
            folder,
            offload={"storage": "memmap", "offload_folder": tmp_path / "off", "execution_device": "cpu", "headroom": 0},
            max_memory={"cpu": 60_000},
        )
        store = model.offload_state.store
        assert store.reused == (build == "reused") and len(store) > 4
        assert {store.offset(n) for n in store} - {0}, "the checkpoint must put offloaded weights off 64 bytes"
        for name in store:
            handed = store[name]
            assert handed.data_ptr() == store._mapped(name).data_ptr(), name  # the mapping itself, not a copy
            assert address_offset(handed) == store.offset(name) == want[name], name
        model.offload_state.remove()
