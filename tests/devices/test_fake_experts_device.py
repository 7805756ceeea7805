"""The experts' accelerator path (DeviceLayer) worked by hand on a fake GPU, with the small module of
``tests/module_hooks/experts_layer.py`` (4 experts; rows of 24 float32 and 4 float16 bytes): which copies reach the
device (how many, how large, on which stream), what the device cache keeps and evicts, and that the host waits once
per layer (the routing) and never for a copy."""

from __future__ import annotations

import pytest
import torch

from offload_core.devices.fake import tensor as fake_tensor
from tests.module_hooks.experts_layer import ROW_BYTES, PinnedStore, RecordingStore, make_device_layers, store_tensors


class Recorder:
    """Every copy to the fake device (bytes, asynchronous or not, the stream it was issued on, whether it read the
    store's rows), every copy to the host and every host wait for an event or a stream."""

    def __init__(self, fake, store, monkeypatch) -> None:
        self.copies: list[tuple[int, bool, str, bool]] = []
        self.to_host = 0
        self.host_waits = 0
        self.on = True
        spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in store.values()]
        real_copy, real_operate, real_wait = fake_tensor._copy_from_host, fake.timeline.operate, None
        timeline = fake.timeline

        def copy(dst, src, non_blocking):
            ptr = src.data_ptr()
            stream = timeline.current(dst.device).name
            from_store = any(lo <= ptr < hi for lo, hi in spans)
            if self.on:
                self.copies.append((src.numel() * src.element_size(), bool(non_blocking), stream, from_store))
            return real_copy(dst, src, non_blocking)

        def operate(device, reads, writes, run, what, deferred=False):
            self.to_host += self.on and what == "copy to the host"
            return real_operate(device, reads, writes, run, what, deferred)

        real_wait = timeline.synchronize_event

        def wait(event):
            self.host_waits += 1
            return real_wait(event)

        monkeypatch.setattr(fake_tensor, "_copy_from_host", copy)
        monkeypatch.setattr(timeline, "operate", operate)
        monkeypatch.setattr(timeline, "synchronize_event", wait)

    def call(self, device, *experts: int, guess: tuple[int, int] = (0, 0)) -> tuple[tuple, dict]:
        """:func:`call`, its tensors' copies to the device not recorded."""
        self.on = False
        try:
            return call(device, *experts, guess=guess)
        finally:
            self.on = True

    def take(self) -> list[tuple[int, bool, str, bool]]:
        copies, self.copies = self.copies, []
        return copies


class Guess:
    """A router guess on the device: the first two values of the hidden state, as expert indices."""

    def indices(self, hidden):
        return hidden[:, :2].long()

    def __call__(self, hidden):
        return sorted(set(self.indices(hidden).reshape(-1).tolist()))


def call(device, *experts: int, guess: tuple[int, int] = (0, 0)) -> tuple[tuple, dict]:
    """The experts module's call on ``device`` for one token routed to ``experts``; its hidden state carries the
    guess of the next layer's experts (:class:`Guess`)."""
    hidden = torch.tensor([[float(guess[0]), float(guess[1]), 0.0]]).to(device)
    index = torch.tensor([list(experts)]).to(device)
    return (hidden, index, torch.ones(1, len(experts)).to(device)), {}


def assert_rows(layer, store, experts, record=None) -> None:
    """The rows of ``experts`` in the layer's device buffers are the store's (read back unrecorded)."""
    if record is not None:
        record.on = False
    host = {key: layer.buffers.get(shape, dtype).cpu() for key, (shape, dtype) in layer.specs.items()}
    if record is not None:
        record.on = True
    for expert in experts:
        assert torch.equal(host["gu"][expert], store["gu"][expert]), expert
        assert torch.equal(host["dn"][expert], store["dn"][expert]), expert


def test_misses_from_a_pinned_store_are_copied_as_they_lie_one_copy_per_tensor_and_run(fake_gpu, monkeypatch):
    fake = fake_gpu(count=1)
    device = fake.device(0)
    store = PinnedStore(fake)
    (layer,) = make_device_layers(store, device)
    assert layer.direct
    record = Recorder(fake, store, monkeypatch)
    pinned_before = len(fake.pinned_requests)
    layer.load(*record.call(device, 2, 1))  # 1 and 2 are adjacent: one copy of two rows per tensor
    assert record.take() == [(2 * 24, True, "default", True), (2 * 4, True, "default", True)]
    assert_rows(layer, store, [1, 2], record)
    layer.release()
    layer.load(*record.call(device, 0, 3))  # two runs: two copies per tensor
    assert record.take() == [(24, True, "default", True), (4, True, "default", True)] * 2
    assert_rows(layer, store, [0, 3], record)
    layer.release()
    assert len(fake.pinned_requests) == pinned_before  # no staging: the store's rows are pinned already
    c = layer.counters
    assert (c.misses, c.transfers, c.bytes) == (4, 6, 4 * ROW_BYTES)
    assert record.to_host == 2 and record.host_waits == 0  # the routing, once per call; no wait for a copy


def test_the_device_cache_serves_repeats_on_the_device_and_evicts_the_least_used(fake_gpu, monkeypatch):
    fake = fake_gpu(count=1)
    device = fake.device(0)
    store = PinnedStore(fake)
    (layer,) = make_device_layers(store, device, cache_slots=2, ahead=0)
    record = Recorder(fake, store, monkeypatch)
    cache = layer.cache
    layer.load(*record.call(device, 0, 1))
    layer.release()
    assert len(record.take()) == 2 and set(cache.resident) == {(0, 0), (0, 1)}
    layer.buffers.get(torch.Size([4, 2, 3]), torch.float32).fill_(-1.0)  # a hit must write its rows again
    layer.load(*record.call(device, 1, 0))
    layer.release()
    assert record.take() == [] and layer.counters.hits == 2  # both from the device cache: nothing from the host
    assert_rows(layer, store, [0, 1], record)
    layer.load(*record.call(device, 0, 2))  # 2 asked for once, 1 twice: 1 stays, 2 is not kept
    layer.release()
    assert [c[0] for c in record.take()] == [24, 4] and set(cache.resident) == {(0, 0), (0, 1)}
    assert cache.evictions == 0
    for _ in range(2):
        layer.load(*record.call(device, 2, 3))
        layer.release()
    # 2 asked for three times now, 1 twice: 2 takes 1's slot
    assert set(cache.resident) == {(0, 0), (0, 2)} and cache.evictions == 1
    assert_rows(layer, store, [2, 3], record)
    assert record.host_waits == 0
    fake.synchronize()
    slot = cache.get((0, 2))
    assert torch.equal(slot.rows[0].cpu(), store["gu"][2]) and torch.equal(slot.rows[1].cpu(), store["dn"][2])
    layer.shared.close()


def test_the_next_layers_guess_is_copied_on_the_copy_stream_and_waited_for_on_the_device(fake_gpu, monkeypatch):
    fake = fake_gpu(count=1)
    device = fake.device(0)
    store = PinnedStore(fake)
    first, second = make_device_layers(store, device, count=2, cache_slots=0, ahead=2, router=Guess())
    record = Recorder(fake, store, monkeypatch)
    first.load(*record.call(device, 0, guess=(3, 1)))
    first.release()
    copies = record.take()
    assert copies[:2] == [(24, True, "default", True), (4, True, "default", True)]  # the miss, needed now
    # the guesses: one copy per tensor and expert, on the copy stream, while the first layer computes
    assert copies[2:] == [(24, True, "side", True), (4, True, "side", True)] * 2
    assert sorted(second.guess) == [1, 3] and record.to_host == 1  # the routing and the guess in one transfer
    second.load(*record.call(device, 3, 1))
    assert record.take() == [] and first.counters.predicted_hits == 2
    assert_rows(second, store, [1, 3], record)
    second.release()
    assert record.host_waits == 0 and record.to_host == 2 and second.guess == {}
    # the read-ahead slots are used again for the next guess: the copy stream waits for the compute's reads of them
    for token in range(4):
        first.load(*record.call(device, token % 4, guess=(token % 4, (token + 1) % 4)))
        first.release()
        second.load(*record.call(device, token % 4))
        second.release()
    assert second.shared.made[second.signature] == 2  # no more read-ahead slots than the plan gave
    assert record.host_waits == 0 and first.counters.predicted_hits > 2
    second.shared.close()  # the slots go once the copy stream is done with them


def test_a_wrong_guess_costs_its_copy_only_and_its_slot_comes_back(fake_gpu, monkeypatch):
    fake = fake_gpu(count=1)
    device = fake.device(0)
    store = PinnedStore(fake)
    first, second = make_device_layers(store, device, count=2, ahead=2, router=Guess())
    record = Recorder(fake, store, monkeypatch)
    first.load(*record.call(device, 0, guess=(2, 2)))
    first.release()
    assert list(second.guess) == [2] and [c[2] for c in record.take()] == ["default"] * 2 + ["side"] * 2
    second.load(*record.call(device, 1))
    second.release()
    assert [c[2] for c in record.take()] == ["default", "default"] and second.guess == {}
    assert len(second.shared.free[second.signature]) == 1  # the slot of the wrong guess is free again
    assert_rows(second, store, [1], record)
    second.shared.close()


def test_an_unpinned_store_is_gathered_into_pinned_staging_of_the_misses_size(fake_gpu, monkeypatch):
    fake = fake_gpu(count=1)
    device = fake.device(0)
    store = RecordingStore()
    first, second = make_device_layers(store, device, count=2, ahead=2, router=Guess())
    assert not first.direct
    record = Recorder(fake, store, monkeypatch)
    asked = len(fake.pinned_requests)
    first.load(*record.call(device, 1, 2, guess=(0, 3)))
    # the two misses staged together: one pinned buffer per tensor of two rows, one copy per tensor
    assert fake.pinned_requests[asked:] == [(48, 64), (8, 8)]
    assert [(n, non_blocking, stream) for n, non_blocking, stream, _ in record.take()] == [
        (48, True, "default"),
        (8, True, "default"),
    ]
    assert_rows(first, store, [1, 2], record)
    first.release()
    second.reader.run()  # the reader thread stages the guesses and copies them on the copy stream
    assert [(n, stream) for n, _, stream, _ in record.take()] == [(24, "side"), (4, "side")] * 2
    second.load(*record.call(device, 0, 3))
    assert record.take() == [] and first.counters.predicted_hits == 2
    assert_rows(second, store, [0, 3], record)
    second.release()
    second.shared.close()


@pytest.mark.parametrize("pinned", [True, False])
def test_most_experts_routed_read_whole_tensors(fake_gpu, monkeypatch, pinned):
    fake = fake_gpu(count=1)
    device = fake.device(0)
    store = PinnedStore(fake) if pinned else store_tensors()
    (layer,) = make_device_layers(store, device)
    layer.whole_fraction = 0.5
    record = Recorder(fake, store, monkeypatch)
    layer.load(*record.call(device, 0, 1, 3))
    copies = record.take()
    if pinned:  # one copy per whole tensor
        assert copies == [(4 * 24, True, "default", True), (4 * 4, True, "default", True)]
    assert layer.counters.whole_reads == 1
    assert_rows(layer, store, range(4), record)
    layer.release()


def test_layers_of_other_shapes_share_the_cache_without_mixing_their_slots(fake_gpu, monkeypatch):
    from offload_core.module_hooks.experts.device import DeviceLayer
    from offload_core.module_hooks.experts.loader import expert_slots
    from offload_core.module_hooks.units import Unit
    from tests.module_hooks.experts_layer import KEYS, Moe, Queued

    fake = fake_gpu(count=1)
    device = fake.device(0)
    store = PinnedStore(fake)
    (narrow,) = make_device_layers(store, device, cache_slots=1, ahead=0)
    wide_module = Moe()
    wide_module.gate_up_proj = torch.nn.Parameter(torch.empty(4, 4, 3, device="meta"), requires_grad=False)
    wide_store = {"gu": torch.arange(48, dtype=torch.float32).view(4, 4, 3), "dn": store_tensors()["dn"]}
    unit = Unit("moe", wide_module, expert_slots("moe", wide_module, KEYS))
    wide = DeviceLayer(unit, wide_store, narrow.shared, narrow.counters, 1.0, Queued(), 1)
    record = Recorder(fake, store, monkeypatch)
    for layer, layer_store in [(narrow, store), (wide, wide_store)] * 3:
        layer.load(*record.call(device, 2))  # each takes the one slot from the other
        assert_rows(layer, layer_store, [2], record)
        slot = layer.cache.get((layer.index, 2))
        assert slot.signature == layer.signature and slot.rows[0].shape == layer_store["gu"].shape[1:]
        layer.release()
    assert narrow.cache.evictions >= 4
    narrow.shared.close()
