"""storage=gguf's kept set is planned and kept in the file's bytes (the page cache holds its quantized blocks, not the
float32 tensors they dequantize to): a page cache the size of the offloaded blocks keeps them all."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

import offload_core
from tests.gguf_files import write_gguf

BUDGET = 3 * 2**20


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf-page-cache") / "llama.gguf", "llama", default=int(T.Q4_0))


def _loaded(path, page_cache):
    return offload_core.from_pretrained(
        path,
        offload={"storage": "gguf", "policy": "align_per_call", "headroom": 0, "page_cache": page_cache},
        max_memory={"cpu": BUDGET},
    )


def test_a_page_cache_the_size_of_the_offloaded_blocks_keeps_them_all(path):
    streamed = _loaded(path, 0)
    try:
        in_file = streamed.offload_plan.page_cache["offloaded_bytes"]  # the offloaded tensors' quantized blocks
        floats = streamed.offload_state.offloaded_bytes()  # the float32 tensors they dequantize to
    finally:
        streamed.offload_state.release()
    assert 0 < in_file < floats / 4  # Q4_0: 4.5 bits a weight
    model = _loaded(path, in_file)
    try:
        assert model.offload_plan.page_cache["streamed_bytes"] == 0
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
        counters = model.offload_state.handle.counters()
    finally:
        model.offload_state.release()
    assert counters["streamed_blocks"] == 0 and counters["kept_bytes"] == in_file
    assert counters["dropped_bytes"] == 0 and counters["kept_served_bytes"] == in_file
