"""Compose a device map, a store and a module-hook policy on a model: ``dispatch_model`` and
``load_checkpoint_and_dispatch``."""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from offload_core import defaults, devices
from offload_core.alignment import maps_checkpoint
from offload_core.errors import ConfigError
from offload_core.module_hooks.base import no_auto_compile
from offload_core.module_hooks.policy import PolicyContext, PolicyHandle
from offload_core.module_hooks.units import tensor_nbytes
from offload_core.options import named_options
from offload_core.planning import no_split_classes
from offload_core.storage import Store, StoreContext
from offload_core.storage.residency import Residency
from offload_core.loading.model_device import report_execution_device, restore_device_report
from offload_core.loading.execution_device import default_execution_device, resolve_execution_device  # noqa: F401 (public here too)
from offload_core.loading.quantized import settle_packed
from offload_core.loading.load_weights import load_checkpoint_in_model
from offload_core.loading.routes import (
    TensorRoutes,
    get_tensor,
    move_leftover_buffers,
    retie,
    route_tensors,
    set_tensor,
    store_bytes,
)

log = logging.getLogger(__name__)


@dataclass
class OffloadState:
    """What dispatching left on a model (``model.offload_state``): the map, store, policy handle and counters.

    As a context manager it releases what the run took when the block ends (see :meth:`release`).
    """

    device_map: dict[str, int | str]
    execution_device: torch.device
    store: Store | None
    handle: PolicyHandle
    routes: TensorRoutes
    extra_handles: list = field(default_factory=list)  # module hooks attached beside the policy's (an encoder's)

    @property
    def stats(self):
        return self.handle.stats

    def offloaded_bytes(self) -> int:
        """Bytes the store holds for this model (what its policy reads back while it runs)."""
        if self.store is None:
            return 0
        return sum(tensor_nbytes(self.store, k) for k in self.routes.store_keys)  # from the specs: nothing decoded

    def release(self) -> None:
        """Drop every loaded unit and close the store (the model keeps its module hooks)."""
        self.handle.offload_all()
        if self.store is not None:
            self.store.close()

    def __enter__(self) -> "OffloadState":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def remove(self) -> nn.Module:
        """Remove the module hooks (weights come back to the CPU, resident ones too) and close the store: the
        device memory the run held is free when this returns, not at the next garbage collection."""
        for handle in self.extra_handles:
            handle.remove()
        model = self.handle.remove()
        restore_device_report(model)
        if any(devices.is_accelerator(t.device) for t in model.state_dict(keep_vars=True).values()):
            model.to("cpu")
        if self.store is not None:
            self.store.close()
        return model


def resolve_strategy(kind: str, value: Any, config: Any = None) -> Any:
    """The ``kind`` strategy (placement, storage or policy) ``value`` names, built with ``config``; or a dict of its
    name and options (``{"name": "gguf", "resident": "quantized"}``, as ``speculative`` takes one); a built one as
    given."""
    from offload_core.registry.manager import get_registry

    if isinstance(value, Mapping):
        named = named_options(value)
        if named is None:
            raise ConfigError(
                f"{kind}={dict(value)!r} names no {kind}: give its name and options, e.g. "
                f"{{'name': {get_registry().names(kind)[0]!r}, ...}}"
            )
        return get_registry().create(kind, named[0], {**dict(config or {}), **named[1]})
    if isinstance(value, str):
        return get_registry().create(kind, value, config)
    return value


def _prepare_device_map(
    model: nn.Module, device_map: Any, max_memory: Any, no_split: list[str], dtype: torch.dtype | None, reserve: Any
) -> dict[str, int | str]:
    from offload_core.planning import PlacementRequest, check_device_map, get_max_memory, normalize_device_map

    if isinstance(device_map, str):
        # A placement name ("auto" is balanced, as in transformers); an unknown one lists those there are.
        strategy = "balanced" if device_map == "auto" else device_map
        request = PlacementRequest(
            model=model,
            max_memory=get_max_memory(max_memory),
            no_split_module_classes=no_split,
            dtype=dtype,
            reserve=reserve,
        )
        device_map = resolve_strategy("placement", strategy).make_device_map(request)
    device_map = normalize_device_map(device_map)
    check_device_map(model, device_map)
    return device_map


def _policy(policy: str | Any, skip_keys: str | list[str] | None, preload: list[str] | None) -> Any:
    """The module-hook policy by name (``skip_keys`` go to its config; ``preload`` classes make
    ``align_per_call`` load whole blocks) or as built."""
    config: dict[str, Any] = {}
    if skip_keys:
        config["skip_keys"] = [skip_keys] if isinstance(skip_keys, str) else list(skip_keys)
    if preload and policy == "align_per_call":
        config["granularity"] = "block"
    return resolve_strategy("policy", policy, config or None) if isinstance(policy, (str, Mapping)) else policy


def _encoder_io_hook(model: nn.Module) -> list:
    """transformers' ``generate`` gives a dispatched encoder-decoder's encoder an accelerate hook returning outputs
    on the inputs' device, unless the encoder has ``_hf_hook``: attach ours, which does that, and name it so."""
    from offload_core.module_hooks.align import AlignDevicesHook
    from offload_core.module_hooks.base import add_hook_to_module

    get_encoder = getattr(model, "get_encoder", None)
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False) or get_encoder is None:
        return []
    encoder = get_encoder()
    if encoder is None or encoder is model or hasattr(encoder, "_hf_hook"):
        return []
    hook = AlignDevicesHook(io_same_device=True)
    handle = add_hook_to_module(encoder, hook)
    encoder._hf_hook = hook
    return [handle]


def _attach(
    model: nn.Module,
    device_map: dict,
    routes: TensorRoutes,
    store: Store | None,
    policy: Any,
    execution_device: torch.device,
    no_split: list[str],
    residency: Residency | None = None,
) -> OffloadState:
    context = PolicyContext(
        device_map=device_map,
        execution_device=execution_device,
        store=store,
        offloaded=dict(routes.offloaded),
        no_split_module_classes=list(no_split),
        non_blocking=bool(store is not None and store.pinned and devices.is_accelerator(execution_device)),
        residency=residency,
    )
    handle = policy.attach(model, context)
    if routes.offloaded:
        no_auto_compile(model)
    state = OffloadState(device_map, execution_device, store, handle, routes, _encoder_io_hook(model))
    model.hf_device_map = dict(device_map)
    model.offload_state = state
    report_execution_device(model, execution_device)
    return state


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | Path | Any,
    device_map: Mapping[str, int | str] | str | None = None,
    max_memory: Mapping[Any, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    offload_folder: str | Path | None = None,
    offload_buffers: bool = False,
    dtype: torch.dtype | str | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
    *,
    storage: str | Any = defaults.STORAGE,
    policy: str | Any = defaults.POLICY,
    execution_device: torch.device | str | None = None,
    reserve: Mapping[Any, int] | None = None,
    progress: bool = True,
    residency: Residency | None = None,
    page_cache: int | str | None = defaults.PAGE_CACHE,
    headroom: int | str | None = defaults.HEADROOM,
    generation: Any = None,
    over_budget: str = defaults.OVER_BUDGET,
) -> nn.Module:
    """Load ``checkpoint`` into ``model`` (built under :func:`init_empty_weights`) and attach offloading.

    accelerate's signature. ``device_map``: a dict (keys module or tensor names, values GPU ids,
    ``"cpu"``, ``"disk"``), a placement name, or ``None`` (everything in RAM, run on the cpu: accelerate's
    default, which fixes this one). ``offload_state_dict`` needs nothing here: shards are always streamed,
    never held whole. ``preload_module_classes`` are loaded whole by their outermost module hook.

    Ours, keyword-only, with the defaults of every door (:mod:`offload_core.defaults`): ``storage`` and ``policy``
    (plugin names or built objects), ``execution_device``. A placement name plans as :func:`from_pretrained` and
    ``run.py`` do (:func:`offload_core.plan.request.plan_request`, the plan left in ``model.offload_plan``):
    within ``max_memory`` less the ``headroom`` (``"auto"``: a model that generates holds back the KV cache and
    activations of ``generation``, a :class:`~offload_core.planning.generation.Generation` or a dict of its fields,
    default ``run.py``'s; a budget that cannot hold the units in flight is run over, warned, or refused with
    ``over_budget="refuse"``), with the
    ``page_cache`` rule (``"auto"``, a size, ``0``; None or ``"lru"``: the kernel's
    cache decides). ``reserve`` (bytes per device held back for units in flight) instead places by that alone.
    ``residency`` (:class:`offload_core.storage.residency.Residency`: the offloaded blocks kept in the page cache
    across tokens; the others are streamed and dropped after use by policies that stream blocks) for a dict map.
    The model gets ``hf_device_map`` and ``offload_state`` (see :class:`OffloadState`).
    """
    from offload_core.loading.allocator import return_freed_memory_to_os
    from offload_core.loading.checkpoint import Checkpoint
    from offload_core.loading.converted import convert_checkpoint
    from offload_core.values import parse_dtype

    return_freed_memory_to_os()
    dtype = parse_dtype(dtype)
    if device_map is None:
        device_map, execution_device = {"": "cpu"}, execution_device or "cpu"
    no_split = no_split_classes(model, no_split_module_classes)
    owns_checkpoint = isinstance(checkpoint, (str, os.PathLike))
    opened = Checkpoint.open(checkpoint) if owns_checkpoint else checkpoint
    ckpt = convert_checkpoint(model, opened)
    storage, policy = resolve_strategy("storage", storage), _policy(policy, skip_keys, preload_module_classes)
    if isinstance(device_map, str) and reserve is None:  # planned as every door plans
        from offload_core.plan.request import PlanRequest, model_dtype, plan_request, read_request_generation
        from offload_core.planning.headroom import read_headroom

        blocks, device = [*no_split, *(preload_module_classes or [])], resolve_execution_device(execution_device, None)
        request = PlanRequest(device, blocks, dtype or model_dtype(model), max_memory, device_map, storage, policy)
        request.page_cache, request.over_budget = page_cache, over_budget
        request.headroom, request.generation = read_headroom(headroom), read_request_generation(model, generation)
        try:
            plan = plan_request(model, opened, request)
        except BaseException:
            if owns_checkpoint:
                ckpt.close()
            raise
        model.offload_plan = plan
        device_map, policy = plan.device_map, plan.policy
        residency = plan.residency() if residency is None else residency
    device_map = _prepare_device_map(model, device_map, max_memory, no_split, dtype, reserve)
    execution_device = resolve_execution_device(execution_device, device_map)
    routes = route_tensors(model, device_map, execution_device, offload_buffers)
    store = None
    if routes.offloaded:
        import json

        fingerprint = {
            "checkpoint": ckpt.fingerprint(),
            "dtype": str(dtype),
            "tensors": sorted(routes.store_keys),
        }
        fingerprint = json.loads(json.dumps(fingerprint, default=str))
        context = StoreContext(
            names=routes.store_keys,
            dtype=dtype,
            checkpoint=ckpt,
            fingerprint=fingerprint,
            offload_folder=Path(offload_folder) if offload_folder else None,
            pin_memory=devices.is_accelerator(execution_device),
            maps_checkpoint=maps_checkpoint(model),
            nbytes=store_bytes(model, routes, ckpt, dtype),
        )
        store = storage.open(context)
    try:
        load_checkpoint_in_model(model, ckpt, routes, store, dtype, progress, strict)
    except BaseException:
        if store is not None:
            store.close()
        raise
    move_leftover_buffers(model, device_map, execution_device)
    blocks = [*no_split, *(preload_module_classes or [])]
    _attach(model, device_map, routes, store, policy, execution_device, blocks, residency)
    settle_packed(model, set(routes.offloaded))
    return model


def dispatch_model(
    model: nn.Module,
    device_map: Mapping[str, int | str] | str,
    main_device: torch.device | str | int | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    offload_dir: str | Path | None = None,
    offload_index: Mapping[str, Any] | None = None,
    offload_buffers: bool = False,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    *,
    max_memory: Mapping[Any, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    storage: str | Any | None = None,
    policy: str | Any = "align_per_call",
    offload_folder: str | Path | None = None,
    execution_device: torch.device | str | None = None,
    residency: Residency | None = None,
) -> nn.Module:
    """Dispatch an in-memory ``model`` (accelerate's signature): offloaded tensors move into the store (the
    model then holds meta placeholders for them), resident ones to their devices, and the policy's module
    hooks attach. ``model.offload_state.remove()`` undoes it all.

    ``main_device`` runs what is offloaded (default: ``cuda:0`` when present, else ``cpu``). Offloaded
    values come from ``offload_index`` (an accelerate offload folder ``offload_dir``), else ``state_dict``,
    else the model. ``offload_dir`` makes the default store write a real offload folder there. Module
    hooks are always attached (``force_hooks`` is what we always do). Ours, keyword-only: ``max_memory``
    and ``no_split_module_classes`` (for a placement name), ``storage``, ``policy``, ``residency``, and the names
    :func:`load_checkpoint_and_dispatch` uses for ``offload_dir`` and ``main_device``.
    """
    from offload_core.loading.offload_index import load_offloaded_tensor, read_offload_index

    main_device = main_device if main_device is not None else execution_device
    offload_dir = offload_dir if offload_dir is not None else offload_folder
    if storage is None:
        storage = "memmap" if offload_dir is not None else "pinned_cpu"
    no_split = no_split_classes(model, no_split_module_classes)
    storage, policy = resolve_strategy("storage", storage), _policy(policy, skip_keys, preload_module_classes)
    reserve = None
    if isinstance(device_map, str):  # the placement holds back what the policy keeps in flight
        from offload_core.plan.reserve import reservation
        from offload_core.planning import largest_block_size, largest_module_size
        from offload_core.planning.reservation import InFlight

        blocks = [*no_split, *(preload_module_classes or [])]
        device = resolve_execution_device(main_device, None)
        need = InFlight(device, largest_block_size(model, blocks), largest_module_size(model), model=model)
        reserve = reservation(policy, storage, need)
    device_map = _prepare_device_map(model, device_map, max_memory, no_split, None, reserve)
    execution_device = resolve_execution_device(main_device, device_map)
    routes = route_tensors(model, device_map, execution_device, offload_buffers)
    index = read_offload_index(offload_dir, offload_index) if offload_index is not None else {}
    store = None
    if routes.offloaded:
        context = StoreContext(
            names=routes.store_keys,
            offload_folder=Path(offload_dir) if offload_dir else None,
            # never matches an earlier folder: an in-memory model's weights are always written
            fingerprint={"in_memory_model": uuid.uuid4().hex},
            pin_memory=devices.is_accelerator(execution_device),
            nbytes=store_bytes(model, routes),
        )
        store = storage.open(context)
        placeholders: dict[str, torch.Tensor] = {}
        for name, key in routes.offloaded.items():
            if key not in placeholders:
                tensor = get_tensor(model, key)
                value = (
                    load_offloaded_tensor(offload_dir, key, index[key])
                    if key in index
                    else state_dict[key]
                    if state_dict is not None and key in state_dict
                    else tensor
                )
                store.put(key, value.detach(), owned=value is not tensor)
                meta = tensor.detach().to("meta")
                placeholders[key] = (
                    nn.Parameter(meta, requires_grad=tensor.requires_grad) if routes.is_param[name] else meta
                )
        for name, key in routes.offloaded.items():
            set_tensor(model, name, placeholders[key], routes.is_param[name])
        store.finalize()
    for name, device in routes.resident.items():
        if routes.canonical[name] == name:
            tensor = get_tensor(model, name)
            if tensor.device != device:
                set_tensor(model, name, tensor.detach().to(device), routes.is_param[name])
    retie(model, routes)
    move_leftover_buffers(model, device_map, execution_device)
    blocks = [*no_split, *(preload_module_classes or [])]
    _attach(model, device_map, routes, store, policy, execution_device, blocks, residency)
    settle_packed(model, set(routes.offloaded))
    return model
