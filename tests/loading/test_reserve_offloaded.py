"""A plan holds back for units in flight what its policy holds for the units the device map offloads: nothing for a
model that fits, under every policy, and for one that does not, what the attached module hooks then hold."""

from __future__ import annotations

import pytest
import torch

import offload_core
from offload_core import init_empty_weights
from offload_core.alignment import assume_kernels_depend_on_alignment
from offload_core.loading.checkpoint import Checkpoint
from offload_core.plan.make import PlanInputs, make_plan
from offload_core.planning import compute_module_sizes
from offload_core.registry.manager import get_registry
from tests.checkpoints import POLICIES

CPU = torch.device("cpu")


def _plan(source, policy: str, storage: str, budget: int):
    with init_empty_weights():
        model = source.auto.from_config(source.config).eval()
    registry = get_registry()
    with Checkpoint.open(source.path) as checkpoint:
        inputs = PlanInputs(
            placement=registry.create("placement", "sequential"),
            storage=registry.create("storage", storage),
            policy=registry.create("policy", policy),
            execution_device=CPU,
            budgets={"cpu": budget},
            no_split=list(model._no_split_modules),
            dtype=torch.float32,
            policy_name=policy,
        )
        return make_plan(model, checkpoint, inputs)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["mixtral", "llama"])  # per-expert tensors as transformers saves them; dense
def test_a_model_that_fits_is_kept_whole_and_nothing_is_held_back(saved, name, policy):
    source = saved(name)
    with init_empty_weights():
        total = compute_module_sizes(source.auto.from_config(source.config), dtype=torch.float32)[""]
    # kernels that care where a weight starts make assembled experts copies: the case that held back the most
    with assume_kernels_depend_on_alignment(True):
        for storage in ("safetensors", "memmap"):
            for budget in (total, 3 * total):
                plan = _plan(source, policy, storage, budget)
                assert set(plan.device_map.values()) == {"cpu"}, (storage, budget, plan.device_map)
                assert not any(plan.reserve.values()), (storage, budget, plan.reserve)


def test_the_experts_policy_holds_back_what_its_offloaded_layers_hold(saved):
    source = saved("mixtral")  # 3 MoE layers of 4 experts, top 2; run in bf16: every offloaded tensor is a copy
    reference = source.auto.from_pretrained(source.path, dtype=torch.bfloat16).eval()
    total = sum(p.numel() * 2 for p in reference.parameters())
    model = offload_core.from_pretrained(
        source.path,
        offload={"policy": "experts", "storage": "safetensors", "headroom": 0},
        max_memory={"cpu": int(total * 0.95)},
        dtype=torch.bfloat16,
    )
    try:
        handle = model.offload_state.handle
        with torch.no_grad():
            assert torch.equal(model(**source.inputs).logits, reference(**source.inputs).logits)
        assert 0 < len(handle.layers) < 3  # some MoE layers stay in memory: they hold nothing
        row = max(layer.row_bytes for layer in handle.layers)
        experts, top_k = source.config.num_local_experts, source.config.num_experts_per_tok
        held = handle.cache_slots * row * len(handle.layers) + (experts + top_k) * row
        pool = handle.prefetcher.block_pool
        blocks = pool.count * pool.capacity if pool is not None else 0
        reserve = model.offload_plan.reserve["cpu"]
        assert 0 <= reserve - held - blocks < (pool.count * 4096 if pool is not None else 1)
        on_cpu = model.offload_plan.summary["devices"]["cpu"]["bytes"]
        assert on_cpu + reserve <= int(total * 0.95)
    finally:
        model.offload_state.remove()


def test_prefetch_holds_back_its_pool_for_the_blocks_it_offloads(saved):
    source = saved("llama")
    reference = source.auto.from_pretrained(source.path).eval()
    total = sum(p.numel() * 4 for p in reference.parameters())
    budget = int(total * 0.9)
    policy = get_registry().create("policy", "prefetch", {"pool": True, "depth": 1})  # copies into its pool
    model = offload_core.from_pretrained(
        source.path, offload={"policy": policy, "headroom": 0}, max_memory={"cpu": budget}
    )
    try:
        with torch.no_grad():
            assert torch.equal(model(**source.inputs).logits, source.expected)
        pool = model.offload_state.handle.prefetcher.block_pool
        reserve = model.offload_plan.reserve["cpu"]
        assert pool is not None and pool.count == 2  # the block that runs and one read ahead
        assert pool.count * pool.capacity <= reserve < pool.count * (pool.capacity + 4096)
        assert model.offload_plan.summary["devices"]["cpu"]["bytes"] + reserve <= budget
    finally:
        model.offload_state.remove()
