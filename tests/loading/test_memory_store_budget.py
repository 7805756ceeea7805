"""A store that holds offloaded weights in memory (``pinned_cpu``) keeps the disk tier in anonymous memory beside the
cpu tier: a plan that would put that over ``max_memory.cpu`` is refused in one line naming the stores that read from
files and the budget that holds it, or run over with ``over_budget="warn"`` (a warning line), and the peak anonymous
memory of such a run is what the line says."""

from __future__ import annotations

import logging

import pytest
import torch

import offload_core
from offload_core.errors import ConfigError
from tests.logs import records_of


def test_pinned_cpu_over_the_cpu_budget_is_refused_or_warned(saved):
    path = saved("llama").path
    options = {"storage": "pinned_cpu", "execution_device": "cpu", "headroom": 0}
    with pytest.raises(ConfigError) as refused:
        offload_core.from_pretrained(path, {"cpu": "60KiB"}, options)
    line = str(refused.value)
    assert (
        "\n" not in line and line.startswith("storage=pinned_cpu holds the ") and "offloaded to disk in memory" in line
    )
    assert "use storage=safetensors or storage=memmap" in line and "raise max_memory.cpu to at least " in line
    needed = int(line.rsplit("raise max_memory.cpu to at least ", 1)[1].split()[0])
    with records_of("offload_core.plan.limits", logging.WARNING) as said:
        model = offload_core.from_pretrained(path, {"cpu": "60KiB"}, {**options, "over_budget": "warn"})
    try:
        assert len(said) == 1 and "storage=pinned_cpu holds the " in said[0] and "the run will go over it by" in said[0]
        assert "disk" in set(model.hf_device_map.values())
        assert model(torch.tensor([[1, 2, 3]])).logits.shape[:2] == (1, 3)
    finally:
        model.offload_state.remove()
    fits = offload_core.from_pretrained(path, {"cpu": needed}, options)  # the budget the line names holds it
    fits.offload_state.remove()


def test_a_store_reading_files_is_not_held_to_it(saved):
    model = offload_core.from_pretrained(
        saved("llama").path, {"cpu": "60KiB"}, {"storage": "memmap", "execution_device": "cpu", "headroom": 0}
    )
    try:
        assert "disk" in set(model.hf_device_map.values())
    finally:
        model.offload_state.remove()
