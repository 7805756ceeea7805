"""The packed host-memory store of ``storage.codec=exponent``: which tensors it packs and which it keeps raw, what it
hands out (decoded tensors, specs, bytes a read moves) and the chunk size it tells a decoding device."""

from __future__ import annotations

import pytest
import torch

from offload_core.errors import ConfigError
from offload_core.storage import StoreContext, codec
from offload_core.storage.packed import PackedMemoryStore
from offload_core_plugins.storage_pinned_cpu import PinnedCpuConfig, PinnedCpuStorage


def _weights(*shape: int, seed: int = 0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.02).to(torch.bfloat16)


def test_bf16_weights_are_packed_the_rest_kept_raw():
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    tensors = {
        "big": _weights(96, 100),  # 9600 elements: two chunks of 8192
        "small": _weights(64, 64, seed=1),  # one chunk of 4096
        "norm": _weights(100, seed=2),  # under MIN_ELEMENTS
        "fp32": _weights(96, 100, seed=3).float(),
        "fp16": _weights(96, 100, seed=4).half(),
        "spread": every,  # uniform high bytes: packing would not save bytes
        "ids": torch.arange(10_000),
    }
    store = PackedMemoryStore(StoreContext(names=list(tensors)), pin=False, chunk=8192)
    for name, tensor in tensors.items():
        store.put(name, tensor)
    store.finalize()
    assert {name for name in store if store.packed(name) is not None} == {"big", "small"}
    assert len(store) == len(tensors) and set(store) == set(tensors)
    for name, tensor in tensors.items():
        assert store.spec(name) == (tensor.shape, tensor.dtype)
        held = store[name]
        assert held.shape == tensor.shape and torch.equal(
            held.view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)
        )
        out = torch.empty_like(tensor)
        store.read_into(name, out)
        assert torch.equal(out.view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8))
    big = store.packed("big")
    assert store.moved_nbytes("big") == big.nbytes < 0.85 * 9600 * 2
    assert store.moved_nbytes("fp32") is None and store.offset("big") == 0 and store.mapped_view("big") is None
    assert not store.warm("big")  # never served in place: the caller copies (decodes) it
    # the largest chunk of the store, for the decoding scratch: 8192, not the 4096 of "small" alone
    assert store.packed("small").chunk == store.packed("big").chunk == 8192
    assert store.raw_nbytes == (9600 + 4096) * 2
    store.verify()
    store.close()
    assert len(store) == 0


def test_a_store_of_small_tensors_asks_for_a_small_scratch():
    store = PackedMemoryStore(StoreContext(names=["a"]), pin=False)
    store.put("a", _weights(64, 80))
    store.finalize()
    assert store.packed("a").chunk == 64 * 80
    assert codec.scratch_bytes(store.packed("a").chunk) < 2**16


def test_the_storage_options():
    assert PinnedCpuStorage(PinnedCpuConfig()).decode_scratch == 0
    assert PinnedCpuStorage(PinnedCpuConfig(codec="exponent", codec_chunk=1024)).decode_scratch == codec.scratch_bytes(
        1024
    )
    with pytest.raises(ConfigError, match="storage.codec=lz4 is not a codec of pinned_cpu: give one of none, exponent"):
        PinnedCpuStorage(PinnedCpuConfig(codec="lz4"))
    with pytest.raises(ConfigError, match="storage.codec_chunk=1 is below 2"):
        PinnedCpuStorage(PinnedCpuConfig(codec="exponent", codec_chunk=1))


def test_a_store_that_packs_nothing_says_so(caplog):
    store = PackedMemoryStore(StoreContext(names=["a"]), pin=False)
    store.put("a", _weights(64, 80).float())
    store.finalize()
    assert store.packed("a") is None
    assert (
        "packed nothing: it applies to bf16 tensors of 4096 elements or more, and the offloaded tensors are float32"
        in (caplog.text)
    )
