"""The ``experts`` policy decoding on a fake GPU (the tiny Mixtral: 3 MoE layers of 4 experts, 2 routed a token): the
same logits as the in-memory model on that device, one transfer to the host per MoE layer and token (the routing,
with the next layer's guess) and no host wait for a copy, few copies of whole expert rows, a device cache that
serves repeats and is sized by the plan from the device budget."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from offload_core import init_empty_weights, load_checkpoint_and_dispatch
from offload_core.devices.fake import tensor as fake_tensor
from offload_core.module_hooks.experts import Experts, ExpertsConfig
from offload_core.module_hooks.experts.device import DeviceLayer
from offload_core.planning import compute_module_sizes
from offload_core.planning.reservation import InFlight

STEPS = 4
#: the tiny model's inputs, activations, KV cache and logits on the fake GPU, beside its weights (512-byte blocks)
ACTIVATIONS = 48 * 2**10


class Counts:
    """Copies to the fake device (bytes, and whether they read the store), copies to the host, host waits."""

    def __init__(self, fake, monkeypatch, experts: list[torch.Tensor] = ()) -> None:
        """``experts``: the store's expert tensors, the copies from which are counted."""
        self.copies: list[int] = []
        self.to_host = 0
        self.host_waits = 0
        real_copy, timeline = fake_tensor._copy_from_host, fake.timeline
        real_operate, real_wait = timeline.operate, timeline.synchronize_event
        spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in experts]

        def copy(dst, src, non_blocking):
            if any(lo <= src.data_ptr() < hi for lo, hi in spans):
                self.copies.append(src.numel() * src.element_size())
            return real_copy(dst, src, non_blocking)

        def operate(device, reads, writes, run, what, deferred=False):
            self.to_host += what == "copy to the host"
            return real_operate(device, reads, writes, run, what, deferred)

        def wait(event):
            self.host_waits += 1
            return real_wait(event)

        monkeypatch.setattr(fake_tensor, "_copy_from_host", copy)
        monkeypatch.setattr(timeline, "operate", operate)
        monkeypatch.setattr(timeline, "synchronize_event", wait)

    def reset(self) -> None:
        self.copies, self.to_host, self.host_waits = [], 0, 0


def decode(model, ids, steps: int = STEPS, each=None) -> list[torch.Tensor]:
    """Greedy decoding by hand: the prompt, then ``steps`` tokens one at a time (``each()`` before each of them)."""
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        logits = [out.logits[:, -1].cpu()]
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            if each is not None:
                each()
            out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[:, -1].cpu())
    return logits


def experts_on_the_host(model) -> dict[str, int | str]:
    """Every module holding tensors on GPU 0 but the fused experts, which stay in host memory."""
    device_map: dict[str, int | str] = {}
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
            device_map[name] = "cpu" if name.endswith(".experts") else 0
    return device_map


def reference_logits(moe, fake, ids, counts: Counts | None = None) -> tuple[list[torch.Tensor], list[int]]:
    """The in-memory model's logits on the fake GPU, and its copies to the host before each token (``counts``)."""
    reference = moe.auto.from_pretrained(moe.path).eval().to(fake.device(0))
    to_host = []

    def each():
        if counts is not None:
            to_host.append(counts.to_host)
            counts.reset()

    want = decode(reference, ids, each=each)
    del reference
    return want, to_host


def expert_tensors(model) -> list[torch.Tensor]:
    handle = model.offload_state.handle
    return [model.offload_state.store[key] for layer in handle.layers for key in layer.keys]


@pytest.mark.parametrize("guess", ["router", "none"])
def test_decoding_waits_once_per_layer_and_copies_whole_rows_or_nothing(saved, tmp_path, fake_gpu, monkeypatch, guess):
    fake = fake_gpu(count=1)
    moe = saved("mixtral")
    ids = moe.inputs["input_ids"][:1].to(fake.device(0))
    counts = Counts(fake, monkeypatch)
    want, base = reference_logits(moe, fake, ids, counts)
    monkeypatch.undo()
    with init_empty_weights():
        model = moe.auto.from_config(moe.config).eval()
    load_checkpoint_and_dispatch(
        model,
        moe.path,
        device_map=experts_on_the_host(model),
        storage="pinned_cpu",
        policy=Experts(ExpertsConfig(cache_slots=1, guess=guess)),
        execution_device=fake.device(0),
        progress=False,
    )
    handle = model.offload_state.handle
    layers = handle.layers
    assert len(layers) == 3 and all(isinstance(layer, DeviceLayer) and layer.direct for layer in layers)
    assert handle.shared.cache.slots == 3  # one per layer, over the three
    row = {layer.row_bytes for layer in layers}.pop()
    smallest = min(shape[1:].numel() * dtype.itemsize for shape, dtype in layers[0].specs.values())
    counts = Counts(fake, monkeypatch, expert_tensors(model))
    steps: list[tuple[int, int, list[int], int]] = []
    counters = handle.expert_counters

    def each():
        if counts.to_host or counts.copies or counters.bytes:
            steps.append((counts.to_host, counts.host_waits, counts.copies, counters.bytes - sum(s[3] for s in steps)))
        counts.reset()

    got = decode(model, ids, each=each)
    each()
    summary = handle.counters()
    model.offload_state.remove()
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert len(steps) == STEPS + 1  # the prompt, then each token
    for (to_host, host_waits, copies, moved), model_own in zip(steps[1:], base[1:]):
        assert to_host == model_own + len(layers)  # the routing (and the guess), one transfer per MoE layer
        assert host_waits == 0  # never a wait for a copy or an event
        assert all(n >= smallest for n in copies)  # whole rows of an expert tensor, never pieces
        assert len(copies) <= len(layers) * 2 * 2 * (2 if guess == "router" else 1)  # per tensor, expert and reason
        assert sum(copies) == moved and moved % row == 0  # only expert rows, and each counted
    assert summary["expert_transfers"] == sum(len(s[2]) for s in steps)
    assert summary["expert_hits"] + summary["expert_guess_hits"] > 0


def test_a_cache_that_holds_every_expert_copies_nothing_once_warm(saved, tmp_path, fake_gpu, monkeypatch):
    fake = fake_gpu(count=1)
    moe = saved("mixtral")
    ids = moe.inputs["input_ids"][:1].to(fake.device(0))
    want, _ = reference_logits(moe, fake, ids)
    with init_empty_weights():
        model = moe.auto.from_config(moe.config).eval()
    load_checkpoint_and_dispatch(
        model,
        moe.path,
        device_map=experts_on_the_host(model),
        storage="pinned_cpu",
        policy=Experts(ExpertsConfig(cache_slots=4, guess="none", whole_fraction=1.0)),
        execution_device=fake.device(0),
        progress=False,
    )
    handle = model.offload_state.handle
    decode(model, ids)  # warm: every expert a token used is kept
    cache = handle.shared.cache
    kept = set(cache.resident)
    counts = Counts(fake, monkeypatch, expert_tensors(model))
    got = decode(model, ids)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert set(cache.resident) >= kept and cache.evictions == 0
    assert counts.copies == []  # the same routing again: every expert from the device cache, nothing from the host
    assert counts.host_waits == 0
    model.offload_state.remove()


def test_the_device_cache_takes_what_the_budget_leaves_beside_the_placed_weights(saved, tmp_path, fake_gpu):
    """The plan holds back the buffers and read-ahead slots (:meth:`Experts.reserve`, as the planner asks it for the
    map); at load, the cache takes the budget that is left beside the weights placed on the GPU."""
    fake = fake_gpu(count=1)
    moe = saved("mixtral")
    ids = moe.inputs["input_ids"][:1].to(fake.device(0))
    want, _ = reference_logits(moe, fake, ids)
    with init_empty_weights():
        model = moe.auto.from_config(moe.config).eval()
    device_map = experts_on_the_host(model)
    offloaded = {
        f"{name}.{local}": f"{name}.{local}"
        for name, where in device_map.items()
        if where == "cpu"
        for local in ("gate_up_proj", "down_proj")
    }
    experts = sum(model.get_parameter(name).numel() * 4 for name in offloaded)
    row = experts // (4 * 3)  # 4 experts in each of 3 layers, float32
    weights = compute_module_sizes(model)[""] - experts
    policy = Experts(ExpertsConfig())
    need = InFlight(fake.device(0), 0, 0, store_pinned=True, model=model, device_budget=1, offloaded=offloaded)
    held = policy.reserve(need)[0]
    assert held == 2 * row + row * 4  # two read-ahead slots; the buffers: one of each expert tensor's shape
    budget = weights + held + 3 * row + row // 2  # half an expert for the buffers kept in float32
    policy.reserve(replace(need, device_budget=budget))
    load_checkpoint_and_dispatch(
        model,
        moe.path,
        device_map=device_map,
        storage="pinned_cpu",
        policy=policy,
        execution_device=fake.device(0),
        progress=False,
    )
    handle = model.offload_state.handle
    assert handle.shared.cache.slots == 2  # 3 experts' bytes left, one of them spared
    assert "expert cache on fakegpu:0: what the device budget has left" in policy.plan_lines()[0]
    fake.reset_peak_memory_stats(0)
    got = decode(model, ids)
    counters = handle.counters()
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert len(handle.shared.cache.resident) == 2 and counters["expert_device_cache_slots"] == 2
    assert fake.max_memory_allocated(0) <= budget + ACTIVATIONS
    model.offload_state.remove()
