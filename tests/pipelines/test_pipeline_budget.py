"""A pipeline's plan holds what its policy copies: a diffusers component is loaded in memory by copying every tensor
to an aligned address, so on a machine whose kernels care a store reading the safetensors in place copies each
tensor lying elsewhere, and those copies are held back from the cpu budget (they went over it unplanned: a
prefetch run of a 0.38 GB pipeline on a 0.13 GB budget took 0.29 GB of block buffers on top)."""

from __future__ import annotations

import logging

import pytest
import torch

import offload_core
from offload_core.alignment import assume_kernels_depend_on_alignment
from offload_core.errors import ConfigError
from offload_core.loading.pipeline import component_no_split
from offload_core.loading.pipeline_load import open_pipeline
from offload_core.plan.reserve import whole_limit
from offload_core.plan.reserve import Reserver, units_in_flight
from offload_core.planning import compute_module_sizes
from offload_core.registry.manager import get_registry

from tests.logs import records_of

CPU = torch.device("cpu")


def _policy(name: str):
    return get_registry().create("policy", name, None)


def _storage(name: str):
    return get_registry().create("storage", name, None)


@pytest.mark.parametrize("depends", [True, False])
def test_the_reservation_counts_the_copies_a_misaligned_component_needs(pipeline_dir, depends):
    empty, checkpoint, no_split = open_pipeline(pipeline_dir, None, 0)
    with checkpoint, assume_kernels_depend_on_alignment(depends):
        starts = [checkpoint.safetensors_file(checkpoint.file_of(k)).byte_range(k)[0] for k in checkpoint.keys()]
        assert any(start % 64 for start in starts)  # safetensors aligns to 8 bytes only: some tensors lie elsewhere
        held = Reserver.of(empty.modules, checkpoint, _storage("safetensors"), CPU, no_split, empty.dtype)(
            _policy("chained")
        )
    sizes = compute_module_sizes(empty.modules, dtype=empty.dtype)
    block = max(sizes[name] for name, m in empty.modules.named_modules() if type(m).__name__ in no_split)
    # chained holds one unit in flight: the largest block, copied where the kernels care; views of the file if not
    assert held == {"cpu": block if depends else 0}


def test_units_in_flight_are_the_policys_own():
    assert units_in_flight(None, CPU) == 1
    assert units_in_flight(_policy("align_per_call"), CPU) == 1
    assert units_in_flight(_policy("chained"), CPU) == 1
    prefetch = get_registry().create("policy", "prefetch", {"depth": 3})
    assert units_in_flight(prefetch, CPU) == 4  # the one that runs and three read ahead
    # the budget shared by those units and what runs beside them
    assert whole_limit({"cpu": 1000}, CPU, prefetch) == 200
    assert whole_limit({"cpu": 1000}, CPU, _policy("chained")) == 500
    assert whole_limit({0: 1000}, CPU, prefetch) is None  # no budget on the device that computes


def test_a_block_class_larger_than_the_limit_is_split_into_its_inner_blocks(pipeline_dir):
    empty, checkpoint, _ = open_pipeline(pipeline_dir, None, 0)
    checkpoint.close()
    sizes = compute_module_sizes(empty.modules, dtype=empty.dtype)
    unet_blocks = empty.block_classes["unet"]
    largest: dict[str, int] = {}
    for name, module in empty.modules.unet.named_modules(prefix="unet"):
        cls = type(module).__name__
        if cls in unet_blocks:
            largest[cls] = max(largest.get(cls, 0), sizes[name])
    assert len(set(largest.values())) > 1, largest  # the tiny UNet's blocks differ in size
    limit = (min(largest.values()) + max(largest.values())) // 2
    chosen = component_no_split(empty, limit, empty.dtype)
    for cls, size in largest.items():
        assert (cls in chosen) == (size <= limit), (cls, size, limit)


def test_a_policy_whose_units_in_flight_do_not_fit_the_budget_says_so_in_one_line_or_is_refused(pipeline_dir):
    options = dict(
        storage="safetensors",
        policy="prefetch",
        no_split_module_classes=["UNet2DConditionModel", "CLIPTextModel", "AutoencoderKL"],
        headroom=0,
    )
    with assume_kernels_depend_on_alignment(True), pytest.raises(ConfigError) as refused:
        offload_core.from_pretrained(pipeline_dir, {"cpu": 20_000}, {**options, "over_budget": "refuse"})
    line = str(refused.value)
    assert "\n" not in line and line.startswith("hook=prefetch holds ") and "units in flight" in line
    assert "over max_memory.cpu=19.53 KiB: the run would go over it by" in line
    assert "(over_budget=refuse); raise max_memory.cpu to at least" in line
    with assume_kernels_depend_on_alignment(True), records_of("offload_core.plan.limits", logging.WARNING) as said:
        pipeline = offload_core.from_pretrained(pipeline_dir, {"cpu": 20_000}, {**options, "over_budget": "warn"})
    pipeline.offload_state.remove()
    assert len(said) == 1 and "\n" not in said[0], said
    assert said[0].startswith("hook=prefetch holds ") and "the run will go over it by" in said[0]
    assert "over max_memory.cpu=19.53 KiB" in said[0] and "raise max_memory.cpu to at least" in said[0]
    assert set(pipeline.hf_device_map.values()) == {"disk"}  # the budget holds nothing beside the units in flight
