"""The reservation for units in flight counts the copies a store makes on read: tensors built from several
checkpoint tensors (per-expert MoE weights read in place) as well as tensors stored in another dtype."""

from __future__ import annotations

import pytest
import torch

from offload_core import init_empty_weights
from offload_core.loading.checkpoint import Checkpoint
from offload_core.plan.reserve import Reserver
from offload_core.registry.manager import get_registry


@pytest.mark.parametrize(
    "name,store,holds_back",
    [("mixtral", "safetensors", True), ("mixtral", "memmap", False), ("llama", "safetensors", False)],
)
def test_copies_made_on_read_are_held_back(saved, name, store, holds_back):
    model_source = saved(name)
    with init_empty_weights():
        model = model_source.auto.from_config(model_source.config).eval()
    registry = get_registry()
    policy, storage = registry.create("policy", "prefetch"), registry.create("storage", store)
    dtype = next(model.parameters()).dtype
    with Checkpoint.open(model_source.path) as checkpoint:
        reserve = Reserver.of(
            model, checkpoint, storage, torch.device("cpu"), list(model._no_split_modules), dtype, None
        )(policy)
    assert (reserve.get("cpu", 0) > 0) == holds_back


def test_prefetch_holds_one_block_fewer_in_flight_down_to_none_read_ahead():
    from offload_core.module_hooks.experts import Experts, ExpertsConfig
    from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig

    policy, option = Prefetch(PrefetchConfig(depth=2, staging_chunk="8MiB")).lighter()
    assert (type(policy), policy.config.depth, policy.chunk, option) == (Prefetch, 1, 8 * 2**20, "hook.depth=1")
    policy, option = policy.lighter()
    assert (policy.config.depth, option) == (0, "hook.depth=0") and policy.lighter() is None
    experts, _ = Experts(ExpertsConfig(depth=1, cache_slots=3, guess="previous")).lighter()
    assert type(experts) is Experts and (experts.config.depth, experts.slots, experts.config.guess) == (
        0,
        3,
        "previous",
    )


@pytest.mark.parametrize(
    "budget,staging,depth,line",
    [
        (10_000, 0, 2, ""),  # what it holds as configured fits
        (250, 0, 1, "hook.depth=1: the units in flight as configured take 300 B on 0, over the 250 B"),
        (150, 0, 0, "hook.depth=0: the units in flight as configured take 300 B on 0, over the 150 B"),
        (50, 0, 2, ""),  # none fits: as configured (make_plan's warning says by how much the run goes over)
        (250, 500, 1, "hook.depth=1: the units in flight as configured take 300 B on 0"),  # the cpu stays over
        (10_000, 500, 2, ""),  # only the cpu is over, and no depth changes what it holds there
    ],
)
def test_the_plan_lowers_the_read_ahead_until_its_units_fit_the_budget(budget, staging, depth, line):
    from offload_core.plan.make import fit_in_flight
    from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig

    def reserve_of(policy):  # one block that runs and depth more, 100 bytes each; a staging ring on the cpu
        return {0: 100 * (1 + policy.config.depth), "cpu": staging}

    policy, reserve, said = fit_in_flight(Prefetch(PrefetchConfig(depth=2)), {0: budget, "cpu": 100}, reserve_of)
    assert policy.config.depth == depth and reserve == reserve_of(policy)
    assert said.startswith(line) and bool(said) == bool(line)
