"""Where a policy reads some tensors only in part (the routed experts of a MoE layer), a byte it reads whole every
token saves more when kept where the run computes than a byte of those tensors does: the one rule that re-deals a
placement's map by bytes read per token per byte kept."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from offload_core.errors import DeviceMapError
from offload_core.planning.device_map import DeviceMap, compress_device_map, device_of
from offload_core.planning.sizing import compute_module_sizes, named_module_tensors, tensor_aliases
from offload_core.values import budget_key, format_size


@dataclass
class _Item:
    """Tensors that move together: one module's direct tensors (a tensor read in part alone), and every tensor tied
    to one of them."""

    names: list[str] = field(default_factory=list)
    bytes: int = 0
    read: float = 0.0  # bytes read per token when offloaded
    partial: bool = False  # holds a tensor read in part

    @property
    def density(self) -> float:
        return self.read / self.bytes if self.bytes else 0.0


@dataclass
class Redeal:
    """The re-dealt map, and what it changed: bytes read per token from offloaded tiers before and after, and the
    bytes now kept where the run computes that it reads whole."""

    device_map: DeviceMap
    read_before: float
    read_after: float
    whole_kept: int
    partial_out: int

    def line(self) -> str:
        swapped = f" (in place of {format_size(self.partial_out)} of experts)" if self.partial_out else ""
        return (
            f"kept where it computes: {format_size(self.whole_kept)} of weights read whole every token{swapped}, "
            f"before the routed experts, of which a token reads a share: predicted reads per token "
            f"{format_size(int(self.read_before))} -> {format_size(int(self.read_after))}"
        )


def _items(model: nn.Module, sizes: Mapping[str, int], shares: Mapping[str, tuple[float, int]]) -> list[_Item]:
    """The model's tensors grouped into items, in module order; a tied tensor counts once, in its first item."""
    aliases = tensor_aliases(model)
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    def group(name: str) -> str:  # a tensor read in part moves alone; the others with their module's tensors
        return name if name in shares else name.rpartition(".")[0]

    names = [name for name, _ in named_module_tensors(model, recurse=True, remove_duplicate=False)]
    for name in names:  # a tied tensor joins the group of its first name
        a, b = root(group(name)), root(group(aliases[name]))
        if a != b:
            parent[a] = b
    items: dict[str, _Item] = {}
    for name in names:
        item = items.setdefault(root(group(name)), _Item())
        item.names.append(name)
        if aliases[name] == name:
            item.bytes += sizes[name]
            item.read += sizes[name] * shares.get(name, (1.0, 1))[0]
            item.partial = item.partial or name in shares
    return list(items.values())


def redeal_by_reads(
    model: nn.Module,
    device_map: Mapping[str, int | str],
    shares: Mapping[str, tuple[float, int]],
    execution_device: torch.device,
    budgets: Mapping[Any, int],
    reserve: Mapping[Any, int],
    dtype: torch.dtype | None,
) -> Redeal | None:
    """``device_map`` re-dealt so that the tensors read whole each token (``shares`` names those read in part and
    the share of their bytes a token reads) are kept first where the run computes, then on the cpu tier of a GPU
    run, the rest offloaded; None when that reads no fewer bytes per token, or would read more from the disk.

    Only tensors the map put on those tiers or on the disk move. Room: on a CPU run the cpu budget less what is
    reserved for units in flight (the placement may have left room a whole block did not fit in); on a GPU run the
    bytes the placement put on the computing GPU (a placement that keeps it low stays low) and the cpu budget less
    its reservation. Tensors that move together (a module's direct tensors read whole, tied tensors) are never split."""
    if not shares:
        return None
    sizes = compute_module_sizes(model, dtype=dtype)
    gpu = execution_device.type != "cpu"
    main: int | str = budget_key(execution_device)
    tiers: list[int | str] = [main, "cpu", "disk"] if gpu else ["cpu", "disk"]
    items, movable = _items(model, sizes, shares), []
    used: dict[int | str, int] = {tier: 0 for tier in tiers}
    for item in items:
        try:
            where = {device_of(device_map, name) for name in item.names}
        except DeviceMapError:  # a non-persistent buffer the map need not name
            continue
        if len(where) == 1 and (tier := where.pop()) in used:
            movable.append((item, tier))
            used[tier] += item.bytes
    room: dict[int | str, float] = dict(used)  # a GPU holds no more than the placement put there
    room["disk"] = float("inf")
    if "cpu" in budgets:  # the cpu budget's room, which a block too large to fit may have left
        room["cpu"] = max(used["cpu"], budgets["cpu"] - reserve.get("cpu", 0))
    taken = {tier: 0 for tier in tiers}
    placed: dict[int, int | str] = {}
    for item, _ in sorted(movable, key=lambda pair: -pair[0].density):  # stable: module order among equals
        tier = next(t for t in tiers if taken[t] + item.bytes <= room[t])
        taken[tier] += item.bytes
        placed[id(item)] = tier

    def reads(tier_of: Mapping[int, int | str], only: str | None = None) -> float:
        return sum(
            item.read
            for item, _ in movable
            if tier_of[id(item)] != main and (only is None or tier_of[id(item)] == only)
        )

    before = {id(item): tier for item, tier in movable}
    if reads(placed) >= reads(before) or reads(placed, "disk") > reads(before, "disk"):
        return None
    tensor_devices: dict[str, int | str] = {}
    moved = {name: placed[id(item)] for item, _ in movable for name in item.names}
    for name, _ in named_module_tensors(model, recurse=True, remove_duplicate=False):
        try:
            tensor_devices[name] = moved.get(name, device_of(device_map, name))
        except DeviceMapError:
            continue
    whole_kept = sum(
        item.bytes for item, tier in movable if tier != main and placed[id(item)] == main and not item.partial
    )
    partial_out = sum(item.bytes for item, tier in movable if tier == main and placed[id(item)] != main)
    return Redeal(compress_device_map(tensor_devices), reads(before), reads(placed), whole_kept, partial_out)
