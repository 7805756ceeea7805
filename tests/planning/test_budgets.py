"""Budgets read from the machine and the execution device's checks, on the fake accelerator: exact values and lines."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from offload_core.errors import ConfigError
from offload_core.planning import get_balanced_memory, get_max_memory
from offload_core.planning.budgets import check_execution_device
from tests.logs import records_of


def test_gpu_budgets_are_90_percent_of_each_gpus_free_memory(fake_gpu):
    fake = fake_gpu(count=2, memory=1000)
    held = torch.empty(512, dtype=torch.uint8, device=fake.device(1))  # GPU 1 has 488 bytes free
    budgets = get_max_memory()
    assert (budgets[0], budgets[1]) == (900, 439) and list(budgets) == [0, 1, "cpu"]  # 0.9 x 488 = 439.2
    del held


def test_the_execution_device_is_checked_in_one_line(fake_gpu):
    def said(value) -> str:
        with pytest.raises(ConfigError) as info:
            check_execution_device(value)
        return str(info.value)

    assert said("nonsense") == "execution_device='nonsense' is not a device: use cpu, cuda or cuda:N"
    assert said("meta") == "execution_device='meta' is not supported: use cpu or cuda:N"
    with pytest.raises(
        ConfigError,
        match=r"^execution_device='cuda:99' does not exist: this machine has \d+ CUDA "
        r"device\(s\); use cpu$",
    ):
        check_execution_device("cuda:99")  # a cuda device, on whatever this machine has
    fake = fake_gpu(count=2, memory=1000)
    assert check_execution_device(fake.device(1)) == fake.device(1) and check_execution_device("cpu").type == "cpu"
    assert (
        said(fake.device(5))
        == "execution_device='fakegpu:5' does not exist: this machine has 2 CUDA device(s); use cpu"
    )


def test_balanced_budgets_plan_for_another_machine_silently_and_count_special_dtypes():
    """One 16 x 16 linear: 1,088 bytes, and no module below the root to take a mean of (accelerate's rule counts the
    modules under the model), so the cap is 1,088 / 2; its weight in float16 makes it 512 + 64 bytes: 576 / 2."""
    big = 10**6
    with records_of("offload_core.planning.budgets", logging.WARNING) as said:
        get_max_memory({97: big})
    assert [line[:26] for line in said] == ["Device 97 is not available"]  # what a check of this machine says
    with records_of("offload_core.planning.budgets", logging.WARNING) as said:
        assert get_balanced_memory(nn.Linear(16, 16), {97: big, 99: big}) == {97: 544, 99: big}
    assert said == []  # GPUs 97 and 99 are not on this machine: planning for another one says nothing
    assert get_balanced_memory(nn.Linear(16, 16), {0: big, 1: big}, special_dtypes={"weight": torch.float16}) == {
        0: 288,
        1: big,
    }
    assert get_balanced_memory(nn.Linear(16, 16), {0: 1, 1: big, 2: big}) == {
        0: 1,
        1: 362,
        2: big,
    }  # 1 byte is a GPU: 1,088 // 3


class Byte(nn.Module):
    """A leaf of one byte."""

    def __init__(self) -> None:
        super().__init__()
        self.flag = nn.Parameter(torch.zeros(1, dtype=torch.int8), requires_grad=False)


def test_a_one_byte_leaf_counts_in_the_mean_leaf():
    """Leaves of 1,088 and 1 bytes: mean 544, so each cap is 1,089 // 2 + int(1.25 x 544) = 544 + 680."""
    model = nn.Sequential(nn.Linear(16, 16), Byte())
    assert get_balanced_memory(model, {0: 10**6, 1: 10**6}) == {0: 544 + 680, 1: 10**6}
