"""Shared fixtures and markers: tensors of every dtype the stores must round-trip; everything under
end_to_end/ is marked slow; tests marked gpu skip cleanly without a CUDA device."""

from __future__ import annotations

import os
from pathlib import Path

# The test workers share the machine's cores: one compute thread each, and in the processes they start,
# rather than every worker's torch spreading over all cores and contending (the suite runs twice as fast).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from offload_core.testing import round_trip_tensors

END_TO_END = Path(__file__).resolve().parent / "end_to_end"
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_ignore_collect(collection_path, config):
    """With ``-m "not slow"`` the end_to_end/ folder, slow throughout, is not even imported."""
    if collection_path == END_TO_END and config.getoption("markexpr").strip() == "not slow":
        return True
    return None


def pytest_collection_modifyitems(config, items):
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if END_TO_END in item.path.parents:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(no_cuda)


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    return round_trip_tensors()
