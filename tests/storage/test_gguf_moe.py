"""storage=gguf on mixture-of-experts GGUF files (qwen3moe, qwen2moe, as llama.cpp writes them: each projection of the
experts one 3-D tensor; transformers concatenates gate and up into its fused ``gate_up_proj``): read in place, the
model is transformers' own in-memory GGUF model bit for bit under every policy; ``hook=experts`` reads a routed
expert's quantized blocks alone and counts them; a file whose experts disagree with its metadata is one line."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

import offload_core
import offload_core.registry.manager
from offload_core.errors import CheckpointError
from offload_core.loading.gguf_checkpoint import GGUFCheckpoint
from offload_core.module_hooks.experts import ExpertsConfig, is_fused_experts
from offload_core.module_hooks.experts.policy import Experts
from offload_core.storage.gguf.device import ExpertBlocks
from tests.gguf_files import half_offloaded_map, transformers_model, write_gguf
from tests.gpu_budgets import on_gpu
from tests.outputs import assert_same_outputs

# whole runs of every policy (the quick subset stays under a minute)
pytestmark = pytest.mark.slow

#: the experts' projections of several types (down of another type than gate and up, as llama.cpp's mixes do)
TYPES = {"ffn_down_exps": int(T.Q6_K), "ffn_gate_exps": int(T.Q4_K), "ffn_up_exps": int(T.Q4_K)}
IDS = torch.tensor([[256, 5, 77, 100, 258, 259, 33, 40]])
LAYERS = 2


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf_moe")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OFFLOAD_CORE_CACHE", str(folder / "cache"))
        path = write_gguf(folder / "qwen3moe.gguf", "qwen3_moe", TYPES, default=int(T.Q8_0), layers=LAYERS)
        yield path, transformers_model(path)


def _load(path, policy, resident="dequantized", dtype=None):
    storage = offload_core.registry.manager.get_registry().create("storage", "gguf", {"resident": resident})
    offload = {"storage": storage, "policy": policy, "device_map": half_offloaded_map(LAYERS), "over_budget": "warn"}
    return offload_core.from_pretrained(path, {"cpu": "3MiB"}, offload, dtype=dtype)


def _expert_bytes(model) -> tuple[int, int]:
    """One expert of layer 1's fused tensors: its quantized bytes in the file, and its float32 rows' bytes."""
    checkpoint = model.offload_state.store.checkpoint
    module = next(m for name, m in model.named_modules() if is_fused_experts(m) and name.startswith("model.layers.1"))
    keys = [f"model.layers.1.mlp.experts.{name}" for name, p in module.named_parameters() if p.dim() == 3]
    quantized = sum(checkpoint.stored_nbytes(key) for key in keys) // module.num_experts
    return quantized, sum(p[0].numel() * 4 for p in module.parameters() if p.dim() == 3)


@pytest.mark.parametrize(
    ("policy", "resident"),
    [
        ("experts", "dequantized"),
        ("experts", "quantized"),
        ("prefetch", "quantized"),
        ("align_per_call", "dequantized"),
    ],
)
def test_an_moe_gguf_read_in_place_is_transformers_in_memory_model_bit_for_bit(moe, policy, resident):
    path, reference = moe
    model = _load(path, policy, resident)
    try:
        assert "disk" in set(model.hf_device_map.values())
        assert model.offload_state.store.checkpoint.merged  # gate and up read from their own tensors, not converted
        assert_same_outputs(model, reference, IDS)
    finally:
        model.offload_state.release()


def test_a_bfloat16_run_rounds_the_merged_experts_as_transformers_load_does(moe):
    path, _ = moe
    reference = transformers_model(path, torch.bfloat16)
    model = _load(path, "experts", dtype=torch.bfloat16)
    try:
        assert_same_outputs(model, reference, IDS)
    finally:
        model.offload_state.release()


def test_an_expert_is_dequantized_from_its_own_blocks(moe):
    path, _ = moe
    checkpoint = GGUFCheckpoint.open_gguf(path)
    try:
        fused = [key for key in checkpoint.keys() if key.endswith("experts.gate_up_proj")]
        assert len(fused) == LAYERS and all(
            checkpoint.gguf_parts(key)[0].endswith("ffn_gate_exps.weight") for key in fused
        )
        for key in [*fused, fused[0].replace("gate_up_proj", "down_proj")]:
            whole = checkpoint.get(key)
            experts = whole.shape[0]
            ranges = checkpoint.byte_ranges(key)
            assert checkpoint.stored_nbytes(key) == sum(end - start for _, start, end in ranges) < whole.numel()
            for expert in range(experts):
                out = torch.full(whole.shape[1:], float("nan"))
                assert torch.equal(checkpoint.read_expert_into(key, expert, out), whole[expert])
                for blocks, (_, start, end) in zip(checkpoint.expert_blocks(key, expert), ranges, strict=True):
                    assert blocks.numel() * experts == end - start  # one expert's share of each part, nothing more
    finally:
        checkpoint.close()


def test_hook_experts_moves_each_routed_experts_quantized_bytes(moe, tmp_path):
    """Without a cache or guesses, each expert one token routes to is one read of its blocks: the counters count
    those bytes, not the dequantized rows'."""
    path, reference = moe
    storage = offload_core.registry.manager.get_registry().create("storage", "gguf", {})
    policy = Experts(ExpertsConfig(cache_slots=0, guess="none", whole_fraction=1.0))
    offload = {"storage": storage, "policy": policy, "device_map": half_offloaded_map(LAYERS), "over_budget": "warn"}
    model = offload_core.from_pretrained(path, {"cpu": "3MiB"}, offload)
    try:
        with torch.no_grad():
            assert torch.equal(model(IDS[:, :1]).logits, reference(IDS[:, :1]).logits)  # some experts, not all
        counters = model.offload_state.handle.counters()
        quantized, dequantized = _expert_bytes(model)
        assert counters["expert_bytes"] == counters["expert_misses"] * quantized > 0
        assert quantized * 3 < dequantized
    finally:
        model.offload_state.release()


def test_qwen2moe_with_its_shared_expert_reads_in_place_and_converts_alike(tmp_path, monkeypatch):
    """qwen2moe's shared expert and its gate (a vector in the file, a row in the model): in place under
    ``hook=experts``, and converted once by the default store, both transformers' model bit for bit."""
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    types = {**TYPES, "ffn_down_exps": int(T.Q8_0)}  # down's rows of 1408: no whole K-quant blocks
    path = write_gguf(tmp_path / "qwen2moe.gguf", "qwen2_moe", types, default=int(T.Q8_0), layers=LAYERS)
    reference = transformers_model(path)
    for offload in ({"storage": "gguf", "policy": "experts"}, {"policy": "experts"}):
        offload = {**offload, "device_map": half_offloaded_map(LAYERS), "over_budget": "warn"}
        model = offload_core.from_pretrained(path, {"cpu": "3MiB"}, offload)
        try:
            assert_same_outputs(model, reference, IDS)
        finally:
            model.offload_state.release()


def test_experts_that_disagree_with_the_metadata_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(
        tmp_path / "bad.gguf", "qwen3_moe", default=int(T.Q8_0), layers=LAYERS, metadata={"expert_count": 8}
    )
    with pytest.raises(CheckpointError) as error:
        offload_core.from_pretrained(path, {"cpu": "3MiB"}, {"storage": "gguf", "over_budget": "warn"})
    message = str(error.value)
    assert "\n" not in message and str(path) in message and "written for another configuration" in message


@pytest.mark.parametrize(
    ("policy", "resident", "dtype"),
    [
        ("experts", "dequantized", torch.float32),
        ("experts", "quantized", torch.bfloat16),  # held in page-locked memory, rounded on the device
        ("prefetch", "dequantized", torch.float32),
    ],
)
def test_on_a_gpu_the_experts_cross_quantized_and_are_dequantized_there(moe, policy, resident, dtype, fake_gpu):
    """A GPU run (the fake accelerator): every offloaded tensor crosses as its quantized blocks, the merged gate and
    up too (decoded expert by expert into transformers' concatenation), a routed expert's alone under ``experts``;
    the logits and tokens are the same, the plan prices every type's dequantization on the device, and the device
    stays within its budget with the decoding scratch the plan reserved."""
    path, reference = moe
    if dtype != torch.float32:
        reference = transformers_model(path, dtype)
    fake = fake_gpu(count=1, memory="1GiB")
    on_device = {name: 0 if where == "cpu" else "cpu" for name, where in half_offloaded_map(LAYERS).items()}
    storage = offload_core.registry.manager.get_registry().create("storage", "gguf", {"resident": resident})
    offload = {"storage": storage, "policy": policy, "device_map": on_device, "execution_device": fake.device(0)}
    model = offload_core.from_pretrained(
        path, offload={**offload, "progress": False}, max_memory={0: "64MiB"}, dtype=dtype
    )
    try:
        with torch.no_grad():
            ids = IDS.to(fake.device(0))
            assert torch.equal(model(ids).logits.cpu(), reference(IDS).logits)
            want = reference.generate(IDS, max_new_tokens=4, do_sample=False)
            assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False).cpu(), want)
        store = model.offload_state.store
        merged = [key for key in store if key in store.checkpoint.merged]
        assert merged and all(isinstance(store.packed(key), ExpertBlocks) for key in merged)
        on_device = {row["type"]: row["device"] for row in model.offload_plan.dequant}
        assert on_device == {"Q4_K": True, "Q6_K": True, "Q8_0": True, "F32": True}
        if policy == "experts":
            layers = model.offload_state.handle.layers
            assert layers and all(layer.packed is not None for layer in layers)
        assert fake.max_memory_allocated(0) <= 64 * 2**20
    finally:
        model.offload_state.release()


def test_on_a_gpu_a_routed_expert_moves_its_quantized_bytes(moe, fake_gpu):
    """Without a cache or guesses, each expert a token routes to crosses as its blocks: the counters count those
    bytes, and the rows decoded on the device are transformers' (the logits)."""
    path, reference = moe
    fake = fake_gpu(count=1, memory="1GiB")
    on_device = {name: 0 if where == "cpu" else "cpu" for name, where in half_offloaded_map(LAYERS).items()}
    policy = Experts(ExpertsConfig(cache_slots=0, guess="none", whole_fraction=1.0))
    offload = {"storage": "gguf", "policy": policy, "device_map": on_device, "execution_device": fake.device(0)}
    model = offload_core.from_pretrained(path, offload={**offload, "progress": False}, max_memory={0: "64MiB"})
    try:
        with torch.no_grad():
            assert torch.equal(model(IDS[:, :1].to(fake.device(0))).logits.cpu(), reference(IDS[:, :1]).logits)
        counters = model.offload_state.handle.counters()
        assert counters["expert_bytes"] == counters["expert_misses"] * _expert_bytes(model)[0] > 0
    finally:
        model.offload_state.release()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("elements", [256, 3000, 2**22])
def test_the_device_passes_decode_an_expert_as_the_host_does(moe, dtype, elements):
    """An expert's rows decoded through scratch of any size (a run of rows a pass, whole experts a pass) are what the
    host's read of that expert gives, for the merged gate and up and for down; so is the whole tensor."""
    path, _ = moe
    storage = offload_core.registry.manager.get_registry().create("storage", "gguf", {})
    offload = {"storage": storage, "device_map": half_offloaded_map(LAYERS), "over_budget": "warn"}
    model = offload_core.from_pretrained(path, {"cpu": "3MiB"}, offload, dtype=dtype)
    try:
        store = model.offload_state.store
        keys = [key for key in store if key.endswith(("gate_up_proj", "down_proj"))]
        assert keys
        for key in keys:
            packed = store.packed_experts(key)
            scratch = packed.new_scratch(torch.device("cpu"), max(elements, packed.cols))
            shape, _ = store.spec(key)
            whole = torch.full(shape, float("nan"), dtype=dtype)
            packed.decode_on_device(whole, scratch, key)
            for expert in range(shape[0]):
                got, want = torch.full(shape[1:], float("nan"), dtype=dtype), torch.empty(shape[1:], dtype=dtype)
                packed.decode_expert(expert, got, scratch)
                store.read_expert(key, expert, want)
                assert torch.equal(got, want) and torch.equal(whole[expert], want)
    finally:
        model.offload_state.release()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", ["experts", "prefetch"])
def test_on_cuda_the_experts_cross_quantized_and_give_the_gpu_models_logits(moe, policy):
    """On CUDA: half the MoE model streamed as its quantized blocks (a routed expert's alone under ``experts``) and
    dequantized on the GPU gives the logits and tokens of transformers' own model of the file on that GPU."""
    path, _ = moe
    reference = transformers_model(path).to("cuda")
    ids = IDS.to("cuda")
    with torch.no_grad():
        logits = reference(ids).logits
        tokens = reference.generate(ids, max_new_tokens=4, do_sample=False)
    del reference
    on_device = {name: 0 if where == "cpu" else "cpu" for name, where in half_offloaded_map(LAYERS).items()}
    offload = {"storage": "gguf", "policy": policy, "device_map": on_device, "execution_device": "cuda:0"}
    model = offload_core.from_pretrained(path, offload=offload, max_memory={0: on_gpu(128 * 2**20), "cpu": "1GiB"})
    try:
        with torch.no_grad():
            assert torch.equal(model(ids).logits, logits)
            assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), tokens)
        if policy == "experts":
            assert all(layer.packed is not None for layer in model.offload_state.handle.layers)
    finally:
        model.offload_state.remove()
