"""accelerate's balanced budgets and largest layer, importable from ``offload_core`` as the accelerate recipe lists
them, give accelerate's own results (compared where accelerate is installed; it never is a dependency)."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
import transformers
from torch import nn

import offload_core
from offload_core.loading.empty import init_empty_weights
from offload_core.planning import compute_module_sizes
from tests import ROOT

BIG = 10**6


def test_every_name_the_accelerate_recipe_lists_is_importable_from_offload_core():
    intro = (ROOT / "docs" / "recipes" / "from-accelerate.md").read_text().split("\n\n")[1]
    names = re.findall(r"`(\w+)`", intro.split("take accelerate's arguments")[0])
    assert {"get_balanced_memory", "get_max_layer_size"} <= set(names)
    missing = [name for name in names if not callable(getattr(offload_core, name, None))]
    assert missing == []
    assert {"get_balanced_memory", "get_max_layer_size"} <= set(offload_core.__all__)


def test_get_max_layer_size_takes_accelerates_arguments_and_opens_splittable_modules():
    model = nn.Sequential(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)), nn.Linear(16, 16))
    sizes = compute_module_sizes(model)
    params = list(inspect.signature(offload_core.get_max_layer_size).parameters)
    assert params == ["modules", "module_sizes", "no_split_module_classes"]
    assert offload_core.get_max_layer_size(list(model.named_children()), sizes, []) == (1088, ["0.0", "1"])
    assert offload_core.get_max_layer_size(list(model.named_children()), sizes, ["Sequential"]) == (1360, ["0"])


class Block(nn.Sequential):
    def __init__(self, width: int = 16) -> None:
        super().__init__(nn.Linear(width, width), nn.Linear(width, width))


class OwnWeight(nn.Module):
    """Holds a tensor itself beside a child that holds none: a leaf module by accelerate's rule."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(100))
        self.act = nn.ReLU()


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        tie_word_embeddings=True,
    )
    with init_empty_weights():
        return transformers.LlamaForCausalLM(config)


MODELS = {
    "blocks": lambda: nn.Sequential(Block(), nn.Linear(16, 16), nn.Linear(16, 16)),
    "unequal_blocks": lambda: nn.Sequential(Block(8), Block(32), nn.Linear(16, 16)),
    "own_weight": lambda: nn.Sequential(OwnWeight(), nn.Linear(16, 16)),
    "linear": lambda: nn.Linear(16, 16),
    "llama": _llama,
}
BUDGETS = [
    {0: BIG, 1: BIG},
    {0: BIG, 1: BIG, 2: BIG, "cpu": BIG},
    {0: 1000, 1: BIG, "cpu": 5},
    {0: 0, 1: BIG, 2: BIG},
    {0: BIG, 1: 3000, 2: 3000},
    {0: "1MB", 1: "20KB", "cpu": BIG},  # accelerate cannot read a "disk" budget here
]


def test_balanced_memory_of_blocks_of_unequal_size_follows_the_first_block_as_accelerate_does():
    """Blocks 8 and 32 wide (576 and 8,448 bytes) and a 1,088-byte linear: 10,112 bytes in five leaf linears (a mean
    of 2,022); the buffer is 1.25 x the larger of that mean and the first Block (576 bytes), not the largest Block
    (which would make it 10,560)."""
    model = MODELS["unequal_blocks"]()
    assert offload_core.get_balanced_memory(model, {0: BIG, 1: BIG}, ["Block"]) == {0: 5056 + 2527, 1: BIG}
    # GPU 0 given nothing is the low one; GPU 1 is capped at all of it over the n - 1 = 1 GPU left
    assert offload_core.get_balanced_memory(model, {0: 0, 1: BIG, 2: BIG}, low_zero=True) == {
        0: 0,
        1: 10112 + 2527,
        2: BIG,
    }


@pytest.mark.parametrize("name", list(MODELS))
def test_results_are_accelerates(name):
    accelerate = pytest.importorskip("accelerate.utils.modeling", reason="accelerate is not installed")
    ours = inspect.signature(offload_core.get_balanced_memory).parameters
    assert list(ours) == list(inspect.signature(accelerate.get_balanced_memory).parameters)
    model = MODELS[name]()
    classes = [[], ["Block"], ["LlamaDecoderLayer", "LlamaRMSNorm"], ["ReLU"], "Block"]
    for budgets in BUDGETS:
        for no_split in classes:
            for low_zero in (False, True):
                for dtype in (None, torch.float16):
                    args = (model, dict(budgets), no_split)
                    expected = accelerate.get_balanced_memory(*args, dtype=dtype, low_zero=low_zero)
                    got = offload_core.get_balanced_memory(*args, dtype=dtype, low_zero=low_zero)
                    assert got == expected, (budgets, no_split, low_zero, dtype)
    theirs = accelerate.compute_module_sizes(model)
    assert dict(compute_module_sizes(model)) == dict(theirs)
    for no_split in classes[:3]:
        units = list(model.named_children()) or [("", model)]
        assert offload_core.get_max_layer_size(units, theirs, no_split) == accelerate.get_max_layer_size(
            units, theirs, no_split
        )
