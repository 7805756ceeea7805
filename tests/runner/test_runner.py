"""run(cfg) on small synthetic models: plan only, a user's device map, reservations per store and policy, the prefetch
pool's budget; the whole runs are marked slow."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from offload_core.runner.config import register_configs
from offload_core.runner.job import run

from tests import ROOT


def _cfg(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=overrides)


def test_plan_only_loads_nothing(tmp_path):
    cfg = _cfg(
        [
            "plan_only=true",
            "model=synthetic",
            "storage=memmap",
            f"offload_folder={tmp_path / 'off'}",
            "max_memory.cpu=1MiB",
            "headroom=0",
        ]
    )
    result = run(cfg, output_dir=tmp_path)
    assert result.token_ids == [] and "disk" in set(result.device_map.values())
    assert not (tmp_path / "off").exists()
    assert (tmp_path / "placement.png").stat().st_size > 1000
    assert result.plan["predicted_bytes_per_token"] > 0
    quiet = run(cfg, output_dir=tmp_path / "no_plot", plot=False)  # the benchmark's way to get the plan
    assert quiet.device_map == result.device_map and not (tmp_path / "no_plot" / "placement.png").exists()


@pytest.mark.slow  # a whole run
def test_user_device_map_file(tmp_path):
    mapping = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.layers.2": "cpu",
        "model.layers.3": "cpu",
        "model.norm": "cpu",
        "lm_head": "disk",
    }
    path = tmp_path / "map.json"
    path.write_text(json.dumps(mapping))
    cfg = _cfg(
        [f"device_map={path}", "model=synthetic", "progress=false", "max_new_tokens=4", "compare_in_memory=true"]
    )
    result = run(cfg, output_dir=tmp_path)
    assert result.device_map == mapping
    assert result.matches_in_memory is True
    assert result.figures["offloaded_bytes"] > 0


def test_reservation_follows_store_and_policy():
    import torch

    from offload_core.registry.manager import get_registry
    from offload_core.plan.reserve import reservation
    from offload_core.planning.reservation import InFlight

    registry = get_registry()

    def make(group, name, **options):
        return registry.create(group, name, {"name": name, **options})

    safetensors, memmap, pinned = (
        make("storage", "safetensors"),
        make("storage", "memmap"),
        make("storage", "pinned_cpu"),
    )
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    block, module = 1000, 100
    assert reservation(
        make("policy", "prefetch", depth=2), safetensors, InFlight(cpu, block, module), converts=False
    ) == {"cpu": 0}
    assert reservation(
        make("policy", "prefetch", depth=2, pool=True), memmap, InFlight(cpu, block, module), converts=False
    ) == {"cpu": 3000}
    # Only a store that converts on read makes copies of a checkpoint stored in another dtype.
    assert reservation(
        make("policy", "prefetch", depth=1), safetensors, InFlight(cpu, block, module), converts=True
    ) == {"cpu": 2000}
    assert reservation(make("policy", "prefetch", depth=1), memmap, InFlight(cpu, block, module), converts=True) == {
        "cpu": 0
    }
    assert reservation(make("policy", "align_per_call"), safetensors, InFlight(cpu, block, module), converts=True) == {
        "cpu": 100
    }
    assert reservation(
        make("policy", "align_per_call", granularity="block"), safetensors, InFlight(cpu, block, module), converts=True
    ) == {"cpu": 1000}
    assert reservation(make("policy", "chained"), safetensors, InFlight(gpu, block, module), converts=False) == {
        1: 1000
    }
    # A GPU run holds the blocks in flight on the device, and the staging ring in host memory
    # unless the store is already pinned.
    staged = reservation(
        make("policy", "prefetch", depth=2, staging_chunk="1MiB"), memmap, InFlight(gpu, block, module), converts=False
    )
    assert staged == {1: 3000, "cpu": 3 * 2**20}
    assert reservation(make("policy", "prefetch", depth=2), pinned, InFlight(gpu, block, module), converts=False) == {
        1: 3000,
        "cpu": 0,
    }


def test_a_third_party_policy_declares_its_own_reservation():
    import torch

    from offload_core.module_hooks import InFlight, reserve_units
    from offload_core.registry.manager import as_contract

    class Greedy:  # written without the contract: keeps four blocks on the execution device, copies even on a CPU run
        def __init__(self, config):
            self.config = config

        def reserve(self, need):
            return reserve_units(need, need.block_bytes, 4, copies_on_cpu=True)

        def attach(self, model, context):
            raise NotImplementedError

    class Minimal:  # only the required method: every capability comes from the contract's defaults
        def attach(self, model, context):
            raise NotImplementedError

    need = InFlight(torch.device("cpu"), block_bytes=1000, module_bytes=100)
    assert as_contract("policy", "greedy", Greedy)(None).reserve(need) == {"cpu": 4000}
    minimal = as_contract("policy", "minimal", Minimal)(None)
    assert minimal.reserve(need) == {"cpu": 0}  # no reserve: one block, a view on a CPU run
    assert minimal.reserve(InFlight(torch.device("cuda", 0), 1000, 100)) == {0: 1000}
    assert (
        minimal.granularity,
        minimal.offload_buffers,
        minimal.predict_moved([3, 4]),
        minimal.own_device_map(None, None),
    ) == ("block", False, 7, None)


@pytest.mark.slow  # a whole run
def test_prefetch_pool_run_holds_its_reservation_and_matches(tmp_path):
    cfg = _cfg(
        [
            "model=synthetic",
            "model.preset=small",
            "hook=prefetch",
            "hook.pool=true",
            "hook.depth=1",
            "storage=memmap",
            "max_memory.cpu=40MiB",  # the model (42 MiB) does not fit: blocks are offloaded
            "headroom=0",
            "progress=false",
            "max_new_tokens=4",
            "compare_in_memory=true",
        ]
    )
    result = run(cfg, output_dir=tmp_path)
    assert result.matches_in_memory is True
    block = result.plan["largest_block"]
    reserve = result.plan["reserve"]["cpu"]  # two blocks as the pool lays them out (each tensor aligned)
    assert list(result.plan["reserve"]) == ["cpu"] and 2 * block <= reserve <= 2 * block + 2**16
    assert 0 < result.summary["devices"]["cpu"]["bytes"] <= 40 * 2**20 - reserve
    assert result.figures["offloaded_bytes"] > 0
    prefetch = result.figures["prefetch"]  # also in metrics.json and printed
    assert prefetch["hits"] > prefetch["misses"] > 0 and prefetch["late"] <= prefetch["hits"]


def test_a_run_s_full_collections_leave_out_what_was_made_before_it_and_take_it_back_after():
    import gc
    import weakref

    from offload_core.jobs.context import frozen_heap

    class Node:
        pass

    def garbage_cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    gc.disable()  # no automatic pass between making the garbage and freezing it
    try:
        before = garbage_cycle()  # unreachable, collectable only by the cycle collector
        with frozen_heap():
            during = garbage_cycle()
            gc.collect()
            assert before() is not None  # frozen: a full pass did not walk it
            assert during() is None  # made in the run: collected as ever
        gc.collect()
        assert before() is None  # given back to the collector when the run ends
    finally:
        gc.enable()
