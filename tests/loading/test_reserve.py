"""The reservation for units in flight counts the copies a store makes on read: tensors built from several
checkpoint tensors (per-expert MoE weights read in place) as well as tensors stored in another dtype."""

from __future__ import annotations

import pytest
import torch

from offload_core import init_empty_weights
from offload_core.loading.checkpoint import Checkpoint
from offload_core.loading.reserve import reserve_for
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
        reserve = reserve_for(
            model, checkpoint, policy, storage, torch.device("cpu"), list(model._no_split_modules), dtype, None
        )
    assert (reserve.get("cpu", 0) > 0) == holds_back
