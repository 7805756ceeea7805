"""The ``experts`` policy on a design with a list of expert modules (each called only for its tokens): only the
experts the router picks are read, the cache serves repeats, outputs equal the in-memory model's."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from offload_core import load_checkpoint_and_dispatch
from offload_core.module_hooks.experts import Experts, ExpertsConfig

HIDDEN, FFN, EXPERTS, TOP_K, LAYERS = 16, 32, 6, 2, 3


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, FFN, bias=False)
        self.w2 = nn.Linear(FFN, HIDDEN, bias=False)
        self.w3 = nn.Linear(HIDDEN, FFN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class SparseMoe(nn.Module):
    """A router and a list of experts; an expert no token is routed to is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, HIDDEN)
        weights, chosen = torch.topk(self.gate(flat).softmax(-1), TOP_K, dim=-1)
        out = torch.zeros_like(flat)
        for expert in torch.unique(chosen).tolist():
            rows, slot = torch.where(chosen == expert)
            out.index_add_(0, rows, self.experts[expert](flat[rows]) * weights[rows, slot, None])
        return out.reshape(x.shape)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.moe = SparseMoe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class TinyMoe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, 50, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _routed(model: TinyMoe, ids: torch.Tensor) -> dict[int, set[int]]:
    called: dict[int, set[int]] = {}
    handles = [
        expert.register_forward_pre_hook(lambda m, a, i=i, e=e: called.setdefault(i, set()).add(e))
        for i, layer in enumerate(model.layers)
        for e, expert in enumerate(layer.moe.experts)
    ]
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    return called


def _dispatch(path, store: str, folder, cache_slots: int) -> TinyMoe:
    model = TinyMoe()
    load_checkpoint_and_dispatch(
        model,
        path,
        device_map={"embed": "cpu", "layers": "disk", "head": "cpu"},
        storage=store,
        offload_folder=folder,
        no_split_module_classes=["Block"],
        policy=Experts(ExpertsConfig(cache_slots=cache_slots, guess="none")),
        execution_device="cpu",
        progress=False,
    )
    return model


@pytest.mark.parametrize("store", ["safetensors", "memmap", "pinned_cpu"])
def test_only_the_called_experts_are_read(store, tmp_path):
    torch.manual_seed(0)
    reference = TinyMoe().eval()
    ids = torch.tensor([[3, 7]])
    routed = _routed(reference, ids)
    with torch.no_grad():
        want = reference(ids)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    for layer in range(LAYERS):  # the experts no token reaches are NaN: reading one would show
        for expert in set(range(EXPERTS)) - routed[layer]:
            for name in ("w1", "w2", "w3"):
                state[f"layers.{layer}.moe.experts.{expert}.{name}.weight"].fill_(float("nan"))
    save_file(state, str(tmp_path / "model.safetensors"))
    model = _dispatch(tmp_path, store, tmp_path / "off", cache_slots=0)
    with torch.no_grad():
        got = model(ids)
    counters = model.offload_state.handle.counters()
    model.offload_state.remove()
    assert torch.equal(got, want)
    reads = sum(len(experts) for experts in routed.values())
    expert_bytes = 3 * HIDDEN * FFN * 4
    assert counters["expert_misses"] == reads and counters["expert_hits"] == 0
    assert counters["expert_bytes"] == reads * expert_bytes


def test_the_cache_serves_a_repeated_routing(tmp_path):
    torch.manual_seed(0)
    reference = TinyMoe().eval()
    save_file(dict(reference.state_dict()), str(tmp_path / "model.safetensors"))
    ids = torch.tensor([[5]])
    model = _dispatch(tmp_path, "safetensors", tmp_path / "off", cache_slots=TOP_K)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(ids), reference(ids))
    counters = model.offload_state.handle.counters()
    model.offload_state.remove()
    assert counters["expert_misses"] == LAYERS * TOP_K  # the first call reads them; the next two find them cached
    assert counters["expert_hits"] == 2 * LAYERS * TOP_K
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))  # removed: the weights are back in the model
