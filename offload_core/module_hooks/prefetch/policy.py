"""The prefetch policy: block-granular units read ahead along the recorded execution order, its settings and its
handle."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from offload_core.module_hooks.align import attach_io_hooks
from offload_core.module_hooks.base import ForwardStartHook, add_hook_to_module
from offload_core.module_hooks.prefetch.decode import DecodingPrefetcher, packs
from offload_core.module_hooks.prefetch.layout import pool_shape
from offload_core.module_hooks.prefetch.hook import PrefetchHook
from offload_core.module_hooks.prefetch.prefetcher import Prefetcher
from offload_core.module_hooks.prefetch.transfer import STAGING_BUFFERS
from offload_core.module_hooks.policy import PolicyContext, PolicyHandle
from offload_core.module_hooks.units import Unit, find_units
from offload_core.planning.reservation import InFlight, reserve_units
from offload_core.module_hooks.policy import Policy
from offload_core.values import budget_key


class PrefetchHandle(PolicyHandle):
    """The prefetch policy's handle: its counters are the prefetcher's."""

    def __init__(self, *args: Any, prefetcher: Prefetcher, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefetcher = prefetcher

    def counters(self) -> dict[str, int | float]:
        """Blocks read ahead (``hits``) or loaded on demand (``misses``), read-ahead waited for (``late``,
        ``wait_s``), tied tensors borrowed, read-ahead read again after the page cache evicted it, and
        recorded execution orders dropped because a unit ran out of order (``invalidations``); with a
        kept set (``PolicyContext.residency``), its figures (:meth:`Residency.counters`)."""
        p = self.prefetcher
        return {
            "hits": p.hits,
            "misses": p.misses,
            "late": p.late,
            "wait_s": p.waited_s,
            "borrowed": p.borrowed,
            "read_again": p.reread,
            "invalidations": p.trace.invalidations,
            **super().counters(),
        }

    def offload_all(self) -> None:
        self.prefetcher.close()  # read-aheads let go and the reader ended before the store can close
        super().offload_all()

    def remove(self, restore_device: torch.device | str = "cpu") -> nn.Module:
        self.prefetcher.close()
        return super().remove(restore_device)


@dataclass
class PrefetchConfig:
    name: str = "prefetch"
    #: look-ahead depth k: how many upcoming offloaded blocks are in flight while one computes (with a
    #: kept set on a mapped run, streamed blocks: kept ones between them are read ahead too, at no cost)
    depth: int = 2
    #: copy blocks into k+1 reusable buffers on the execution device (null: on a GPU run, or where the
    #: store converts on read; true on a CPU run reads mapped pages into private buffers ahead of use)
    pool: Optional[bool] = None
    #: GPU run from a store that is not pinned: size of each of the pinned staging buffers
    staging_chunk: str = "16MiB"


class Prefetch(Policy):
    """Policy: block-granular units, loaded ahead of use along the recorded execution order."""

    auto = True

    @classmethod
    def auto_variants(cls) -> list[dict]:
        """``auto=true`` tries reading one and two blocks ahead."""
        return [{"depth": 1}, {"depth": 2}]

    granularity = "block"
    keeps_page_cache = True
    overlaps_io = True
    decodes_on_device = True  # DecodingPrefetcher

    def __init__(self, config: PrefetchConfig) -> None:
        from offload_core.errors import ConfigError
        from offload_core.values import parse_size

        if config.depth < 0:
            raise ConfigError(
                f"hook.depth={config.depth} is negative: give the number of blocks to read ahead (0 turns prefetch off)"
            )
        self.chunk = parse_size(config.staging_chunk, what="hook.staging_chunk")
        if self.chunk < 4096:
            raise ConfigError(f"hook.staging_chunk={config.staging_chunk} is below 4KiB: give a size such as 16MiB")
        self.config = config

    def reserve(self, need: InFlight) -> dict:
        """The blocks that run (one, or as many as are nested) and ``depth`` more read ahead, as the prefetcher's pool
        holds them (:func:`pool_shape`, of the offloaded units where the plan says which): copies on a GPU, in the
        pool with ``pool=true``, or where the store converts; on a GPU run from a store that is not pinned, the
        staging ring in host memory too (nothing where nothing is offloaded)."""
        self.check_pool(need.execution_device)
        nesting, unit_bytes = 1, need.block_bytes
        if need.model is not None:  # the pool the prefetcher makes: depth + the deepest nesting of units, each padded
            nesting, capacity = pool_shape(
                need.model, need.no_split_module_classes, need.dtype, need.execution_device, need.offloaded
            )
            unit_bytes = capacity if need.offloaded is not None else max(unit_bytes, capacity)
        reserve = reserve_units(need, unit_bytes, nesting + self.config.depth, copies_on_cpu=bool(self.config.pool))
        if need.execution_device.type != "cpu":
            if self.decodes_on_device and (need.offloaded is None or need.offloaded):  # the packed tensors' scratch
                reserve[budget_key(need.execution_device)] += need.store_scratch
            staged = not need.store_pinned and (need.offloaded is None or bool(need.offloaded))
            reserve["cpu"] = STAGING_BUFFERS * self.chunk if staged else 0
        return reserve

    def lighter(self) -> tuple[Prefetch, str] | None:
        """One block fewer read ahead (``depth`` 0 at the least: the blocks that run, brought in when called)."""
        if self.config.depth <= 0:
            return None
        depth = self.config.depth - 1
        return type(self)(dataclasses.replace(self.config, depth=depth)), f"hook.depth={depth}"

    def check_pool(self, execution_device: torch.device) -> None:
        """``pool=false`` hands the model mapped host pages as its weights: only a CPU run can compute on them."""
        from offload_core import devices
        from offload_core.errors import ConfigError

        if self.config.pool is False and devices.is_accelerator(execution_device):
            raise ConfigError(
                f"hook.pool=false serves the weights as mapped host pages, which a run on {execution_device} "
                "cannot compute on: leave hook.pool unset (or true) on a GPU run"
            )

    def attach(self, model: nn.Module, plan: PolicyContext) -> PolicyHandle:
        self.check_pool(plan.execution_device)
        units = find_units(model, plan.offloaded, plan.no_split_module_classes, self.granularity)
        handles = attach_io_hooks(model, plan, True, ())
        prefetcher = self.make_prefetcher(units, plan)
        if units and ((prefetcher.depth and not prefetcher.copy) or prefetcher.residency is not None):
            # each forward pass starts by re-queueing read-ahead the page cache evicted
            handles.append(add_hook_to_module(model, ForwardStartHook("prefetch_revalidate", prefetcher.revalidate)))
        for index, unit in enumerate(units):
            handles.append(add_hook_to_module(unit.module, PrefetchHook(index, prefetcher, plan.execution_device)))
        return PrefetchHandle(model, plan, units, handles, prefetcher=prefetcher)

    def make_prefetcher(self, units: list[Unit], plan: PolicyContext) -> Prefetcher:
        """The reader that :meth:`attach` drives. A seam: a subclass may build it otherwise (tests force
        the pinned staging ring on, to run the GPU data path on a CPU)."""
        return (DecodingPrefetcher if packs(plan.store) else Prefetcher)(units, **self.prefetcher_options(plan))

    def prefetcher_options(self, plan: PolicyContext) -> dict[str, Any]:
        """What a prefetcher of this policy is built with beside its units: the store, device, depth, counters,
        copy pool, staging chunk and kept set."""
        return dict(
            store=plan.store,
            device=plan.execution_device,
            depth=self.config.depth,
            stats=plan.stats,
            copy=self.config.pool,
            staging_chunk=self.chunk,
            residency=plan.residency,
        )
