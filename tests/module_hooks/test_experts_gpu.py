"""The expert-granular policy on a GPU: routed experts copied from host memory (pinned) or mapped files to the device,
logits bit-identical to the in-memory model on the same GPU; decoding with a device cache that holds every expert
copies nothing from the host once warm, and the plan keeps the GPU within its budget."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from offload_core import init_empty_weights, load_checkpoint_and_dispatch
from offload_core.module_hooks.experts import Experts, ExpertsConfig
from offload_core.module_hooks.experts.device import DeviceLayer
from offload_core.planning import compute_module_sizes
from offload_core.planning.reservation import InFlight
from tests.checkpoints import Saved
from tests.gpu_budgets import on_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("store", ["pinned_cpu", "memmap", "safetensors"])
@pytest.mark.parametrize("guess", ["router", "previous"])
def test_experts_policy_on_gpu_bit_identical(store, guess, dtype, tmp_path):
    # bfloat16 is what MoE checkpoints run in, and where transformers' experts take their grouped_mm kernel
    moe = Saved("mixtral", tmp_path / "saved")
    reference = moe.auto.from_pretrained(moe.path, dtype=dtype).eval().to("cuda")
    ids = moe.inputs["input_ids"][:1].cuda()
    with torch.no_grad():
        want = [reference(input_ids=ids).logits, reference(input_ids=ids[:, :1]).logits]
    with init_empty_weights():
        model = moe.auto.from_config(moe.config, dtype=dtype).eval()
    total = compute_module_sizes(model)[""]
    load_checkpoint_and_dispatch(
        model,
        moe.path,
        device_map="sequential",
        max_memory={0: on_gpu(total // 2), "cpu": total // 4},  # the GPU holds one block beside the generation
        over_budget="warn",
        storage=store,
        policy=Experts(ExpertsConfig(cache_slots=2, guess=guess)),
        offload_folder=tmp_path / "off",
        execution_device="cuda:0",
        dtype=dtype,
        progress=False,
        generation={"max_new_tokens": 2, "prompt_tokens": ids.shape[1]},  # the forwards below: one prompt, two tokens
    )
    with torch.no_grad():
        got = [model(input_ids=ids).logits, model(input_ids=ids[:, :1]).logits, model(input_ids=ids[:, :1]).logits]
    handle = model.offload_state.handle
    assert handle.layers and all(isinstance(layer, DeviceLayer) for layer in handle.layers)
    assert all(layer.direct == (store == "pinned_cpu") for layer in handle.layers)
    counters = handle.counters()
    model.offload_state.remove()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[1])
    assert counters["expert_hits"] + counters["expert_guess_hits"] > 0


def _experts_on_the_host(model) -> dict[str, int | str]:
    """Every module holding tensors on GPU 0 but the fused experts, which stay in host memory."""
    return {
        name: "cpu" if name.endswith(".experts") else 0
        for name, module in model.named_modules()
        if list(module.parameters(recurse=False)) or list(module.buffers(recurse=False))
    }


def _decode(model, ids, steps: int = 6) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        logits = [out.logits[:, -1]]
        for _ in range(steps):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[:, -1])
    return logits


@pytest.mark.parametrize("guess", ["router", "none"])
def test_decoding_from_a_device_cache_of_every_expert_copies_nothing_once_warm(guess, tmp_path):
    moe = Saved("mixtral", tmp_path / "saved")
    dtype = torch.bfloat16
    reference = moe.auto.from_pretrained(moe.path, dtype=dtype).eval().to("cuda")
    ids = moe.inputs["input_ids"][:1].cuda()
    want = _decode(reference, ids)
    del reference
    with init_empty_weights():
        model = moe.auto.from_config(moe.config, dtype=dtype).eval()
    device_map = _experts_on_the_host(model)
    load_checkpoint_and_dispatch(
        model,
        moe.path,
        device_map=device_map,
        storage="pinned_cpu",
        policy=Experts(ExpertsConfig(cache_slots=moe.config.num_local_experts, guess=guess)),
        execution_device="cuda:0",
        dtype=dtype,
        progress=False,
    )
    first = _decode(model, ids)
    counters = model.offload_state.handle.expert_counters
    before = counters.transfers
    second = _decode(model, ids)
    after = counters.transfers
    model.offload_state.remove()
    assert all(torch.equal(a, b) for a, b in zip(first, want)) and all(torch.equal(a, b) for a, b in zip(second, want))
    assert before > 0 and after == before  # every expert routed again comes from the device cache


def test_the_device_cache_takes_what_the_budget_leaves_and_the_gpu_stays_within_it(tmp_path):
    moe = Saved("mixtral", tmp_path / "saved")
    dtype = torch.bfloat16
    reference = moe.auto.from_pretrained(moe.path, dtype=dtype).eval().to("cuda")
    ids = moe.inputs["input_ids"][:1].cuda()
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    want = _decode(reference, ids)
    running = torch.cuda.max_memory_allocated() - resident  # what decoding takes beside the weights, in memory
    del reference
    with init_empty_weights():
        model = moe.auto.from_config(moe.config, dtype=dtype).eval()
    device_map = _experts_on_the_host(model)
    offloaded = {
        f"{name}.{local}": f"{name}.{local}"
        for name, where in device_map.items()
        if where == "cpu"
        for local in ("gate_up_proj", "down_proj")
    }
    experts = sum(model.get_parameter(name).numel() * 2 for name in offloaded)
    row = experts // (moe.config.num_local_experts * moe.config.num_hidden_layers)
    weights = compute_module_sizes(model, dtype=dtype)[""] - experts
    policy = Experts(ExpertsConfig())
    need = InFlight(torch.device("cuda:0"), 0, 0, store_pinned=True, model=model, dtype=dtype, offloaded=offloaded)
    budget = weights + policy.reserve(need)[0] + 3 * row + row // 2  # half an expert: buffers kept in float32
    policy.reserve(replace(need, device_budget=budget))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # the inputs and the reference's logits
    load_checkpoint_and_dispatch(
        model,
        moe.path,
        device_map=device_map,
        storage="pinned_cpu",
        policy=policy,
        execution_device="cuda:0",
        dtype=dtype,
        progress=False,
    )
    torch.cuda.reset_peak_memory_stats()
    got = _decode(model, ids)
    peak = torch.cuda.max_memory_allocated() - base
    shared = model.offload_state.handle.shared
    kept = len(shared.cache.resident)
    model.offload_state.remove()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert shared.cache_slots == 2 and kept == 2  # 3 experts' bytes left, one spared
    # beside the budget: what the in-memory model's decoding took beside its weights (activations, KV cache, logits),
    # and the allocator's 512-byte blocks
    assert peak <= budget + running + 2**12, (peak, budget, running)
