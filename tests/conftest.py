"""Shared fixtures: tensors of every dtype the stores must round-trip."""

from __future__ import annotations

import pytest
import torch

from offload_core.testing import round_trip_tensors


def sample_tensors() -> dict[str, torch.Tensor]:
    return round_trip_tensors()


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    return sample_tensors()
