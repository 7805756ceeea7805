"""align_per_call: bring a unit's offloaded tensors and the inputs to the execution device before forward, drop them
after."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from offload_core import devices
from offload_core.module_hooks.base import ModuleHook, add_hook_to_module, send_to_device
from offload_core.module_hooks.keeper import keep_page_cache
from offload_core.module_hooks.policy import PolicyContext, PolicyHandle
from offload_core.module_hooks.units import TransferStats, Unit, check_granularity, find_units
from offload_core.planning.reservation import InFlight, reserve_units
from offload_core.values import is_offloaded
from offload_core.module_hooks.policy import Policy


def _first_tensor_device(obj: Any) -> torch.device | None:
    if isinstance(obj, torch.Tensor):
        return obj.device
    if isinstance(obj, (list, tuple)):
        for item in obj:
            found = _first_tensor_device(item)
            if found is not None:
                return found
    if isinstance(obj, dict):
        for item in obj.values():
            found = _first_tensor_device(item)
            if found is not None:
                return found
    return None


class AlignDevicesHook(ModuleHook):
    """Aligns a module with its execution device.

    - ``execution_device``: where the module runs; inputs are moved there (``skip_keys`` excepted).
    - ``offload`` with ``unit``/``store``: the unit's offloaded tensors are fetched from ``store`` before
      forward and dropped after (back to their meta placeholders).
    - ``io_same_device``: outputs go back to the device the inputs came from.
    - without ``offload``: the module's own tensors (``place_submodules``: its whole subtree's; buffers
      only with ``offload_buffers`` false, as they are never offloaded then) are moved to the execution
      device once, at attach.
    """

    def __init__(
        self,
        execution_device: torch.device | str | int | None = None,
        offload: bool = False,
        io_same_device: bool = False,
        offload_buffers: bool = False,
        place_submodules: bool = False,
        skip_keys: Iterable[str] = (),
        unit: Unit | None = None,
        store: Mapping[str, torch.Tensor] | None = None,
        stats: TransferStats | None = None,
        non_blocking: bool = False,
        name: str = "align_devices",
    ) -> None:
        self.execution_device = devices.active().normalize(execution_device) if execution_device is not None else None
        self.offload = offload
        self.io_same_device = io_same_device
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = frozenset(skip_keys)
        self.unit = unit
        self.store = store
        self.stats = stats
        self.non_blocking = non_blocking
        self.name = name
        self._input_device: torch.device | None = None
        if offload and (unit is None or store is None):
            raise ValueError("AlignDevicesHook(offload=True) needs a unit and a store")

    def init_hook(self, module: nn.Module) -> None:
        if self.offload or self.execution_device is None:
            return
        modules = module.modules() if self.place_submodules else [module]
        for sub in modules:
            for table in (sub._parameters, sub._buffers):
                for local, tensor in table.items():
                    if tensor is not None and tensor.device != self.execution_device and tensor.device.type != "meta":
                        moved = tensor.data.to(self.execution_device)
                        table[local] = (
                            nn.Parameter(moved, requires_grad=tensor.requires_grad)
                            if isinstance(tensor, nn.Parameter)
                            else moved
                        )

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.io_same_device:
            self._input_device = _first_tensor_device((args, kwargs))
        if self.offload:
            self.unit.load(self.store, self.execution_device, self.stats, self.non_blocking)
        if self.execution_device is not None:
            args = send_to_device(args, self.execution_device)
            kwargs = send_to_device(kwargs, self.execution_device, skip_keys=self.skip_keys)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.offload:
            self.unit.release()
        if self.io_same_device and self._input_device is not None and self._input_device != self.execution_device:
            output = send_to_device(output, self._input_device, skip_keys=self.skip_keys)
        return output

    def on_error(self, module: nn.Module) -> None:
        if self.offload:
            self.unit.release()

    def detach_hook(self, module: nn.Module) -> None:
        if self.offload:
            self.unit.release()


def attach_io_hooks(model: nn.Module, context: PolicyContext, io_same_device: bool, skip_keys: Iterable[str]) -> list:
    """Execution-device hooks: on the root (inputs to the main device, outputs back) and, when more than one
    device computes, on every module the device map names, moving its inputs to the device it computes on
    (a GPU it is resident on, or the main device for an offloaded one): a tied model balanced over two GPUs
    computes ``cos``/``sin`` on GPU 1 for a layer on GPU 0, and a block whose tensors are offloaded one module
    at a time adds its input, from another GPU, to what its modules computed on the main one."""
    handles = []
    main = context.execution_device
    computes = {}
    for key, value in context.device_map.items():
        if isinstance(value, int) and not isinstance(value, bool):
            computes[key] = devices.gpu(value)
        elif is_offloaded(value, main):
            computes[key] = main
    several = len({*computes.values(), main}) > 1
    gpu_keys = {k: device for k, device in computes.items() if k and (device != main or several)}
    for key, device in gpu_keys.items():
        try:
            module = model.get_submodule(key)
        except AttributeError:  # a tensor-level key: its owner runs where its inputs are
            continue
        handles.append(add_hook_to_module(module, AlignDevicesHook(device, skip_keys=skip_keys, name="align_io")))
    if main.type != "cpu" or gpu_keys:
        handles.append(
            add_hook_to_module(
                model, AlignDevicesHook(main, io_same_device=io_same_device, skip_keys=skip_keys, name="align_root")
            )
        )
    return handles


@dataclass
class AlignPerCallConfig:
    name: str = "align_per_call"
    #: "module": one transfer unit per module owning offloaded tensors;
    #: "block": one per no-split block (fewer, larger transfers)
    granularity: str = "module"
    #: outputs go back to the device the inputs came from
    io_same_device: bool = True
    #: keyword arguments never moved between devices (e.g. a KV cache object)
    skip_keys: list[str] = field(default_factory=list)
    #: offload buffers with the parameters (by default buffers stay on the execution device)
    offload_buffers: bool = False


class AlignPerCall(Policy):
    """Policy: every call of a unit fetches its offloaded tensors and drops them afterwards."""

    auto = True
    keeps_page_cache = True

    def __init__(self, config: AlignPerCallConfig) -> None:
        check_granularity(config.granularity)
        self.config = config

    @property
    def granularity(self) -> str:
        return self.config.granularity

    @property
    def offload_buffers(self) -> bool:
        return self.config.offload_buffers

    def reserve(self, need: InFlight) -> dict:
        """One unit in flight: a module, or a block at ``granularity=block``."""
        return reserve_units(need, need.module_bytes if self.config.granularity == "module" else need.block_bytes)

    def attach(self, model: nn.Module, context: PolicyContext) -> PolicyHandle:
        units = find_units(model, context.offloaded, context.no_split_module_classes, self.config.granularity)
        handles = attach_io_hooks(model, context, self.config.io_same_device, self.config.skip_keys)
        for unit in units:
            hook = AlignDevicesHook(
                context.execution_device,
                offload=True,
                unit=unit,
                store=context.store,
                stats=context.stats,
                non_blocking=context.non_blocking,
                skip_keys=self.config.skip_keys,
                name="align_offload",
            )
            handles.append(add_hook_to_module(unit.module, hook))
        handles += keep_page_cache(model, context.store, context.residency, units)
        return PolicyHandle(model, context, units, handles)
