"""Placement ``interleaved`` for offload_core: every k-th block stays resident, the others are offloaded.

With ``hook=prefetch`` the offloaded blocks are read while the resident block before them computes, so
transfers overlap compute instead of stalling it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from offload_core.errors import ConfigError
from offload_core.hookspecs import hookimpl
from offload_core.planning import PlacementRequest, compress_device_map, get_max_memory, plan_device_map
from offload_core.values import device_key
from offload_core.planning.sizing import named_module_tensors, tensor_aliases, tensor_bytes
from offload_core.registry.contracts import Placement
from offload_core.values import parse_dtype, parse_size

__all__ = ["Interleaved", "InterleavedConfig"]


@dataclass
class InterleavedConfig:
    """Options of ``placement=interleaved`` (typed: ``placement.k=abc`` fails at compose time)."""

    name: str = "interleaved"
    #: keep blocks 0, k, 2k, … resident; k=1 keeps every block that fits
    k: int = 2


class Interleaved(Placement):
    """Among the no-split blocks, every k-th resident on the fastest device with room, the rest offloaded.

    Resident means the first GPU with a budget, or ``cpu`` on a CPU-only plan. Offloaded means ``cpu``
    (then ``disk`` once the cpu budget is full) on a GPU plan, ``disk`` on a CPU-only plan. Modules
    outside the blocks (embeddings, final norm, head) are resident when they fit. Budgets hold back
    ``request.reserve`` per device, or the largest block on the resident device when it is ``None``.
    """

    def __init__(self, config: InterleavedConfig) -> None:
        if config.k < 1:
            raise ConfigError(f"placement.k={config.k} must be at least 1: keep every k-th block resident")
        self.config = config

    def make_device_map(self, request: PlacementRequest) -> dict[str, int | str]:
        model = request.model
        no_split = set(request.no_split_module_classes or ())
        blocks = []
        for name, module in model.named_modules():
            if type(module).__name__ in no_split and not any(name.startswith(b + ".") for b in blocks):
                blocks.append(name)
        if not blocks:  # nothing to interleave: plain sequential fill
            return plan_device_map(request)

        budgets = get_max_memory(request.max_memory, check_devices=False)
        gpus = [d for d in budgets if isinstance(d, int) and budgets[d] > 0]
        resident = gpus[0] if gpus else "cpu"
        dtype = parse_dtype(request.dtype)
        aliases = tensor_aliases(model)
        size = {
            name: tensor_bytes(t, dtype)
            for name, t in named_module_tensors(model, recurse=True, remove_duplicate=False)
        }

        def owner(name: str) -> str:
            for block in blocks:
                if name.startswith(block + "."):
                    return block
            return name.rpartition(".")[0]

        groups: dict[str, list[str]] = defaultdict(list)  # unit -> its tensors' first names
        for name, first in aliases.items():
            groups[owner(name)].append(name)
        unit_bytes = {u: sum(size[n] for n in names if aliases[n] == n) for u, names in groups.items()}
        largest_block = max(unit_bytes.get(b, 0) for b in blocks)
        if request.reserve is not None:
            reserve = {device_key(k): parse_size(v) for k, v in request.reserve.items()}
        else:
            reserve = {resident: largest_block}
        room = {d: budgets[d] - reserve.get(d, 0) for d in budgets if d != "disk"}
        used: dict[int | str, int] = defaultdict(int)
        placed: dict[str, int | str] = {}  # first tensor name -> device

        def fits(device: int | str, nbytes: int) -> bool:
            return device in room and used[device] + nbytes <= room[device]

        def offload_tier(nbytes: int) -> str:
            return "cpu" if gpus and fits("cpu", nbytes) else "disk"

        def put(unit: str, device: int | str) -> None:
            for name in groups[unit]:
                first = aliases[name]
                if first not in placed:
                    placed[first] = device
                    if device != "disk":
                        used[device] += size[first]

        def new_bytes(unit: str) -> int:
            return sum(size[n] for n in dict.fromkeys(aliases[n] for n in groups[unit]) if n not in placed)

        keep = set(blocks[:: self.config.k])
        ordered = [u for u in groups if u not in blocks] + [b for b in blocks if b in groups]
        for unit in ordered:
            nbytes = new_bytes(unit)
            wants_resident = unit not in blocks or unit in keep
            put(unit, resident if wants_resident and fits(resident, nbytes) else offload_tier(nbytes))
        return compress_device_map({name: placed[first] for name, first in aliases.items()}, default=resident)


@hookimpl
def offload_register_placements(register):
    register("interleaved", Interleaved, InterleavedConfig)
