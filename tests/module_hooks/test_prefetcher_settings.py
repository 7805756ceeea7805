"""What a new Prefetcher is set to: its depth, whether it copies into the block pool and carries bytes through the
staging ring (by device and store, or as asked), its counters, and the kept set it applies."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_core.module_hooks.prefetch import Prefetcher, StagingRing
from offload_core.module_hooks.prefetch.transfer import STAGING_CHUNK
from offload_core.module_hooks.units import TransferStats, find_units
from offload_core.storage.residency import Residency
from offload_core.storage.base import MappingStore

CPU = torch.device("cpu")


def _units_and_store():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 8))
    store = MappingStore({name: t.detach().clone() for name, t in model.state_dict().items()})
    return find_units(model, {name: name for name in store}, [], "block"), store


class _PinnedStore(MappingStore):
    """A store whose tensors are in pinned host memory (as ``pinned_cpu``): nothing to stage."""

    pinned = True


def test_a_new_prefetcher_on_a_cpu_maps_and_holds_nothing_yet():
    units, store = _units_and_store()
    stats = TransferStats()
    prefetcher = Prefetcher(units, store, CPU, 2, stats)
    assert prefetcher.units is units and prefetcher.store is store and prefetcher.stats is stats
    assert prefetcher.device == CPU and prefetcher.depth == 2 and prefetcher.reads_ahead
    assert prefetcher.copy is False and prefetcher.staging is None and not prefetcher.accel.cuda
    assert prefetcher.keeper is None and prefetcher.residency is None and prefetcher.block_pool is None
    assert (prefetcher.hits, prefetcher.misses, prefetcher.borrowed, prefetcher.late, prefetcher.reread) == (0,) * 5
    assert prefetcher.waited_s == 0.0 and prefetcher.pending == {} and prefetcher.held == {}
    assert prefetcher.trace.order == [] and not prefetcher.trace.complete


@pytest.mark.parametrize(("depth", "expected"), [(-3, 0), (0, 0), (1, 1), (2.0, 2), ("3", 3)])
def test_depth_is_a_whole_number_never_below_zero(depth, expected):
    units, store = _units_and_store()
    prefetcher = Prefetcher(units, store, CPU, depth, TransferStats())
    assert prefetcher.depth == expected and prefetcher.reads_ahead is (expected > 0)
    assert prefetcher.blocks.count == expected + 1  # two leaf units side by side: one loaded at a time


def test_copying_and_staging_on_a_cpu_when_asked():
    units, store = _units_and_store()
    prefetcher = Prefetcher(units, store, CPU, 1, TransferStats(), copy=True, staging=True, staging_chunk=8192)
    assert prefetcher.copy is True
    assert isinstance(prefetcher.staging, StagingRing) and prefetcher.staging.accel is prefetcher.accel
    assert prefetcher.staging.chunk == 8192
    plain = Prefetcher(units, store, CPU, 1, TransferStats(), copy=0, staging=False)
    assert plain.copy is False and plain.staging is None


def test_on_a_gpu_it_copies_and_stages_only_a_store_that_is_not_pinned(fake_gpu):
    device = fake_gpu().device(0)
    units, store = _units_and_store()
    prefetcher = Prefetcher(units, store, device, 1, TransferStats())
    assert prefetcher.accel.cuda and prefetcher.copy is True
    assert isinstance(prefetcher.staging, StagingRing) and prefetcher.staging.chunk == STAGING_CHUNK
    pinned = Prefetcher(units, _PinnedStore(store), device, 1, TransferStats())
    assert pinned.copy is True and pinned.staging is None
    mapped = Prefetcher(units, store, device, 1, TransferStats(), copy=False, staging=False)
    assert mapped.copy is False and mapped.staging is None


def test_a_kept_set_is_applied_to_the_units_by_their_stored_bytes():
    units, store = _units_and_store()
    residency = Residency(budget=1 << 30)
    prefetcher = Prefetcher(units, store, CPU, 1, TransferStats(), residency=residency)
    keeper = prefetcher.keeper
    assert prefetcher.residency is residency and keeper.residency is residency
    assert keeper.store is store and keeper.units is units and all(u.observer is keeper for u in units)
    # what their pages take in the page cache (as the plan counts them), not their aligned layout in a pool buffer:
    # unit "0": weight 64 bytes and bias 16; unit "1": weight 128 and bias 32
    assert residency.kept == {"0": 80, "1": 160} and prefetcher.unit_bytes(units[0]) == 512
    assert keeper.warm is False  # the reader thread brings pages in: the compute thread does not read them again
