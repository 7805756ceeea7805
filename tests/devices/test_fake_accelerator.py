"""The fake accelerator itself: what it catches (a buffer read, overwritten or freed before the event guarding it,
a pinned buffer rewritten under a copy in flight), what it counts (device memory, pinned memory as PyTorch
rounds it) and what it answers (device counts, free memory, device mismatches)."""

from __future__ import annotations

import gc

import pytest
import torch

from offload_core.devices.fake import FakeAccelerator, HazardError


@pytest.fixture
def fake():
    accelerator = FakeAccelerator(count=2, memory=1 << 20)
    accelerator.install()
    yield accelerator
    accelerator.uninstall()


def _side_copy(fake, nbytes=256):
    device = fake.device(0)
    side = fake.new_stream(device)
    host = fake.pinned_empty(nbytes)
    host.fill_(7)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    with fake.on_stream(side):
        dst.copy_(host, non_blocking=True)
    return side, host, dst


def test_a_copy_runs_late_and_reading_it_unordered_is_a_hazard(fake):
    side, host, dst = _side_copy(fake)
    assert torch.all(dst.elem == 255)  # issued, not run: new device memory holds garbage
    with pytest.raises(HazardError):
        dst.sum()
    fake.timeline.hazards.clear()
    fake.wait_event(fake.current_stream(fake.device(0)), fake.record_event(side))
    assert int(dst.sum()) == 7 * 256 and not fake.hazards


def test_overwriting_a_buffer_the_compute_stream_may_still_read_is_a_hazard(fake):
    side, host, dst = _side_copy(fake)
    fake.synchronize_event(fake.record_event(side))
    dst.sum()  # the compute stream reads it
    with fake.on_stream(side), pytest.raises(HazardError):
        dst.copy_(host, non_blocking=True)  # without waiting for the compute stream's event
    fake.timeline.hazards.clear()
    fake.wait_event(side, fake.record_event(fake.current_stream(fake.device(0))))
    with fake.on_stream(side):
        dst.copy_(host, non_blocking=True)
    assert not fake.hazards


def test_rewriting_a_pinned_buffer_under_a_copy_in_flight_is_a_hazard(fake):
    side, host, dst = _side_copy(fake)
    host.fill_(9)  # the copy has not read it yet
    fake.synchronize_event(fake.record_event(side))
    assert fake.hazards and "rewritten" in fake.hazards[0]
    assert int(dst.elem.sum()) == 9 * 256  # the copy read the buffer when it ran, as a DMA would


def test_freeing_a_buffer_another_stream_still_writes_is_a_hazard(fake):
    side, host, dst = _side_copy(fake)
    del dst
    gc.collect()
    assert fake.hazards and "freed" in fake.hazards[0]
    fake.timeline.hazards.clear()
    side, host, dst = _side_copy(fake)
    fake.record_stream(dst, side)  # the allocator waits for the side stream before handing it out again
    del dst
    side2, host2, dst2 = _side_copy(fake)
    fake.synchronize_stream(side2)
    del dst2
    gc.collect()
    assert not fake.hazards


def test_memory_counts_and_answers(fake):
    assert fake.count() == 2 and fake.mem_get_info(1) == (1 << 20, 1 << 20)
    a = torch.empty(1000, dtype=torch.uint8, device=fake.device(1))
    view = a[10:20]
    assert fake.memory_allocated(1) == 1024 and fake.mem_get_info(1)[0] == (1 << 20) - 1024  # 512-byte blocks
    del a
    assert fake.memory_allocated(1) == 1024  # the view keeps the block
    del view
    assert fake.memory_allocated(1) == 0 and fake.max_memory_allocated(1) == 1024
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2 << 20, dtype=torch.uint8, device=fake.device(0))
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(3, device=fake.device(0)) + torch.ones(3, device=fake.device(1))
    with pytest.raises(RuntimeError, match="same device"):
        torch.equal(torch.ones(3, device=fake.device(0)), torch.ones(3))


def test_pinned_memory_is_counted_as_pytorch_holds_it(fake):
    small = fake.pinned_empty(33 * 2**20 // 32)  # 1.03 MiB asks for 2 MiB from the caching allocator
    assert fake.is_pinned(small) and fake.pinned_bytes == 2 * 2**20
    del small
    gc.collect()
    assert fake.pinned_bytes == 2 * 2**20  # freed blocks stay cached
    arena = fake.pinned_arena(10_000)
    assert fake.is_pinned(arena[5000:]) and fake.pinned_bytes == 2 * 2**20 + 12_288  # whole pages
    fake.free_arena(arena)
    assert fake.pinned_bytes == 2 * 2**20 and not fake.is_pinned(torch.empty(4))
