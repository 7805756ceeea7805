"""Shared fixtures: tensors of every dtype the stores must round-trip."""

from __future__ import annotations

import pytest
import torch


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    return {
        "f32": base.clone(),
        "f16": base.to(torch.float16),
        "bf16": base.to(torch.bfloat16),
        "i8": torch.randint(-128, 127, (5, 3), dtype=torch.int8, generator=g),
        "i64": torch.randint(-(2**40), 2**40, (7,), dtype=torch.int64, generator=g),
        "bool": torch.rand(4, 4, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 5),
        "noncontig": base.t(),
    }


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    return sample_tensors()
