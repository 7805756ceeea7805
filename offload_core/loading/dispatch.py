"""Compose a device map, a store and a module-hook policy on a model: ``dispatch_model`` and ``load_checkpoint_and_dispatch``."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from offload_core.errors import CheckpointError
from offload_core.module_hooks.units import DispatchPlan, PolicyHandle
from offload_core.storage import Store, StoreContext, convert_dtype

log = logging.getLogger(__name__)

def default_execution_device() -> torch.device:
    """``cuda:0`` when an accelerator is present, else ``cpu``."""
    return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")


def offload_tiers(execution_device: torch.device) -> set[str]:
    """Device-map values whose tensors are offloaded: on a CPU run only ``disk`` (``cpu`` is resident)."""
    return {"disk"} if execution_device.type == "cpu" else {"cpu", "disk"}


def _torch_device(value: int | str, execution_device: torch.device) -> torch.device:
    if isinstance(value, int):
        return torch.device("cuda", value)
    if value in ("cpu", "disk"):
        return execution_device if value == "disk" else torch.device("cpu")
    return torch.device(value)


@dataclass
class TensorPlan:
    """Where each state-dict tensor of a model goes: resident on a device, or offloaded under a store key."""

    resident: dict[str, torch.device] = field(default_factory=dict)
    offloaded: dict[str, str] = field(default_factory=dict)  # name -> canonical store key
    canonical: dict[str, str] = field(default_factory=dict)  # every name -> first name of its tie group
    is_param: dict[str, bool] = field(default_factory=dict)

    @property
    def store_keys(self) -> list[str]:
        return list(dict.fromkeys(self.offloaded.values()))


def plan_tensors(model: nn.Module, device_map: Mapping[str, int | str], execution_device: torch.device,
                 offload_buffers: bool = False) -> TensorPlan:
    """Resolve a checked device map into per-tensor decisions (tied names share one store key)."""
    from offload_core.planning import device_of, find_tied_parameters

    plan = TensorPlan()
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for group in find_tied_parameters(model):
        for name in group:
            plan.canonical[name] = group[0]
    tiers = offload_tiers(execution_device)
    for name in model.state_dict(keep_vars=True):
        plan.canonical.setdefault(name, name)
        is_param = name in params
        plan.is_param[name] = is_param
        where = device_of(device_map, plan.canonical[name])
        if where in tiers and (is_param or offload_buffers):
            plan.offloaded[name] = plan.canonical[name]
        else:
            plan.resident[name] = _torch_device(where, execution_device)
    return plan


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor, is_param: bool) -> None:
    owner_name, _, local = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if is_param:
        old = owner._parameters.get(local)
        requires_grad = bool(old is not None and old.requires_grad and value.is_floating_point())
        owner._parameters[local] = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=requires_grad)
    else:
        owner._buffers[local] = value


def _get_tensor(model: nn.Module, name: str) -> torch.Tensor:
    owner_name, _, local = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    return owner._parameters[local] if local in owner._parameters else owner._buffers[local]


def _retie(model: nn.Module, plan: TensorPlan) -> None:
    """Point every resident tied alias at its canonical tensor (one tensor, one device copy)."""
    for name, canonical in plan.canonical.items():
        if name != canonical and name in plan.resident:
            _set_tensor(model, name, _get_tensor(model, canonical), plan.is_param[name])


def _move_leftover_buffers(model: nn.Module, execution_device: torch.device) -> None:
    """Non-persistent buffers (e.g. rotary ``inv_freq``) are not in any checkpoint: they run on the execution device."""
    for module in model.modules():
        for local, buf in module._buffers.items():
            if buf is not None and buf.device.type != "meta" and buf.device != execution_device:
                module._buffers[local] = buf.to(execution_device)


def load_checkpoint_in_model(model: nn.Module, checkpoint: Any, plan: TensorPlan, store: Store | None,
                             dtype: torch.dtype | None = None, progress: bool = True) -> dict[str, list[str]]:
    """Stream ``checkpoint`` shard by shard into ``model`` (resident tensors) and ``store`` (offloaded ones).

    Resident tensors are copied once from the mapped shard to their device; offloaded ones go to the
    store (which may only record where they are). Peak anonymous memory is the resident bytes: shards
    are mapped, never read whole into memory. Returns ``{"missing": [...], "unexpected": [...]}``;
    missing weights or shape mismatches raise :class:`CheckpointError`.
    """
    ckpt_keys = set(checkpoint.keys())
    # Which checkpoint key feeds each canonical name (a tied group may be saved under any of its names).
    source: dict[str, str] = {}
    for name, canonical in plan.canonical.items():
        if name in ckpt_keys:
            source.setdefault(canonical, name)
    missing = sorted({c for c in plan.canonical.values() if c not in source})
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(
            f"checkpoint {getattr(checkpoint, 'path', '')} lacks {len(missing)} weight(s) the model needs: {shown}; "
            "check that the checkpoint matches the model's config"
        )
    wanted = {key: canonical for canonical, key in source.items()}
    unexpected = sorted(ckpt_keys - set(plan.canonical))
    if unexpected:
        log.warning("checkpoint has %d tensor(s) the model does not use (ignored): %s", len(unexpected), ", ".join(unexpected[:5]))
    state = model.state_dict(keep_vars=True)
    expected = {name: tuple(t.shape) for name, t in state.items()}
    kinds = {name: _dtype_kind(t.dtype) for name, t in state.items()}
    store_keys = set(plan.offloaded.values())
    total = sum(len(keys) for _, keys in checkpoint.shards())
    bar = tqdm(total=total, desc="loading", unit="tensor", disable=not progress, leave=False)
    for shard, keys in checkpoint.shards():
        for key in keys:
            bar.update(1)
            canonical = wanted.get(key)
            if canonical is None:
                continue
            shape = tuple(checkpoint.shape(key))
            if shape != expected[canonical]:
                raise CheckpointError(
                    f"checkpoint tensor {key!r} in {Path(shard).name} has shape {list(shape)} but the model expects "
                    f"{list(expected[canonical])}; the checkpoint does not match the model's config"
                )
            stored = checkpoint.dtype(key)
            if _dtype_kind(stored) != kinds[canonical]:
                raise CheckpointError(
                    f"checkpoint tensor {key!r} in {Path(shard).name} is {str(stored).removeprefix('torch.')} but the model "
                    f"expects a {kinds[canonical]} tensor ({str(state[canonical].dtype).removeprefix('torch.')}); "
                    "the checkpoint does not match the model's config"
                )
            if canonical in store_keys:
                if store is not None and not store.reused:
                    store.add_from_checkpoint(canonical, checkpoint, key, dtype)
                continue
            value = convert_dtype(checkpoint.get(key), dtype)
            device = plan.resident[canonical]
            held = torch.empty(value.shape, dtype=value.dtype, device=device)
            held.copy_(value)
            _set_tensor(model, canonical, held, plan.is_param[canonical])
    bar.close()
    if store is not None:
        store.finalize()
    _retie(model, plan)
    return {"missing": missing, "unexpected": unexpected}


def _dtype_kind(dtype: torch.dtype) -> str:
    """``floating``, ``complex``, ``bool`` or ``integer``: floats convert to the run's dtype, other kinds never do."""
    if dtype.is_floating_point:
        return "floating-point"
    if dtype.is_complex:
        return "complex"
    return "bool" if dtype == torch.bool else "integer"


@dataclass
class OffloadState:
    """What dispatching left on a model (``model.offload_state``): the map, store, policy handle and counters."""

    device_map: dict[str, int | str]
    execution_device: torch.device
    store: Store | None
    handle: PolicyHandle
    tensor_plan: TensorPlan

    @property
    def stats(self):
        return self.handle.stats

    def offloaded_bytes(self) -> int:
        if self.store is None:
            return 0
        return sum(self.store[k].numel() * self.store[k].element_size() for k in self.tensor_plan.store_keys)

    def remove(self) -> nn.Module:
        """Remove the module hooks (weights come back to the CPU) and close the store."""
        model = self.handle.remove()
        if self.store is not None:
            self.store.close()
        return model


def _resolve(kind: str, value: Any, config: Any = None) -> Any:
    if isinstance(value, str):
        from offload_core.registry.manager import get_registry

        return get_registry().create(kind, value, config)
    return value


def _prepare_device_map(model: nn.Module, device_map: Any, max_memory: Any, no_split: list[str],
                        dtype: torch.dtype | None, reserve: Any) -> dict[str, int | str]:
    from offload_core.planning import check_device_map, infer_auto_device_map, normalize_device_map

    if device_map is None:
        device_map = "sequential"
    if isinstance(device_map, str):
        # A placement name ("auto" is balanced, as in transformers); an unknown one lists those there are.
        strategy = "balanced" if device_map == "auto" else device_map
        device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split,
                                           dtype=dtype, strategy=strategy, reserve=reserve)
    device_map = normalize_device_map(device_map)
    check_device_map(model, device_map)
    return device_map


def _attach(model: nn.Module, device_map: dict, plan: TensorPlan, store: Store | None, policy: Any,
            execution_device: torch.device, no_split: list[str]) -> OffloadState:
    dispatch = DispatchPlan(device_map=device_map, execution_device=execution_device, store=store,
                            offloaded=dict(plan.offloaded), no_split_module_classes=list(no_split))
    handle = policy.attach(model, dispatch)
    state = OffloadState(device_map, execution_device, store, handle, plan)
    model.hf_device_map = dict(device_map)
    model.offload_state = state
    return state


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | Path | Any,
    device_map: Mapping[str, int | str] | str | None = "sequential",
    max_memory: Mapping[Any, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    storage: str | Any = "memmap",
    policy: str | Any = "align_per_call",
    offload_folder: str | Path | None = None,
    dtype: torch.dtype | str | None = None,
    execution_device: torch.device | str | None = None,
    offload_buffers: bool = False,
    reserve: Mapping[Any, int] | None = None,
    progress: bool = True,
) -> nn.Module:
    """Load ``checkpoint`` into ``model`` (built under :func:`init_empty_weights`) and attach offloading.

    ``device_map``: a dict (keys module or tensor names, values GPU ids, ``"cpu"``, ``"disk"``) or a
    placement name. ``storage`` and ``policy`` are plugin names or built strategy objects. The model
    gets ``hf_device_map`` and ``offload_state`` (see :class:`OffloadState`).
    """
    from offload_core.loading.allocator import return_freed_memory_to_os
    from offload_core.loading.checkpoint import Checkpoint
    from offload_core.loading.conversion import convert_checkpoint
    from offload_core.values import parse_dtype

    return_freed_memory_to_os()
    dtype = parse_dtype(dtype)
    execution_device = torch.device(execution_device) if execution_device is not None else default_execution_device()
    no_split = list(no_split_module_classes or getattr(model, "_no_split_modules", None) or [])
    device_map = _prepare_device_map(model, device_map, max_memory, no_split, dtype, reserve)
    owns_checkpoint = not hasattr(checkpoint, "shards")
    ckpt = Checkpoint.open(checkpoint) if owns_checkpoint else checkpoint
    ckpt = convert_checkpoint(model, ckpt)
    plan = plan_tensors(model, device_map, execution_device, offload_buffers)
    store = None
    if plan.offloaded:
        import json

        fingerprint = {
            "checkpoint": ckpt.fingerprint(),
            "dtype": str(dtype),
            "tensors": sorted(plan.store_keys),
        }
        fingerprint = json.loads(json.dumps(fingerprint, default=str))
        context = StoreContext(names=plan.store_keys, dtype=dtype, checkpoint=ckpt, fingerprint=fingerprint,
                               offload_folder=Path(offload_folder) if offload_folder else None,
                               pin_memory=execution_device.type == "cuda")
        store = _resolve("storage", storage).open(context)
    try:
        load_checkpoint_in_model(model, ckpt, plan, store, dtype, progress)
    except BaseException:
        if store is not None:
            store.close()
        raise
    _move_leftover_buffers(model, execution_device)
    _attach(model, device_map, plan, store, _resolve("hook", policy), execution_device, no_split)
    return model


def dispatch_model(
    model: nn.Module,
    device_map: Mapping[str, int | str] | str,
    max_memory: Mapping[Any, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    storage: str | Any = "pinned_cpu",
    policy: str | Any = "align_per_call",
    offload_folder: str | Path | None = None,
    execution_device: torch.device | str | None = None,
    offload_buffers: bool = False,
) -> nn.Module:
    """Dispatch an in-memory ``model``: offloaded tensors move into the store (then the model holds
    meta placeholders for them), resident ones to their devices, and the policy's module hooks attach.
    ``model.offload_state.remove()`` undoes it all.
    """
    execution_device = torch.device(execution_device) if execution_device is not None else default_execution_device()
    no_split = list(no_split_module_classes or getattr(model, "_no_split_modules", None) or [])
    device_map = _prepare_device_map(model, device_map, max_memory, no_split, None, None)
    plan = plan_tensors(model, device_map, execution_device, offload_buffers)
    store = None
    if plan.offloaded:
        context = StoreContext(names=plan.store_keys, offload_folder=Path(offload_folder) if offload_folder else None,
                               # never matches an earlier folder: an in-memory model's weights are always written
                               fingerprint={"in_memory_model": uuid.uuid4().hex}, pin_memory=execution_device.type == "cuda")
        store = _resolve("storage", storage).open(context)
        placeholders: dict[str, torch.Tensor] = {}
        for name, key in plan.offloaded.items():
            if key not in placeholders:
                tensor = _get_tensor(model, key)
                store.put(key, tensor.detach(), owned=True)
                meta = tensor.detach().to("meta")
                placeholders[key] = nn.Parameter(meta, requires_grad=tensor.requires_grad) if plan.is_param[name] else meta
        for name, key in plan.offloaded.items():
            _set_tensor(model, name, placeholders[key], plan.is_param[name])
        store.finalize()
    for name, device in plan.resident.items():
        if plan.canonical[name] == name:
            tensor = _get_tensor(model, name)
            if tensor.device != device:
                _set_tensor(model, name, tensor.detach().to(device), plan.is_param[name])
    _retie(model, plan)
    _move_leftover_buffers(model, execution_device)
    _attach(model, device_map, plan, store, _resolve("hook", policy), execution_device, no_split)
    return model
