"""Whole reads into a device buffer worked by hand on a fake GPU (the small module of
``tests/module_hooks/experts_layer.py``: 4 experts, rows of 24 float32 and 4 float16 bytes): whole tensors from a
store that builds them on read go to the device row by row, through one host row (as the GPU layers read a store
that is not page-locked)."""

from __future__ import annotations

import torch

from tests.module_hooks.experts_layer import ROW_BYTES, RecordingStore, fill, make_layer, routing, store_tensors


def _host(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: buffer.cpu() for key, buffer in buffers.items()}


def test_a_whole_read_to_the_gpu_from_a_store_that_reads_rows_itself_goes_row_by_row(fake_gpu):
    fake = fake_gpu(count=1)
    device = fake.device(0)
    store = RecordingStore()
    layer = make_layer(store, whole_fraction=0.25, device=device)
    buffers = fill(layer, -1.0)
    layer.load(*routing(3))
    assert store.calls == [("read_expert", "gu", e) for e in range(4)] + [("read_expert", "dn", e) for e in range(4)]
    assert store.outs == [((2, 3), torch.float32)] * 4 + [((1, 2), torch.float16)] * 4  # one host row of each
    host = _host(buffers)
    assert torch.equal(host["gu"], store["gu"]) and torch.equal(host["dn"], store["dn"])
    assert layer.counters.whole_reads == 1 and layer.counters.bytes == 4 * ROW_BYTES
    layer.release()
    plain = store_tensors()
    other = make_layer(plain, whole_fraction=0.25, device=device)
    buffers = fill(other, -1.0)
    other.load(*routing(0))
    host = _host(buffers)
    assert torch.equal(host["gu"], plain["gu"]) and torch.equal(host["dn"], plain["dn"])
    other.release()
