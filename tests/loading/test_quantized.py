"""Checkpoints saved by transformers with a quantization config (torchao int8/int4, bitsandbytes 4-bit/8-bit) offload
packed: every store and policy gives the logits and tokens of transformers' own in-memory quantized model bit for bit,
the plan counts the packed bytes, and an unsupported method or a missing library is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import offload_core
from offload_core.loading.quantized import SUPPORTED, QuantizationError
from offload_core.planning.sizing import compute_module_sizes
from offload_core.loading.checkpoint import Checkpoint
from tests.checkpoints import STORES
from tests.quantized_checkpoints import METHODS, float_folder, quantized_folder

IDS = torch.tensor([[1, 5, 9, 17, 33, 2, 70]])
#: room for the KV cache and activations of the tiny model's generation in float32, beside the weights
RUN_ROOM = 260_000
POLICIES = ["align_per_call", "chained", "functional_call", "prefetch"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("quantized")


@pytest.fixture(scope="module")
def reference(root):
    """method -> (folder, logits, greedy tokens) of transformers' in-memory model of the quantized checkpoint."""
    made = {}

    def get(method: str):
        if method not in made:
            folder = quantized_folder(root, method)
            model = transformers.AutoModelForCausalLM.from_pretrained(folder)
            with torch.inference_mode():
                logits = model(IDS).logits
                tokens = model.generate(IDS, max_new_tokens=4, do_sample=False)
            made[method] = (folder, logits, tokens)
        return made[method]

    return get


def _itemsize(folder) -> int:
    return transformers.AutoConfig.from_pretrained(folder).dtype.itemsize


def _offloaded(folder, storage, policy):
    """The checkpoint in ``folder`` with a cpu budget of half its packed bytes beside the run's room (pinned_cpu holds
    the disk tier in memory too: over that budget, warned)."""
    with Checkpoint.open(folder) as checkpoint:
        budget = {"cpu": checkpoint.total_bytes() // 2 + RUN_ROOM * _itemsize(folder) // 4}
    return offload_core.from_pretrained(folder, budget, {"storage": storage, "policy": policy, "over_budget": "warn"})


def _check(reference, method, storage, policy):
    folder, logits, tokens = reference(method)
    model = _offloaded(folder, storage, policy)
    assert "disk" in set(model.offload_plan.device_map.values())  # some blocks are offloaded
    with torch.inference_mode():
        assert torch.equal(model(IDS).logits, logits)
        assert torch.equal(model.generate(IDS, max_new_tokens=4, do_sample=False), tokens)


#: every method with every store, each store with every policy (the policy turning with the method)
COVERING = [
    (method, storage, POLICIES[(m + s) % len(POLICIES)])
    for m, method in enumerate(METHODS)
    for s, storage in enumerate(STORES)
]


@pytest.mark.slow
@pytest.mark.parametrize("method,storage,policy", COVERING)
def test_every_store_and_policy_matches_the_in_memory_quantized_model(reference, method, storage, policy):
    _check(reference, method, storage, policy)


@pytest.mark.parametrize(
    "method,storage,policy",
    [
        ("torchao-int8", "pinned_cpu", "functional_call"),
        ("torchao-int4", "safetensors", "prefetch"),
        ("bnb-nf4", "memmap", "chained"),
        ("bnb-int8", "safetensors", "align_per_call"),
        ("bnb-fp4", "memmap", "functional_call"),
        ("bnb-nf4-bf16", "memmap", "prefetch"),
        ("torchao-int8-sharded", "safetensors", "align_per_call"),  # its metadata in each shard
        ("bnb-nf4-sharded", "pinned_cpu", "prefetch"),
    ],
)
def test_each_method_matches_the_in_memory_quantized_model(reference, method, storage, policy):
    _check(reference, method, storage, policy)


@pytest.mark.parametrize("method", ["torchao-int8", "bnb-nf4-bf16"])
def test_the_plan_counts_the_packed_bytes_of_an_offloaded_block(reference, root, method):
    folder = reference(method)[0]
    model = _offloaded(folder, "safetensors", "align_per_call")
    plan = model.offload_plan
    offloaded = [name for name, device in plan.device_map.items() if device == "disk"]
    with Checkpoint.open(folder) as checkpoint:
        saved = {key: checkpoint.nbytes(key) for key in checkpoint.keys()}
    with Checkpoint.open(float_folder(root, METHODS[method][2])) as checkpoint:
        float_saved = {key: checkpoint.nbytes(key) for key in checkpoint.keys()}
    block = "model.layers.2"
    packed = sum(n for key, n in saved.items() if key.startswith(block + "."))
    assert any(name == block or name.startswith(block + ".") or block.startswith(name + ".") for name in offloaded)
    # scales and quantization state in float32 too: counted as saved, not in the run's bfloat16
    assert compute_module_sizes(model, dtype=plan.dtype)[block] == packed
    blocks = [sum(n for key, n in saved.items() if key.startswith(f"model.layers.{i}.")) for i in range(3)]
    assert plan.largest_block == max(blocks)  # quantization states of a few bytes more or less
    assert packed < 0.6 * sum(n for key, n in float_saved.items() if key.startswith(block + "."))
    library = METHODS[method][0]
    assert any(
        line.startswith(f"quantized ({library}): 21 layers hold their weights packed") for line in plan.conversion
    )
    assert plan.predicted_bytes_per_token == sum(
        n for key, n in saved.items() if any(key.startswith(name + ".") for name in offloaded)
    )


def test_a_quantization_method_we_do_not_run_is_refused_naming_it(root, tmp_path):
    folder = tmp_path / "gptq"
    folder.mkdir()
    for file in float_folder(root).iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match="quantized with 'gptq'.*torchao or bitsandbytes"):
        _offloaded(folder, "safetensors", None)


def test_a_missing_quantization_library_is_named_with_the_install_line(reference, monkeypatch):
    folder = reference("torchao-int8")[0]
    monkeypatch.setitem(SUPPORTED, "torchao", "offload_core_no_such_package")
    with pytest.raises(QuantizationError, match=r"needs the offload_core_no_such_package package: install it"):
        _offloaded(folder, "safetensors", None)


def test_a_library_transformers_needs_beside_bitsandbytes_is_named_too(reference, monkeypatch):
    from offload_core.loading.quantized import NEEDS

    folder = reference("bnb-nf4")[0]
    monkeypatch.setitem(NEEDS, "bitsandbytes", ("bitsandbytes", "offload_core_no_such_package"))
    with pytest.raises(QuantizationError, match=r"needs the offload_core_no_such_package package: install it"):
        _offloaded(folder, "safetensors", None)


@pytest.mark.parametrize("method", ["torchao-int8", "bnb-nf4"])
def test_the_prediction_times_a_packed_block_as_it_runs(reference, method):
    from offload_core.loading.quantized import random_copy
    from offload_core.plan.calibrate import compute_times
    from offload_core.plan.model import build_empty_model

    folder = reference(method)[0]
    model, dtype, _ = build_empty_model(folder, None)
    block = random_copy(model.model.layers[0], dtype, torch.device("cpu"))
    with Checkpoint.open(folder) as checkpoint:
        saved = {key: checkpoint.dtype(key) for key in checkpoint.keys() if key.startswith("model.layers.0.")}
    renamed = model.offload_packed_renames  # bitsandbytes' ``weight.absmax`` is held as ``weight__absmax``
    held = {
        renamed.get(f"model.layers.0.{name}", f"model.layers.0.{name}"): t.dtype
        for name, t in block.state_dict().items()
    }
    assert held == saved  # the packed tensors as saved: codes, scales and quantization state
    assert compute_times(model, ["LlamaDecoderLayer"], dtype, torch.device("cpu"), 1, 4)["block_s"] > 0
