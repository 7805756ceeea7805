"""The fill on models small enough to work by hand: what each device holds back, what it says, the flags of
``infer_auto_device_map``. Sizes are float32: a 16 x 16 linear is 272 floats (1,088 bytes), a 4 x 4 one 20 (80
bytes)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from offload_core.planning import infer_auto_device_map
from tests.logs import records_of

FILL = "offload_core.planning.fill"


def three_linears() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(4, 4))  # 1,088 + 1,088 + 80 bytes


def test_only_the_main_devices_hold_back_room_and_an_empty_gpu_says_what_it_needed():
    """GPU 0 (main) holds back the largest unit (1,088) so unit 0 (1,088) cannot join it in 1,088 bytes; GPU 1 is not
    a main device and holds back nothing, so units 0 and 1 fill its 2,176 bytes exactly; unit 2 goes to the cpu."""
    with records_of(FILL) as said:
        device_map = infer_auto_device_map(three_linears(), {0: 1088, 1: 2176, "cpu": 10**6})
    assert device_map == {"0": 1, "1": 1, "2": "cpu"}
    assert said == [
        "no modules could be assigned to these devices due to insufficient memory (0: 2176 bytes required); give "
        "them at least that much, or plan with fallback_allocation=True"
    ]
    with records_of(FILL) as said:  # one byte short of unit 0 and the 1,088 held back: GPU 0 stays empty
        assert infer_auto_device_map(three_linears(), {0: 2175, 1: 2176, "cpu": 10**6}) == {"0": 1, "1": 1, "2": "cpu"}
    assert [line[:80] for line in said] == [
        "no modules could be assigned to these devices due to insufficient memory (0: 2176 bytes required); give "[:80]
    ]
    with records_of(FILL) as said:
        assert infer_auto_device_map(three_linears(), {0: 2176, 1: 2176, "cpu": 10**6}) == {"0": 0, "1": 1, "2": 1}
    assert said == []


def test_verbose_says_where_each_unit_goes():
    with records_of(FILL) as said:
        infer_auto_device_map(three_linears(), {"cpu": 10**6}, verbose=True)
    assert said == ["Putting 0 (size=1088) on cpu", "Putting 1 (size=1088) on cpu", "Putting 2 (size=80) on cpu"]


def test_clean_result_false_keeps_one_key_per_unit_where_the_clean_map_merges():
    """The outer Sequential (160 bytes) with the 1,088 held back for the linear after it does not fit 1,100 bytes of
    cpu; its halves (80 each) do not either (80 + 1,088), nor the linear once they are offloaded (1,088 + 80)."""
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(16, 16))
    assert infer_auto_device_map(model, {"cpu": 1100}) == {"": "disk"}
    assert infer_auto_device_map(model, {"cpu": 1100}, clean_result=False) == {
        "0.0": "disk",
        "0.1": "disk",
        "1": "disk",
    }
    # 1,168: the first half fits beside the 1,088 held back; the second half then needs 80 + 80 + 1,088; the last
    # linear 80 + 1,088 + 80 held back for the half on disk
    assert infer_auto_device_map(model, {"cpu": 1168}) == {"0.0": "cpu", "0.1": "disk", "1": "disk"}
    assert infer_auto_device_map(model, {"cpu": 1248}) == {"": "cpu"}


@pytest.mark.parametrize("budget, warns", [(1100, True), (1127, True), (1128, False)])
def test_buffers_of_offloaded_modules_warn_when_no_gpu_has_room_for_them(budget, warns):
    """A batch norm over 4 features: weight and bias 32 bytes, buffers 40 (running mean and variance 32, the int64
    count 8). The 16 x 16 linear (1,088) with the 72 held back for the norm does not fit GPU 0, so both go to the cpu;
    GPU 0 keeps 1,088 back for streaming them, leaving budget - 1,088 for the norm's 40 bytes of buffers."""
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert infer_auto_device_map(model, {0: budget, "cpu": 10**6}) == {"": "cpu"}
        infer_auto_device_map(model, {0: budget, "cpu": 10**6}, offload_buffers=True)
    said = [str(w.message) for w in caught]
    assert said == (
        [
            "Current model requires 40 bytes of buffer for offloaded layers, which seems does not fit any GPU's "
            "remaining memory. If you are experiencing a OOM later, please consider using offload_buffers=True."
        ]
        if warns
        else []
    )


def test_dtype_and_special_dtypes_size_the_units():
    """In float16 the linears are 544, 544 and 40 bytes: unit 0 fits 1,100 beside the 544 held back, unit 1 does not
    (544 + 544 + 40), nor unit 2 once unit 1 is offloaded (544 + 40 + 544). With only unit 0's weight in float16
    (512 + 64 of bias = 576), 1,700 bytes take unit 0 beside 1,088 held back, not unit 1 (576 + 1,088 + 80)."""
    assert infer_auto_device_map(three_linears(), {"cpu": 1100}) == {"": "disk"}
    assert infer_auto_device_map(three_linears(), {"cpu": 1100}, dtype="float16") == {
        "0": "cpu",
        "1": "disk",
        "2": "disk",
    }
    assert infer_auto_device_map(three_linears(), {"cpu": 1700}) == {"0": "disk", "1": "disk", "2": "cpu"}
    assert infer_auto_device_map(three_linears(), {"cpu": 1700}, special_dtypes={"0.weight": torch.float16}) == {
        "0": "cpu",
        "1": "disk",
        "2": "disk",
    }


def test_fallback_allocation_looks_inside_modules_breadth_first():
    """Unit 0 (1,088) with 1,088 held back does not fit GPU 0's 1,200 bytes; fallback looks at unit 0, then opens the
    Sequential: its first linear does not fit either, its 4 x 4 linear (80 + 1,088 held back) does."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Sequential(nn.Linear(16, 16), nn.Linear(4, 4)))
    assert infer_auto_device_map(model, {0: 1200, "cpu": 10**6}) == {"": "cpu"}
    assert infer_auto_device_map(model, {0: 1200, "cpu": 10**6}, fallback_allocation=True) == {
        "0": "cpu",
        "1.0": "cpu",
        "1.1": 0,
    }


def test_a_model_without_tensors_goes_whole_to_the_first_device():
    assert infer_auto_device_map(nn.Sequential(nn.ReLU()), {0: 10, "cpu": 10}) == {"": 0}
    assert infer_auto_device_map(nn.Sequential(nn.ReLU()), {"cpu": 10}) == {"": "cpu"}
    assert infer_auto_device_map(nn.Sequential(nn.ReLU()), {}) == {"": "disk"}


class Head(nn.Module):
    """A module with a child and a direct weight (tied below): the weight is a unit of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.weight = nn.Parameter(torch.zeros(10, 4))


def test_a_tie_to_a_direct_weight_of_a_splittable_module_goes_with_its_partner():
    """The embedding (160 bytes) and its tied partner head.weight (counted once) fill GPU 0's 160 bytes together;
    head.proj (80) follows to the cpu."""
    model = nn.ModuleDict({"embed": nn.Embedding(10, 4), "head": Head()})
    model["head"].weight = model["embed"].weight
    assert infer_auto_device_map(model, {0: 160, "cpu": 10**6}, reserve={}) == {
        "embed": 0,
        "head.weight": 0,
        "head.proj": "cpu",
    }
