"""Hybrid prefetch (``hybrid=true``): on a GPU run, a decoding step of one sequence computes the plan's host units on
the CPU from their host-resident weights (no copy; their KV cache moves to the host), while the other offloaded units
stream to the GPU as prefetch streams them; the copies run while the host computes. Prefill and batches stream all."""

from __future__ import annotations

import os
import time
from typing import Any, Iterable

import torch
from torch import nn

from offload_core.module_hooks.align import attach_io_hooks
from offload_core.module_hooks.base import ForwardStartHook, add_hook_to_module, send_to_device
from offload_core.module_hooks.policy import PolicyContext, PolicyHandle
from offload_core.module_hooks.prefetch.policy import Prefetch, PrefetchConfig, PrefetchHandle
from offload_core.module_hooks.prefetch.prefetcher import Prefetcher, PrefetchHook
from offload_core.module_hooks.units import Unit, find_units
from offload_core.planning.hybrid import HOST_MAX_TOKENS, Split, solve_split

CPU = torch.device("cpu")


def host_threads() -> int:
    """Threads the host computes with: the cores this process may use less one, which issues the copies and runs
    the GPU's launches (at least one; never more than torch would use)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores - 1, torch.get_num_threads()) if cores > 1 else 1)


def step_tokens(args: tuple, kwargs: dict) -> int | None:
    """Tokens a block's call computes (rows x positions of its hidden states, its first tensor argument)."""
    hidden = kwargs.get("hidden_states")
    if hidden is None:
        hidden = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        return None
    return hidden.numel() // hidden.shape[-1]


def layer_index(module: nn.Module) -> int | None:
    """The KV cache layer a block writes (its attention's ``layer_idx``), or None."""
    for sub in module.modules():
        index = getattr(sub, "layer_idx", None)
        if isinstance(index, int) and not isinstance(index, bool):
            return index
    return None


def move_cache_layer(kwargs: dict, index: int | None, device: torch.device) -> None:
    """Move the cached keys and values of layer ``index`` in the call's cache to ``device`` (once per phase change:
    the layer then grows where it computes)."""
    caches = (kwargs.get(name) for name in ("past_key_values", "cache", "past_key_value"))  # by transformers release
    layers = next((c.layers for c in caches if isinstance(getattr(c, "layers", None), list)), None)
    if index is None or layers is None or index >= len(layers):
        return
    layer = layers[index]
    for attr in ("keys", "values"):
        tensor = getattr(layer, attr, None)
        if isinstance(tensor, torch.Tensor) and tensor.device != device:
            setattr(layer, attr, tensor.to(device))
    if isinstance(getattr(layer, "device", None), torch.device):
        layer.device = device


def host_capable(unit: Unit) -> bool:
    """Whether all of a unit's tensors are offloaded (it can compute on the host from the store alone)."""
    slotted = {(id(s.owner), s.local) for s in unit.slots}
    for sub in unit.module.modules():
        for table in (sub._parameters, sub._buffers):
            for local, tensor in table.items():
                if tensor is not None and (id(sub), local) not in slotted:
                    return False
    return True


class HybridPrefetcher(Prefetcher):
    """A prefetcher whose read-ahead, while decoding, skips the units the host computes."""

    def __init__(self, *args: Any, host: Iterable[int] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.host = set(host)
        self.decoding = False  # the last block call was a decoding step: the host units compute on the host
        self.host_calls = 0
        self.host_s = 0.0

    def _window(self, index: int, predicted: bool) -> list[int]:
        if not self.decoding or not self.host or (self.residency is not None and not self.copy):
            return super()._window(index, predicted)  # (a kept set on mapped pages: no GPU run)
        n = len(self.units)
        ahead = self.trace.upcoming(n) if predicted else list(range(index + 1, n))
        return [i for i in ahead if i not in self.host][: self.depth]

    def host_step(self, index: int) -> None:
        """Unit ``index`` computes on the host: recorded in the trace, the streamed units after it read ahead."""
        predicted = self.trace.observe(index)
        if self.reads_ahead:
            upcoming = self._window(index, predicted)
            for stale in [i for i in self.pending if i not in upcoming]:
                self._drop_pending(stale)
            self._schedule(upcoming)


class HostComputeHook(PrefetchHook):
    """On a host unit: a decoding step computes it on the CPU from the store's tensors; a larger step streams it."""

    name = "prefetch_offload"

    def __init__(self, index: int, prefetcher: HybridPrefetcher, execution_device: torch.device, max_tokens: int):
        super().__init__(index, prefetcher, execution_device)
        self.max_tokens = max_tokens
        self.layer = layer_index(prefetcher.units[index].module)
        self.on_host = False
        self.started = 0.0

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        tokens = step_tokens(args, kwargs)
        prefetcher = self.prefetcher
        self.on_host = prefetcher.decoding = tokens is not None and tokens <= self.max_tokens
        if not self.on_host:
            with torch.inference_mode(False):
                move_cache_layer(kwargs, self.layer, self.execution_device)
            return super().pre_forward(module, args, kwargs)
        prefetcher.host_step(self.index)
        unit = prefetcher.units[self.index]
        with torch.inference_mode(False):  # the store's own tensors, in place: nothing is copied
            unit.load(prefetcher.store, CPU, None, fetched={key: prefetcher.store[key] for key in unit.keys})
        with torch.inference_mode(False):  # plain host tensors (an accelerator's tensor under it may stay put)
            move_cache_layer(kwargs, self.layer, CPU)
            args, kwargs = send_to_device(args, CPU), send_to_device(kwargs, CPU)
        self.started = time.perf_counter()
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if not self.on_host:
            return super().post_forward(module, output)
        self.prefetcher.host_s += time.perf_counter() - self.started
        self.prefetcher.host_calls += 1
        self.prefetcher.units[self.index].release()
        self.on_host = False
        with torch.inference_mode(False):
            return send_to_device(output, self.execution_device)


class HybridHandle(PrefetchHandle):
    """Prefetch's handle, with the host units' counters; ``remove()`` gives torch its thread count back."""

    def __init__(self, *args: Any, threads: int, split: Split | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.threads = threads
        self.split = split  # the split it runs, and the per-step times its rates predict

    def counters(self) -> dict[str, int | float]:
        p = self.prefetcher
        return {**super().counters(), "host_units": len(p.host), "host_calls": p.host_calls, "host_s": p.host_s}

    def remove(self, restore_device: torch.device | str = "cpu") -> nn.Module:
        if not self.removed:
            torch.set_num_threads(self.threads)
        return super().remove(restore_device)


class HybridPrefetch(Prefetch):
    """Prefetch with the plan's host units (by name) computed on the host in decoding steps of up to ``max_tokens``;
    ``host_units`` None: measured and solved as it attaches (:meth:`solve`)."""

    auto = False
    decodes_on_device = False  # its reader (HybridPrefetcher) copies what the store hands out

    def __init__(
        self,
        config: PrefetchConfig,
        host_units: Iterable[str] | None = None,
        split: Split | None = None,
        max_tokens: int = HOST_MAX_TOKENS,
        threads: int | None = None,
    ) -> None:
        super().__init__(config)
        self.host_units = None if host_units is None else list(host_units)
        self.split = split
        self.max_tokens = max_tokens
        self.threads = threads

    def plan_lines(self) -> list[str]:
        """The split and the per-step bound it predicts against streaming every unit."""
        s = self.split
        if s is None:
            if self.host_units is None:
                return ["  hybrid: the split is measured and solved when the model is dispatched"]
            return [f"  hybrid: {len(self.host_units)} offloaded blocks computed on the host in decoding steps"]
        return [
            f"  hybrid: {len(s.host)} of {len(s.host) + len(s.streamed)} offloaded units computed on the host in "
            f"decoding steps of up to {self.max_tokens} token(s), {len(s.streamed)} streamed",
            f"  hybrid: predicted per token {s.step_s * 1e3:.1f} ms (copy {s.copy_s * 1e3:.1f} ms, host "
            f"{s.host_s * 1e3:.1f} ms, GPU {s.gpu_s * 1e3:.1f} ms) against a copy-only bound of "
            f"{s.copy_only_s * 1e3:.1f} ms ({s.ratio:.2f}x)",
        ]

    def attach(self, model: nn.Module, plan: PolicyContext) -> PolicyHandle:
        self.check_pool(plan.execution_device)
        units = find_units(model, plan.offloaded, plan.no_split_module_classes, self.granularity)
        before = torch.get_num_threads()
        threads = self.threads or host_threads()
        if self.host_units is None and units:  # no plan gave the split: measured on this model, solved here
            torch.set_num_threads(threads)
            try:
                self.solve(model, units, plan)
            finally:
                torch.set_num_threads(before)
        names = set(self.host_units or ())
        host = [i for i, u in enumerate(units) if u.name in names and host_capable(u)]
        handles = attach_io_hooks(model, plan, True, ())
        prefetcher = self.make_prefetcher(units, plan, host)
        if units and ((prefetcher.depth and not prefetcher.copy) or prefetcher.residency is not None):
            handles.append(add_hook_to_module(model, ForwardStartHook("prefetch_revalidate", prefetcher.revalidate)))
        device = plan.execution_device
        for index, unit in enumerate(units):
            hook = (
                HostComputeHook(index, prefetcher, device, self.max_tokens)
                if index in prefetcher.host
                else PrefetchHook(index, prefetcher, device)
            )
            handles.append(add_hook_to_module(unit.module, hook))
        if host:
            torch.set_num_threads(threads)
        return HybridHandle(model, plan, units, handles, prefetcher=prefetcher, threads=before, split=self.split)

    def solve(self, model: nn.Module, units: list[Unit], plan: PolicyContext) -> None:
        """The split from rates measured on ``model``'s first offloaded block (:mod:`.hybrid_rates`)."""
        from offload_core.module_hooks.prefetch.hybrid_rates import measure_rates

        no_split = set(plan.no_split_module_classes)
        eligible = [i for i, u in enumerate(units) if type(u.module).__name__ in no_split and host_capable(u)]
        self.host_units = []
        if not eligible:
            return
        blocks = sum(1 for m in model.modules() if type(m).__name__ in no_split)
        rates = measure_rates(model, units[eligible[0]], plan.store, plan.execution_device, blocks - len(eligible))
        self.split = solve_split([u.nbytes(plan.store) for u in units], eligible, rates)
        self.host_units = [units[i].name for i in self.split.host]

    def make_prefetcher(self, units: list[Unit], plan: PolicyContext, host: Iterable[int] = ()) -> HybridPrefetcher:
        return HybridPrefetcher(units, host=host, **self.prefetcher_options(plan))


def check_hybrid_device(device: torch.device, given: str = "hybrid=true") -> None:
    """A run that computes on no accelerator cannot be hybrid: one line saying so (``given``: how the user asked)."""
    from offload_core import devices
    from offload_core.errors import ConfigError

    if not devices.is_accelerator(device):
        raise ConfigError(
            f"{given} computes part of the offloaded blocks on the host while the others stream to a GPU; this run "
            f"computes on {device}: leave hybrid out (or run on a GPU)"
        )


def hybrid_policy(policy: Any, device: torch.device) -> HybridPrefetch:
    """``from_pretrained(..., hybrid=True)``'s policy: ``policy`` (None or prefetch) made hybrid, its split measured
    and solved as it attaches; a GPU run only."""
    from offload_core.errors import ConfigError

    check_hybrid_device(device, "hybrid=True")
    if isinstance(policy, HybridPrefetch):
        return policy
    if isinstance(policy, Prefetch):
        return HybridPrefetch(policy.config)
    if policy not in (None, "prefetch"):
        raise ConfigError(
            f"hybrid=True streams the other blocks with policy='prefetch', not {policy!r}: pass policy='prefetch'"
        )
    return HybridPrefetch(PrefetchConfig())
