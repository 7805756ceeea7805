"""chained: a unit moves in when called and stays until the next unit in the chain is called."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from offload_core import devices
from offload_core.module_hooks.align import attach_io_hooks
from offload_core.module_hooks.base import ModuleHook, ModuleHookHandle, add_hook_to_module, send_to_device
from offload_core.module_hooks.keeper import keep_page_cache
from offload_core.module_hooks.policy import PolicyContext, PolicyHandle
from offload_core.module_hooks.units import Slot, TransferStats, Unit, find_units
from offload_core.module_hooks.policy import Policy


class ChainedHook(ModuleHook):
    """Loads its unit on call (if not loaded) after offloading ``prev`` (a :class:`ChainHandle`), and keeps it."""

    name = "chained_offload"

    def __init__(
        self,
        unit: Unit,
        store: Mapping[str, torch.Tensor],
        execution_device: torch.device,
        stats: TransferStats,
        non_blocking: bool = False,
        chain: "Chain | None" = None,
    ) -> None:
        self.unit = unit
        self.store = store
        self.execution_device = execution_device
        self.stats = stats
        self.non_blocking = non_blocking
        self.chain = chain
        self.prev: ChainHandle | None = None
        self.offloads = 0

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.chain is not None:
            self.chain.activate(self)
        elif self.prev is not None:
            self.prev.offload()
        self.unit.load(self.store, self.execution_device, self.stats, self.non_blocking)
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)

    def offload(self) -> None:
        if self.unit.loaded:
            self.unit.release()
            self.offloads += 1

    def on_error(self, module: nn.Module) -> None:
        self.offload()

    def detach_hook(self, module: nn.Module) -> None:
        self.offload()


class Chain:
    """A dynamic chain: calling a unit offloads whichever unit of the chain was called before it."""

    def __init__(self) -> None:
        self.current: ChainedHook | None = None

    def activate(self, hook: ChainedHook) -> None:
        if self.current is not None and self.current is not hook:
            self.current.offload()
        self.current = hook


class ChainHandle:
    """Returned by :func:`chain_model`: ``offload()`` drops the model's weights, ``remove()`` restores it."""

    def __init__(
        self, model: nn.Module, hook: ChainedHook, module_handle: ModuleHookHandle, policy: PolicyHandle
    ) -> None:
        self.model = model
        self.hook = hook
        self.module_handle = module_handle
        self.policy = policy

    @property
    def stats(self) -> TransferStats:
        return self.hook.stats

    def offload(self) -> None:
        self.hook.offload()

    def remove(self) -> nn.Module:
        return self.policy.remove()


def chain_model(
    model: nn.Module, store: Any, device: torch.device, prev_module_hook: ChainHandle | None = None
) -> tuple[nn.Module, ChainHandle]:
    """Move ``model``'s tensors into the empty ``store`` (a :class:`~offload_core.storage.Store`); the
    model moves to ``device`` when called and stays there until the next model of the chain (whose
    ``prev_module_hook`` is this handle) is called. Between calls the weights rest on the cpu, in the
    store's memory (accelerate's semantics), never on meta.

    The last model of a chain needs an explicit ``handle.offload()``. ``handle.remove()`` puts the
    weights back in the model (on the CPU) and removes the module hook.
    """
    slots = []
    seen: dict[int, str] = {}
    resting: dict[int, torch.Tensor] = {}
    for sub_name, sub in model.named_modules():
        for table, is_param in ((sub._parameters, True), (sub._buffers, False)):
            for local, tensor in table.items():
                if tensor is None:
                    continue
                full = f"{sub_name}.{local}" if sub_name else local
                key = seen.setdefault(id(tensor), full)
                if key == full:
                    store.put(full, tensor.detach().cpu(), owned=True)
                    held = store[full]  # between calls the weights rest on the cpu, in the store's memory
                    resting[id(tensor)] = nn.Parameter(held, requires_grad=tensor.requires_grad) if is_param else held
                slots.append(Slot(sub, local, full, key, is_param, resting[id(tensor)]))
    unit = Unit("", model, slots)
    for slot in slots:
        slot.set(slot.original)
    non_blocking = bool(store.pinned and devices.is_accelerator(device))
    context = PolicyContext(
        device_map={"": "cpu"},
        execution_device=device,
        store=store,
        offloaded={s.full: s.key for s in slots},
        non_blocking=non_blocking,
    )
    hook = ChainedHook(unit, store, device, context.stats, non_blocking=non_blocking)
    hook.prev = prev_module_hook
    module_handle = add_hook_to_module(model, hook)
    policy = PolicyHandle(model, context, [unit], [module_handle])
    return model, ChainHandle(model, hook, module_handle, policy)


@dataclass
class ChainedConfig:
    name: str = "chained"
    #: keyword arguments never moved between devices
    skip_keys: list[str] = field(default_factory=list)


class Chained(Policy):
    """Policy: the model's blocks are chained in execution order; each stays loaded until the next is called."""

    auto = True
    granularity = "block"
    keeps_page_cache = True

    config: ChainedConfig

    def predict_moved(self, unit_bytes: list[int]) -> int:
        """Bytes moved per forward: a unit stays until the next one runs, so a single offloaded unit stays
        loaded from one forward to the next and nothing moves; otherwise each is brought in once."""
        return 0 if len(unit_bytes) == 1 else sum(unit_bytes)

    def attach(self, model: nn.Module, context: PolicyContext) -> PolicyHandle:
        units = find_units(model, context.offloaded, context.no_split_module_classes, self.granularity)
        handles = attach_io_hooks(model, context, True, self.config.skip_keys)
        chain = Chain()
        nested = {
            u.name
            for u in units
            if any(o.name.startswith(u.name + ".") or (u.name == "" and o.name) for o in units if o is not u)
        }
        for unit in units:
            if unit.name in nested:
                # A container whose own tensors are offloaded runs around its children: keep it per call.
                from offload_core.module_hooks.align import AlignDevicesHook

                hook: ModuleHook = AlignDevicesHook(
                    context.execution_device,
                    offload=True,
                    unit=unit,
                    store=context.store,
                    stats=context.stats,
                    non_blocking=context.non_blocking,
                    name="align_offload",
                )
            else:
                hook = ChainedHook(
                    unit, context.store, context.execution_device, context.stats, context.non_blocking, chain
                )
            handles.append(add_hook_to_module(unit.module, hook))
        handles += keep_page_cache(model, context.store, context.residency, units)
        return PolicyHandle(model, context, units, handles)
