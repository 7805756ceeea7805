"""The host memory a CUDA run registers with the driver (``pinned_arena``) is a tensor whose storage starts where
the registered pages start: torch asks whether a tensor is pinned at its storage's start, and a graph capture
refuses a copy from one it does not find pinned (an arena sliced out of a larger allocation was refused on an H200,
and its copies went through the staging buffers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from offload_core.devices.torch_backend import PAGE, page_aligned


@pytest.mark.parametrize("nbytes", [1, PAGE, PAGE + 904, 3 * 2**20 + 7])
def test_an_arena_starts_its_storage_at_its_first_page(nbytes):
    arena = page_aligned(nbytes)
    storage = arena.untyped_storage()
    assert arena.numel() == nbytes and arena.dtype == torch.uint8
    assert arena.data_ptr() == storage.data_ptr() and storage.data_ptr() % PAGE == 0
    assert storage.nbytes() == -(-nbytes // PAGE) * PAGE  # whole pages of its own: none shared with other memory
    arena.fill_(7)
    view = arena[nbytes // 2 :]
    del arena
    assert int(view.sum()) == 7 * view.numel()  # a view keeps the pages alive


def _rss_anon() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("RssAnon:"))) * 1024


def test_an_arena_is_private_anonymous_memory_as_rss_counts_it():
    """Not shared memory: the anonymous RSS a budget is held to counts it (a forked process gets its own copy)."""
    before = _rss_anon()
    arena = page_aligned(64 * 2**20)
    arena.fill_(1)
    assert _rss_anon() - before >= 60 * 2**20


def test_the_fake_accelerator_finds_its_arenas_and_their_views_pinned_and_nothing_else(fake_gpu):
    fake = fake_gpu(count=1, memory="16MiB")
    arena = fake.pinned_arena(3 * PAGE)
    assert fake.is_pinned(arena) and fake.is_pinned(arena[PAGE + 5 :])
    pageable = torch.empty(3 * PAGE, dtype=torch.uint8)
    assert not fake.is_pinned(pageable) and not fake.is_pinned(pageable[PAGE:])
