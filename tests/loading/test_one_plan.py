"""One plan step behind every door: ``from_pretrained(path, ...)`` and ``run.py model=local model.path=path
plan_only=true`` with the same budget and strategies make the same device map, reservation and page-cache plan."""

from __future__ import annotations

import pytest

from offload_core import from_pretrained
from offload_core.runner.job import run
from offload_core.testing import tiny_tied_llama

#: strategies both doors are given; the page cache as a size (``auto`` reads the memory free now)
STRATEGIES = [
    ("sequential", "memmap", "align_per_call", "64KiB"),
    ("balanced", "safetensors", "prefetch", "0"),
    ("sequential", "pinned_cpu", "chained", "lru"),
]
CHECKPOINTS = ["llama_tied", "llama", "mixtral", "bert"]
#: each checkpoint with one set of strategies in the quick subset; the rest of the grid is slow
CASES = [
    pytest.param(name, *strategies, marks=() if (i - j) % len(STRATEGIES) == 0 else pytest.mark.slow)
    for i, name in enumerate(CHECKPOINTS)
    for j, strategies in enumerate(STRATEGIES)
]


def _checkpoint(name, saved, tmp_path):
    if name == "llama_tied":
        tiny_tied_llama(tmp_path / "llama_tied")
        return tmp_path / "llama_tied"
    return saved(name).path


def _run_plan(compose_run, path, budget, placement, storage, hook, page_cache, tmp_path):
    overrides = [
        "plan_only=true",
        "model=local",
        "model.tokenizer=bytes",
        f"model.path={path}",
        f"max_memory.cpu={budget}",
        "headroom=0",
        "over_budget=warn",  # pinned_cpu holds the disk tier in memory, over the budget
        f"placement={placement}",
        f"storage={storage}",
        f"hook={hook}",
        f"page_cache={page_cache}",
        "execution_device=cpu",
        "progress=false",
    ]
    return run(compose_run(overrides), output_dir=tmp_path / "run", plot=False)


@pytest.mark.parametrize("name,placement,storage,hook,page_cache", CASES)
def test_from_pretrained_and_a_plan_only_run_make_the_same_plan(
    name, placement, storage, hook, page_cache, saved, compose_run, tmp_path
):
    path = _checkpoint(name, saved, tmp_path)
    budget = 24 * 1024 if name != "mixtral" else 200 * 1024
    planned = _run_plan(compose_run, path, budget, placement, storage, hook, page_cache, tmp_path)
    model = from_pretrained(
        path,
        offload={
            "placement": placement,
            "storage": storage,
            "policy": hook,
            "offload_folder": tmp_path / "off",
            "execution_device": "cpu",
            "page_cache": page_cache,
            "headroom": 0,
            "over_budget": "warn",
        },
        max_memory={"cpu": budget},
    )
    try:
        loaded = model.offload_plan
        assert "disk" in set(planned.device_map.values()), planned.device_map
        assert loaded.device_map == planned.device_map
        assert model.hf_device_map == planned.device_map
        assert loaded.as_dict()["reserve"] == planned.plan["reserve"]
        assert loaded.page_cache == planned.plan["page_cache"]
    finally:
        model.offload_state.remove()


def test_a_policys_own_device_map_is_the_plan_of_both_doors(saved, compose_run, tmp_path):
    # functional_call with cpu_offload makes its own map (vLLM's): from_pretrained takes it as run.py does
    from offload_core.registry.manager import get_registry

    path = saved("llama").path
    planned = run(
        compose_run(
            [
                "plan_only=true",
                "model=local",
                "model.tokenizer=bytes",
                f"model.path={path}",
                "max_memory.cpu=10MiB",
                "headroom=0",
                "hook=functional_call",
                "hook.cpu_offload=40KiB",
                "execution_device=cpu",
                "page_cache=0",
            ]
        ),
        output_dir=tmp_path / "run",
        plot=False,
    )
    policy = get_registry().create("policy", "functional_call", {"name": "functional_call", "cpu_offload": "40KiB"})
    model = from_pretrained(
        path,
        offload={
            "policy": policy,
            "offload_folder": tmp_path / "off",
            "execution_device": "cpu",
            "page_cache": 0,
            "headroom": 0,
        },
        max_memory={"cpu": 10 * 2**20},
    )
    try:
        assert "disk" in set(planned.device_map.values())
        assert model.offload_plan.device_map == planned.device_map
        assert model.offload_plan.page_cache == planned.plan["page_cache"]
    finally:
        model.offload_state.remove()
