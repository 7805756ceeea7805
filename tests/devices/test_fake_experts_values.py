"""The experts loader's accelerator path worked by hand on a fake GPU (the small module of
``tests/module_hooks/experts_layer.py``: 4 experts, rows of 24 float32 and 4 float16 bytes): routed rows go through
pinned host memory of exactly their size into the shared device buffers, copied asynchronously; an evicted cache
slot's rows are never reused (a copy may still read them); whole tensors from a store that builds them on read go
to the device row by row."""

from __future__ import annotations

import torch

from tests.module_hooks.experts_layer import ROW_BYTES, RecordingStore, fill, make_layer, routing, store_tensors


def _host(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: buffer.cpu() for key, buffer in buffers.items()}


def test_a_routed_expert_goes_through_pinned_rows_of_its_size_copied_asynchronously(fake_gpu):
    fake = fake_gpu(count=1)
    device = fake.device(0)
    store = store_tensors()
    layer = make_layer(store, slots=1, device=device)
    assert layer.pinned and layer.buffers.device == device
    buffers = fill(layer, -1.0)
    stream = fake.timeline.default(device)
    asked = len(fake.pinned_requests)
    layer.load(*routing(1))
    # one pinned row per tensor: 24 bytes (held as 32, the next power of two) and 4 bytes
    assert fake.pinned_requests[asked:] == [(24, 32), (4, 4)]
    kept = layer.cache.get(1)
    assert all(fake.is_pinned(row) for row in kept.values())
    assert kept["gu"].shape == (2, 3) and kept["dn"].dtype == torch.float16
    assert len(stream.queue) == 2  # both rows' copies queued behind the compute (non_blocking from pinned memory)
    assert layer.unit.module.gate_up_proj.device == device
    host = _host(buffers)
    assert torch.equal(host["gu"][1], store["gu"][1]) and torch.equal(host["dn"][1], store["dn"][1])
    assert (host["gu"][0] == -1).all() and (host["dn"][3] == -1).all()
    assert (layer.counters.misses, layer.counters.bytes) == (1, ROW_BYTES)
    layer.release()


def test_on_a_gpu_an_evicted_slots_rows_are_not_reused_and_an_unkept_expert_still_goes_through_pinned_rows(
    fake_gpu,
):
    fake = fake_gpu(count=1)
    device = fake.device(0)
    store = store_tensors()
    layer = make_layer(store, slots=1, device=device)
    layer.load(*routing(2))
    layer.release()
    evicted = layer.cache.get(2)  # held here: its memory cannot be handed out again while the test holds it
    layer.load(*routing(0))  # takes 2's slot, in new pinned rows
    fake.synchronize()
    kept = layer.cache.get(0)
    assert set(layer.cache.resident) == {0}
    assert all(kept[key].data_ptr() != evicted[key].data_ptr() for key in kept)
    assert torch.equal(evicted["gu"], store["gu"][2]) and torch.equal(kept["gu"], store["gu"][0])
    layer.release()
    unkept = make_layer(store, slots=0, device=device)
    buffers = fill(unkept, -1.0)
    before = len(fake.pinned_requests)
    unkept.load(*routing(3, 1))
    assert fake.pinned_requests[before:] == [(24, 32), (4, 4)] * 2 and unkept.cache.resident == {}
    assert (unkept.counters.misses, unkept.counters.bytes) == (2, 2 * ROW_BYTES)
    host = _host(buffers)
    assert torch.equal(host["gu"][3], store["gu"][3]) and torch.equal(host["dn"][3], store["dn"][3])
    unkept.release()


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
