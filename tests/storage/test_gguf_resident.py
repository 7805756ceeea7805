"""storage=gguf storage.resident=quantized: the offloaded tensors' quantized blocks held in memory, the resident tensors
planned within what they leave of the cpu budget; the budget search, the plan's lines, auto=true's two variants and a
bad value in one line; the store's pool of buffers."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

import offload_core
from offload_core.errors import ConfigError
from offload_core.loading.checkpoint import Checkpoint
from offload_core.plan.held import budget_beside_held, held_bytes
from offload_core.registry.manager import get_registry
from tests.gguf_files import half_offloaded_map, write_gguf

BUDGET = 3 * 2**20


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_gguf(
        tmp_path_factory.mktemp("gguf-resident") / "llama.gguf",
        "llama",
        {"token_embd": int(T.Q8_0)},
        default=int(T.Q4_1),
    )


def _gguf(resident: str):
    return get_registry().create("storage", "gguf", {"resident": resident})


def test_the_budget_search_fits_the_resident_and_the_held_bytes():
    # a model of 10 units of 100 bytes held in 25 each: a map within c keeps c // 100 units resident
    def held_for(cpu: int) -> int:
        return 25 * (10 - min(cpu // 100, 10))

    found = budget_beside_held(600, held_for, step=1)
    assert found + held_for(found) <= 600 < found + 100 + held_for(found + 100)
    assert budget_beside_held(2000, held_for) == 2000  # everything fits dequantized: nothing held
    assert budget_beside_held(100, held_for, step=1) == 0  # not even everything held fits
    assert held_bytes(["a", "a", "b"], {"a": 3, "b": 4}) == 7  # a tied tensor is held once


def test_quantized_residency_plans_more_resident_bytes_within_the_budget_and_reads_nothing_from_the_file(path):
    plans = {}
    for resident in ("dequantized", "quantized"):
        model = offload_core.from_pretrained(
            path, offload={"storage": _gguf(resident), "headroom": 0, "page_cache": 0}, max_memory={"cpu": BUDGET}
        )
        try:
            plans[resident] = model.offload_plan
            if resident == "quantized":
                store = model.offload_state.store
                assert store.held_nbytes() == model.offload_plan.store_memory > 0
                stats = model.offload_state.stats
                stats.reset()
                with torch.no_grad():
                    model(torch.tensor([[1, 2, 3]]))
                assert stats.bytes == model.offload_plan.predicted_bytes_per_token  # the quantized bytes, from memory
        finally:
            model.offload_state.release()
    dequantized, quantized = plans["dequantized"], plans["quantized"]
    assert dequantized.store_memory is None
    resident = quantized.summary["devices"]["cpu"]["bytes"]
    assert resident + quantized.store_memory <= BUDGET
    with Checkpoint.open(path) as checkpoint:
        everything = sum(checkpoint.stored_nbytes(k) for k in checkpoint.keys())
    assert quantized.store_memory <= everything
    lines = "\n".join(quantized.conversion)
    assert (
        "held quantized in memory, dequantized before each use" in lines and "held in memory in stored bytes" in lines
    )
    assert quantized.page_cache == {} and dequantized.page_cache  # nothing of the file to keep or stream
    assert "read quantized in place" in "\n".join(dequantized.conversion)


def test_auto_tries_both_and_a_bad_value_is_one_line():
    factory = get_registry().get("storage", "gguf").factory
    assert [v["resident"] for v in factory.auto_variants()] == ["dequantized", "quantized"]
    assert _gguf("quantized").reads_from == "memory" and _gguf("dequantized").reads_from == "checkpoint"
    with pytest.raises(ConfigError, match="storage.resident='packed' is not one of dequantized, quantized") as error:
        _gguf("packed")
    assert "\n" not in str(error.value)


def test_the_store_pool_hands_a_buffer_out_again_only_once_nothing_holds_it():
    from torch import nn

    from offload_core.storage.gguf.buffers import BufferPool

    pool = BufferPool()
    first = pool.take(64, torch.float32)
    param = nn.Parameter(first.view(8, 8), requires_grad=False)  # what a module hook makes of it
    del first
    second = pool.take(64, torch.float32)
    assert second.data_ptr() != param.data_ptr()  # in use: a new one
    del param, second
    again = pool.take(64, torch.float32)
    assert pool.nbytes() == 2 * 64 * 4  # both reused from now on: no third
    assert pool.take(64, torch.float32).data_ptr() != again.data_ptr() and pool.nbytes() == 2 * 64 * 4


def test_a_packed_weights_blocks_are_held_once_for_its_two_parts(path):
    """Quantized compute splits a weight into its values and scales, both read from the weight's blocks: held
    quantized, the blocks are held once, as the plan counts them."""
    storage = get_registry().create("storage", "gguf", {"resident": "quantized", "compute": "quantized"})
    offload = {"storage": storage, "device_map": half_offloaded_map(), "over_budget": "warn"}
    model = offload_core.from_pretrained(path, offload=offload, max_memory={"cpu": "1GiB"})
    try:
        assert model.offload_state.store.held_nbytes() == model.offload_plan.store_memory > 0
    finally:
        model.offload_state.release()
