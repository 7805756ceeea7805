"""The expert-granular policy's accelerator path (ExpertLayer: routed experts' rows from pinned host memory into
one shared device buffer per shape) on a fake GPU: logits equal the in-memory model's on the same device, with
no hazard; and prefetch's pool=false, which would bind host memory to a GPU computation, is refused."""

from __future__ import annotations

import pytest
import torch

from offload_core import init_empty_weights, load_checkpoint_and_dispatch
from offload_core.errors import ConfigError
from offload_core.module_hooks.experts import Experts, ExpertsConfig
from offload_core.module_hooks.experts.loader import ExpertLayer
from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig
from offload_core.planning import compute_module_sizes


@pytest.mark.parametrize("store", ["pinned_cpu", "memmap", "safetensors"])
@pytest.mark.parametrize("guess", ["router", "previous"])
def test_experts_on_a_gpu_match_in_memory(saved, store, guess, tmp_path, fake_gpu):
    fake = fake_gpu(count=1)
    moe = saved("mixtral")
    reference = moe.auto.from_pretrained(moe.path).eval().to(fake.device(0))
    ids = moe.inputs["input_ids"][:1].to(fake.device(0))
    with torch.no_grad():
        want = [reference(input_ids=ids).logits.cpu(), reference(input_ids=ids[:, :1]).logits.cpu()]
    del reference
    with init_empty_weights():
        model = moe.auto.from_config(moe.config).eval()
    total = compute_module_sizes(model)[""]
    load_checkpoint_and_dispatch(
        model,
        moe.path,
        device_map="sequential",
        max_memory={0: total // 2, "cpu": total // 4},  # the GPU holds one block beside the generation
        over_budget="warn",
        storage=store,
        policy=Experts(ExpertsConfig(cache_slots=2, guess=guess)),
        offload_folder=tmp_path / "off",
        execution_device=fake.device(0),
        progress=False,
        generation={"max_new_tokens": 1, "prompt_tokens": ids.shape[1]},  # the forwards below: one prompt, one token
    )
    handle = model.offload_state.handle
    assert handle.layers and all(isinstance(layer, ExpertLayer) for layer in handle.layers)  # the accelerator path
    with torch.no_grad():
        got = [
            model(input_ids=ids).logits.cpu(),
            model(input_ids=ids[:, :1]).logits.cpu(),
            model(input_ids=ids[:, :1]).logits.cpu(),
        ]
    counters = handle.counters()
    model.offload_state.remove()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[1])
    assert counters["expert_hits"] + counters["expert_guess_hits"] > 0


def test_prefetch_without_the_pool_is_refused_on_a_gpu(saved, tmp_path, fake_gpu):
    """pool=false serves mapped host pages as the weights: only a CPU can compute on them."""
    fake = fake_gpu(count=1)
    moe = saved("llama")
    with init_empty_weights():
        model = moe.auto.from_config(moe.config).eval()
    with pytest.raises(ConfigError) as caught:
        load_checkpoint_and_dispatch(
            model,
            moe.path,
            device_map={"": "disk"},
            storage="memmap",
            policy=Prefetch(PrefetchConfig(pool=False)),
            offload_folder=tmp_path / "off",
            execution_device=fake.device(0),
            progress=False,
        )
    assert "\n" not in str(caught.value) and "hook.pool=false" in str(caught.value)


def test_a_whole_read_to_the_gpu_never_builds_a_whole_assembled_tensor(saved, tmp_path, fake_gpu, monkeypatch):
    """Most experts routed (a long prompt): each fused tensor is read whole. From the safetensors store, whose
    expert tensors are assembled from per-expert checkpoint tensors on read, that goes row by row."""
    fake = fake_gpu(count=1)
    moe = saved("mixtral")
    reference = moe.auto.from_pretrained(moe.path).eval().to(fake.device(0))
    ids = moe.inputs["input_ids"][:1].to(fake.device(0))
    with torch.no_grad():
        want = reference(input_ids=ids).logits.cpu()
    del reference
    with init_empty_weights():
        model = moe.auto.from_config(moe.config).eval()
    load_checkpoint_and_dispatch(
        model,
        moe.path,
        device_map={"": "disk"},
        storage="safetensors",
        policy=Experts(ExpertsConfig(cache_slots=0, whole_fraction=0.01)),
        execution_device=fake.device(0),
        progress=False,
    )
    store = model.offload_state.store
    assert store.assembled
    whole = []
    real_getitem = type(store).__getitem__

    def getitem(self, name):
        if name in self.assembled:
            whole.append(name)
        return real_getitem(self, name)

    monkeypatch.setattr(type(store), "__getitem__", getitem)
    with torch.no_grad():
        got = model(input_ids=ids).logits.cpu()
    counters = model.offload_state.handle.counters()
    monkeypatch.undo()
    model.offload_state.remove()
    assert torch.equal(got, want)
    assert counters["expert_whole_reads"] > 0 and whole == []
