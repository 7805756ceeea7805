"""A GPU run of a GGUF file read in place (on the fake accelerator): each offloaded tensor's quantized blocks are
copied to the device as the file holds them and dequantized there, through fixed scratch, bit for bit what the host
dequantizes and transformers' own model of the file computes (in float32, or rounded to bfloat16 as its load does)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

import offload_core
from offload_core.registry.manager import get_registry
from offload_core.storage.gguf import device
from offload_core.storage.gguf.dequant import dequantize_into, fast_types, unpermute_into
from offload_core.storage.gguf.rates import random_blocks
from tests.gguf_files import half_offloaded_map, transformers_model, write_gguf
from tests.gpu_budgets import on_gpu

TYPES = {
    "ffn_down": int(T.Q4_K),
    "ffn_up": int(T.Q8_0),
    "attn_k": int(T.Q4_0),
    "ffn_gate": int(T.Q5_0),
    "attn_q": int(T.Q6_K),
    "attn_v": int(T.Q5_K),
    "output.weight": int(T.Q5_1),
}
IDS = torch.tensor([[256, 5, 77, 100, 258, 259, 33, 40]])


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    arch = request.param
    path = write_gguf(tmp_path_factory.mktemp("gguf-device") / f"{arch}.gguf", arch, TYPES, default=int(T.Q4_1))
    reference = transformers_model(path)
    with torch.no_grad():
        logits = reference(IDS).logits
        tokens = reference.generate(IDS, max_new_tokens=4, do_sample=False)
    return path, logits, tokens


def _on_gpu(fake, path, dtype=None, resident="dequantized"):
    on_device = {name: 0 if where == "cpu" else "cpu" for name, where in half_offloaded_map().items()}
    storage = get_registry().create("storage", "gguf", {"resident": resident})
    offload = {"storage": storage, "policy": "prefetch", "device_map": on_device, "execution_device": fake.device(0)}
    # a budget far below a full pass's scratch: the plan sizes it by the largest offloaded tensor
    return offload_core.from_pretrained(
        path, offload={**offload, "progress": False}, max_memory={0: "8MiB"}, dtype=dtype
    )


@pytest.mark.slow  # whole runs on the fake GPU (the quick subset stays under a minute)
@pytest.mark.parametrize("resident", ["dequantized", "quantized"])
def test_a_gpu_run_dequantizes_the_offloaded_blocks_on_the_device_bit_for_bit(tiny, resident, fake_gpu):
    """The blocks read from the file in place, or held quantized in host memory."""
    path, logits, tokens = tiny
    fake = fake_gpu(count=1, memory="1GiB")
    model = _on_gpu(fake, path, resident=resident)
    try:
        ids = IDS.to(fake.device(0))
        with torch.no_grad():
            assert torch.equal(model(ids).logits.cpu(), logits)
            assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False).cpu(), tokens)
        prefetcher = model.offload_state.handle.prefetcher
        offloaded = {key for unit in prefetcher.units for key in unit.keys}
        held = [model.offload_state.store.packed(key).raw for key in offloaded]
        assert all(fake.is_pinned(raw) for raw in held) == (resident == "quantized")  # held: page-locked
        assert prefetcher.decoder.decoded >= len(offloaded) > 0  # every offloaded tensor, on the device
        assert set(prefetcher.decoder.scratches) == {"gguf"}
        assert not fake.hazards
    finally:
        model.offload_state.remove()


def test_a_bfloat16_run_rounds_on_the_device_as_transformers_load_does(tiny, fake_gpu):
    path, _, _ = tiny
    reference = transformers_model(path, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = reference(IDS).logits
    fake = fake_gpu(count=1, memory="1GiB")
    model = _on_gpu(fake, path, dtype=torch.bfloat16)
    try:
        with torch.no_grad():
            assert torch.equal(model(IDS.to(fake.device(0))).logits.cpu(), logits)
        assert model.offload_state.handle.prefetcher.decoder.decoded > 0
    finally:
        model.offload_state.remove()


@pytest.mark.parametrize("heads,cols", [(None, 777), (4, 1024), (4, 128)])
@pytest.mark.parametrize("name", fast_types())
def test_the_passes_give_what_the_host_dequantizes(name, heads, cols, fake_gpu):
    """Small passes (many per tensor; for an un-permuted q several per head, or two heads each) write what one host
    call writes."""
    fake = fake_gpu(count=1, memory="64MiB")
    kind = int(T[name])
    rows = 64
    if not device.decodes_on_device(kind, (rows, cols), heads, 4096) or (rows * cols) % device.block_shape(kind)[0]:
        pytest.skip(f"{name} rows of {cols} hold no whole blocks")
    raw = random_blocks(kind, rows * cols, seed=kind)
    want = dequantize_into(raw, kind, torch.empty(rows * cols))
    if heads:
        want = unpermute_into(want, heads, torch.empty(rows, cols))
    out = torch.empty(rows, cols, device=fake.device(0))
    blocks = device.DeviceBlocks(raw, kind, (rows, cols), heads, elements=4096)
    blocks.decode_on_device(out, device.DeviceScratch(out.device, 4096), "w")
    assert torch.equal(out.cpu().view(torch.int32), want.view(rows, cols).view(torch.int32))


def test_the_scratch_holds_every_kernels_buffers_within_what_the_plan_reserves(fake_gpu):
    """Every type with a kernel through one scratch, a tensor of more than one pass each (and llama's un-permuted
    q): the device's peak beside the outputs stays within :func:`device.scratch_bytes` (passes of 2^20 elements, as
    a model whose largest offloaded tensor is that large takes: the kernels' bytes an element do not depend on it)."""
    passes = 2**20
    fake = fake_gpu(count=1, memory="512MiB")
    scratch, peak = None, 0
    for index, name in enumerate(fast_types()):
        kind = int(T[name])
        elements = passes + 4096 * 64
        raw = random_blocks(kind, elements, seed=index)
        out = torch.empty(elements, device=fake.device(0))
        base = fake.memory_allocated(0)
        fake.reset_peak_memory_stats(0)
        scratch = scratch or device.DeviceScratch(out.device, passes)
        held = scratch.nbytes if index else 0
        heads = 8 if name == "Q4_0" else None
        shape = (elements // 4096, 4096) if heads else (elements,)
        device.DeviceBlocks(raw, kind, shape, heads, elements=passes).decode_on_device(out, scratch, name)
        fake.synchronize()
        peak = max(peak, fake.max_memory_allocated(0) - base + held)
    assert 0 < scratch.nbytes <= peak <= device.scratch_bytes(passes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_the_blocks_cross_quantized_and_give_the_gpu_models_logits(tiny, dtype):
    """On CUDA: half the model streamed as its quantized blocks and dequantized on the GPU gives the logits and
    tokens of transformers' own model of the file on that GPU, bit for bit."""
    path, _, _ = tiny
    reference = transformers_model(path, dtype=dtype).to("cuda")
    ids = IDS.to("cuda")
    with torch.no_grad():
        logits = reference(ids).logits
        tokens = reference.generate(ids, max_new_tokens=4, do_sample=False)
    del reference
    on_device = {name: 0 if where == "cpu" else "cpu" for name, where in half_offloaded_map().items()}
    model = offload_core.from_pretrained(
        path,
        offload={"storage": "gguf", "policy": "prefetch", "device_map": on_device, "execution_device": "cuda:0"},
        max_memory={0: on_gpu(128 * 2**20), "cpu": "1GiB"},
        dtype=dtype,
    )
    try:
        with torch.no_grad():
            assert torch.equal(model(ids).logits, logits)
            assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), tokens)
        assert model.offload_state.handle.prefetcher.decoder.decoded > 0
    finally:
        model.offload_state.remove()


def test_the_prediction_prices_no_host_dequantization_for_what_the_device_decodes(tiny, fake_gpu):
    from offload_core.plan.dequant import dequant_lines
    from offload_core.plan.predict import plan_dequant_s

    path, _, _ = tiny
    fake = fake_gpu(count=1, memory="1GiB")
    model = _on_gpu(fake, path)
    try:
        plan, policy = model.offload_plan, get_registry().create("policy", "prefetch", {})
        assert plan.dequant and policy.decodes_on_device
        assert plan_dequant_s(plan, policy, fake.device(0)) == 0.0
        assert all(row["on_device"] for row in plan.dequant)
        assert all(line.endswith("on the device") for line in dequant_lines(plan.dequant)[1:-1])
    finally:
        model.offload_state.remove()


def test_a_type_without_a_kernel_is_dequantized_on_the_host_and_planned_so(tmp_path, fake_gpu):
    """Q2_K has no torch kernel here: its tensors cross as floats, the rest as blocks; the plan's rows say which."""
    path = write_gguf(tmp_path / "llama.gguf", "llama", {**TYPES, "ffn_gate": int(T.Q2_K)}, default=int(T.Q4_1))
    with torch.no_grad():
        logits = transformers_model(path)(IDS).logits
    fake = fake_gpu(count=1, memory="1GiB")
    model = _on_gpu(fake, path)
    try:
        with torch.no_grad():
            assert torch.equal(model(IDS.to(fake.device(0))).logits.cpu(), logits)
        prefetcher = model.offload_state.handle.prefetcher
        offloaded = [key for unit in prefetcher.units for key in unit.keys]
        on_host = [key for key in offloaded if "gate_proj" in key]
        assert on_host and prefetcher.decoder.decoded == len(offloaded) - len(on_host)
        assert {(row["type"], row["device"]) for row in model.offload_plan.dequant if row["type"] == "Q2_K"} == {
            ("Q2_K", False)
        }
        assert all(row["device"] for row in model.offload_plan.dequant if row["type"] != "Q2_K")
    finally:
        model.offload_state.remove()
