"""``storage.compute=quantized`` on tiny GGUF files built with gguf-py: the packed tensors are PyTorch's own int4
layout and the GGUF values, the model's logits come close to (not equal to) the exact mode's with the same greedy
tokens, what moves per token is the packed blocks, and what cannot apply is one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

import offload_core
from offload_core.errors import ConfigError, OffloadError
from offload_core.loading.checkpoint import Checkpoint
from offload_core.registry.manager import get_registry
from offload_core.storage.gguf.dequant import dequantize_into
from offload_core.storage.gguf.qlinear import QuantLinear, QuantSpec, pack_into
from offload_core.storage.gguf.rates import random_blocks
from tests.gguf_files import half_offloaded_map, transformers_model, write_gguf
from tests.gpu_budgets import on_gpu

TYPES = {"ffn_down": int(T.Q4_K), "ffn_up": int(T.Q8_0), "attn_k": int(T.Q4_0), "ffn_gate": int(T.Q5_0)}
IDS = torch.tensor([[256, 5, 77, 100, 258, 259, 33, 40]])


def quantized():
    return get_registry().create("storage", "gguf", {"compute": "quantized"})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-q")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OFFLOAD_CORE_CACHE", str(folder / "cache"))
        path = write_gguf(folder / "llama.gguf", "llama", TYPES, default=int(T.Q4_1))
        yield path, transformers_model(path)


@pytest.mark.parametrize("kind", [int(T.Q4_0), int(T.Q4_1), int(T.Q4_K), int(T.Q8_0)])
def test_the_packed_layer_computes_the_gguf_weight(kind):
    """Random valid blocks of each type: the int4 layout is what torch's own packing of the GGUF values gives, and
    the layer's product is the dequantized weight's to within the kernels' bfloat16 rounding."""
    out_features, in_features = 128, 512
    raw = random_blocks(kind, out_features * in_features, seed=kind)
    values = dequantize_into(raw, kind, torch.empty(out_features * in_features)).view(out_features, in_features)
    spec = QuantSpec(kind, out_features, in_features)
    layer = QuantLinear(spec, bias=False, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for part in ("qweight", "qscale"):
            pack_into(raw, spec, part, getattr(layer, part))
    if spec.bits == 4:  # the layout torch's own packing gives the GGUF 4-bit values, read here with numpy
        assert torch.equal(layer.qweight, torch._convert_weight_to_int4pack_for_cpu(_codes(raw, kind), 1))
    x = torch.randn(3, in_features)
    with torch.no_grad():
        got, want = layer(x), x @ values.t()
    assert got.dtype == torch.float32 and not torch.equal(got, want)
    error = ((got - want).norm() / want.norm()).item()  # int4: 0.3% (bfloat16 roundings); Q8_0 requantized: 0.9%
    assert error < (0.006 if spec.bits == 4 else 0.015)


def _codes(raw: torch.Tensor, kind: int) -> torch.Tensor:
    """The 4-bit values of Q4_0 / Q4_1 / Q4_K blocks in element order (``(128, 512)`` int32)."""
    blocks = raw.numpy().reshape(-1, {2: 18, 3: 20, 12: 144}[kind])
    if kind == int(T.Q4_K):
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
        codes = np.concatenate([qs & 15, qs >> 4], axis=2)
    else:
        qs = blocks[:, 2 if kind == int(T.Q4_0) else 4 :]
        codes = np.concatenate([qs & 15, qs >> 4], axis=1)
    return torch.from_numpy(codes.reshape(128, 512).astype(np.int32))


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("policy", ["align_per_call", "prefetch"])
def test_logits_close_to_the_exact_mode_and_the_same_greedy_tokens(tiny, policy):
    path, reference = tiny
    offload = {"storage": quantized(), "policy": policy, "device_map": half_offloaded_map(), "over_budget": "warn"}
    model = offload_core.from_pretrained(path, {"cpu": "1MiB"}, offload)
    try:
        layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
        assert len(layers) == 3 * 6  # q, o, v (Q4_1), k (Q4_0), down (Q4_K), up (Q8_0): not gate (Q5_0), lm_head
        assert {m.bits for m in layers} == {4, 8}
        assert {"cpu", "disk"} <= set(model.hf_device_map.values())
        got, want = _logits(model), _logits(reference)
        assert not torch.equal(got, want)
        assert (got - want).abs().max() < 0.05 * want.abs().max()
        with torch.no_grad():
            tokens = model.generate(IDS, max_new_tokens=6, do_sample=False)
            expected = reference.generate(IDS, max_new_tokens=6, do_sample=False)
        assert torch.equal(tokens, expected)
    finally:
        model.offload_state.release()


def test_what_moves_is_the_packed_blocks_and_the_budget_counts_them(tiny):
    path, _ = tiny
    model = offload_core.from_pretrained(
        path, offload={"storage": quantized(), "headroom": 0, "over_budget": "warn"}, max_memory={"cpu": "1MiB"}
    )
    try:
        store = model.offload_state.store
        packed = [name for name in store if name.endswith((".qweight", ".qscale"))]
        assert packed and not any(name.endswith("proj.weight") and "gate" not in name for name in store)
        with Checkpoint.open(path) as exact:
            weights = {name.rsplit(".", 1)[0] + ".weight" for name in packed}
            blocks = sum(exact.stored_nbytes(key) for key in weights)
            floats = sum(exact.nbytes(key) for key in weights)
        assert model.offload_plan.storage.quantized_compute
        read = sum(store.moved_nbytes(name) for name in packed)
        assert read == blocks  # the two packed tensors of a weight read its blocks once
        assert sum(torch.Size(store.spec(n)[0]).numel() * store.spec(n)[1].itemsize for n in packed) * 5 < floats
        stats = model.offload_state.stats
        stats.reset()
        _logits(model, IDS[:, :1])
        assert stats.bytes == model.offload_plan.predicted_bytes_per_token
        assert stats.bytes == read + sum(store.moved_nbytes(n) for n in store if n not in packed)
        lines = "\n".join(model.offload_plan.conversion)
        assert "computed quantized (storage.compute=quantized): Q4_0 x3 as int4" in lines
        assert "Q8_0 x3 as int8" in lines and "left exact, Q5_0: no packed kernel" in lines
    finally:
        model.offload_state.release()


def test_the_resident_model_packs_once_and_holds_packed_bytes(tiny):
    path, reference = tiny
    model = offload_core.from_pretrained(path, offload={"storage": quantized()}, max_memory={"cpu": "1GiB"})
    try:
        assert set(model.hf_device_map.values()) == {"cpu"}
        layer = model.model.layers[0].mlp.down_proj
        assert isinstance(layer, QuantLinear) and layer.qweight.dtype == torch.uint8
        assert layer.qweight.numel() == layer.in_features * layer.out_features // 2
        assert torch.equal(_logits(model).argmax(-1), _logits(reference).argmax(-1))
    finally:
        model.offload_state.release()


def test_a_checkpoint_that_is_no_gguf_file_is_one_line(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2)
    config.vocab_size = 64
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    with pytest.raises(ConfigError, match=r"storage.compute=quantized computes on a GGUF file") as error:
        offload_core.from_pretrained(tmp_path / "model", offload={"storage": quantized()}, max_memory={"cpu": "1GiB"})
    assert "\n" not in str(error.value)


def test_an_unknown_compute_mode_is_one_line():
    with pytest.raises(OffloadError, match=r"storage.compute='fast' is not one of exact, quantized") as error:
        get_registry().create("storage", "gguf", {"compute": "fast"})
    assert "\n" not in str(error.value)


def test_q_and_k_rows_follow_transformers_processor(tiny):
    """llama's q and k are permuted by transformers' processor as it loads: the packed rows follow it."""
    path, reference = tiny
    with Checkpoint.open(path) as opened:
        from offload_core.loading.gguf_qcompute import compute_quantized
        from offload_core.loading.gguf_checkpoint import naming_model

        model = naming_model(reference.config)
        checkpoint = compute_quantized(model, opened, torch.float32)
        key = "model.layers.1.self_attn.q_proj"
        spec = checkpoint.packed[f"{key}.qweight"][2]
        assert spec.rows is not None and sorted(spec.rows) == list(range(spec.out_features))
        layer = QuantLinear(spec, bias=False, dtype=torch.float32, device="cpu")
        with torch.no_grad():
            for part in ("qweight", "qscale"):
                checkpoint.read_into(f"{key}.{part}", getattr(layer, part))
            x = torch.randn(2, spec.in_features)
            want = x @ reference.get_submodule(key).weight.t()
            got = layer(x)
        assert np.corrcoef(got.flatten(), want.flatten())[0, 1] > 0.999


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_packed_layers_compute_there_with_the_same_greedy_tokens(tiny):
    """The CUDA path (the weight repacked for ``torch._weight_int4pack_mm`` on the device, once per tensor it is
    made from): logits close to the exact mode's, the same greedy tokens, half the model streamed packed."""
    path, reference = tiny
    on_device = {name: 0 if where == "cpu" else "cpu" for name, where in half_offloaded_map().items()}
    model = offload_core.from_pretrained(
        path,
        offload={"storage": quantized(), "execution_device": "cuda", "device_map": on_device, "over_budget": "warn"},
        max_memory={0: on_gpu(64 * 2**20), "cpu": "1GiB"},
    )
    try:
        assert any(isinstance(m, QuantLinear) for m in model.modules())
        got, want = _logits(model, IDS.cuda()).cpu(), _logits(reference)
        assert (got - want).abs().max() < 0.05 * want.abs().max()
        with torch.no_grad():
            tokens = model.generate(IDS.cuda(), max_new_tokens=6, do_sample=False).cpu()
        assert torch.equal(tokens, reference.generate(IDS, max_new_tokens=6, do_sample=False))
    finally:
        model.offload_state.release()


def test_a_head_tied_to_the_embedding_computes_on_a_packed_copy(tmp_path, monkeypatch):
    """A GGUF without ``output.weight`` (transformers ties the head to the embedding, as SmolLM2's): the head computes
    int8 from the Q8_0 embedding's blocks, the embedding keeps its exact values."""
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    types = {"token_embd": int(T.Q8_0)}
    path = write_gguf(tmp_path / "tied.gguf", "llama", types, default=int(T.Q4_0), drop=("output.weight",))
    reference = transformers_model(path)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    model = offload_core.from_pretrained(path, offload={"storage": quantized()}, max_memory={"cpu": "1GiB"})
    try:
        assert isinstance(model.lm_head, QuantLinear) and model.lm_head.bits == 8
        assert torch.equal(model.model.embed_tokens.weight, reference.model.embed_tokens.weight)
        assert "lm_head computes on a packed copy of model.embed_tokens.weight" in "\n".join(
            model.offload_plan.conversion
        )
        got, want = _logits(model), _logits(reference)
        assert not torch.equal(got, want) and (got - want).abs().max() < 0.05 * want.abs().max()
    finally:
        model.offload_state.release()


def test_the_cuda_packing_reads_the_values_back_in_its_order():
    """What ``torch._convert_weight_to_int4pack`` is given on a GPU (checked here on the CPU): the int4 layout's
    values, two a byte, the even one high."""
    from offload_core.storage.gguf.qlinear import device_pairs

    kind = int(T.Q4_1)
    raw = random_blocks(kind, 128 * 512, seed=1)
    spec = QuantSpec(kind, 128, 512)
    qweight = pack_into(raw, spec, "qweight", torch.empty(spec.part_spec("qweight")[0], dtype=torch.uint8))
    codes = _codes(raw, kind).to(torch.uint8)
    assert torch.equal(device_pairs(qweight), codes[:, ::2] << 4 | codes[:, 1::2])
