"""The run's plan, made before anything is loaded: the device map, the bytes held back for units in flight, and what it predicts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from offload_core import devices
from offload_core.errors import ConfigError, DeviceMapError
from offload_core.loading.reserve import reservation, reserve_for  # noqa: F401 (reservation: the runner's name for the rule)
from offload_core.runner.model import RunModel
from offload_core.runner.settings import Settings, Strategies
from offload_core.values import format_size, is_offloaded


@dataclass
class Plan:
    """Where every weight goes and what that costs: the checked device map, its per-device summary, the
    bytes held back per device for units in flight (``reserve``) and from the cpu budget (``headroom``),
    the largest no-split block, the bytes predicted to move per generated token, what converting the
    checkpoint's names to the model's costs (``conversion``: the report's lines) and the page-cache plan
    (:func:`offload_core.storage.residency.page_cache_plan`: kept and streamed bytes)."""

    device_map: dict[str, int | str]
    summary: dict[str, Any]
    reserve: dict[Any, int]
    headroom: int
    largest_block: int
    predicted_bytes_per_token: int
    conversion: list[str] = field(default_factory=list)
    page_cache: dict[str, Any] = field(default_factory=dict)
    #: predicted_load_s, predicted_ttft_s, predicted_step_s (see :func:`offload_core.runner.predict.predict_time`)
    predicted_time: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The plan's figures as ``RunResult.plan`` and ``plan_text`` take them."""
        return {"reserve": {str(k): v for k, v in self.reserve.items()}, "headroom": self.headroom,
                "largest_block": self.largest_block, "predicted_bytes_per_token": self.predicted_bytes_per_token,
                "conversion": list(self.conversion), "page_cache": self.page_cache,
                **self.predicted_time}


def make_plan(settings: Settings, strategies: Strategies, run_model: RunModel, checkpoint: Any) -> Plan:
    """The device map (a user's file, else the policy's own, else the placement's) and the figures around it."""
    from offload_core.runner.validate import check_device_map_devices, check_module_classes
    from offload_core.planning import PlacementRequest, check_device_map, largest_block_size, normalize_device_map, summarize_device_map
    from offload_core.loading.conversion import key_conversion
    from offload_core.storage.residency import page_cache_plan
    from offload_core.runner.report import predicted_bytes_per_token

    model, dtype, no_split, device = run_model.model, run_model.dtype, run_model.no_split, settings.execution_device
    block = largest_block_size(model, no_split, dtype=dtype)
    reserve = reserve_for(model, checkpoint, strategies.policy, strategies.storage, device, no_split, dtype,
                          settings.budgets.get("cpu"))
    path = settings.cfg.device_map
    check_module_classes(model, settings.model.get("no_split_module_classes"))
    device_map = read_device_map(path) if path else strategies.policy.own_device_map(model, device)
    if path:
        check_device_map_devices(device_map, device)
    own = not path and device_map is not None
    if device_map is None:
        request = PlacementRequest(model=model, max_memory=settings.budgets, no_split_module_classes=no_split, dtype=dtype,
                                   special_dtypes=None, reserve=reserve)
        device_map = strategies.placement.make_device_map(request)
    device_map = normalize_device_map(device_map)
    check_device_map(model, device_map, strict=True)
    summary = summarize_device_map(model, device_map, settings.max_memory, dtype=dtype)
    headroom = settings.headroom if device.type == "cpu" else 0
    if own:
        check_own_map_budgets(summary, settings, reserve, strategies, model)
    check_disk_budget(summary, settings.max_memory, block, headroom)
    predicted = predicted_bytes_per_token(model, device_map, strategies.policy, device, dtype, no_split)
    conversion = key_conversion(model, checkpoint)
    lines = conversion.summary().lines()
    if conversion.converted:
        names = sorted(conversion.converted)
        lines.append("converted: " + ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else ""))
    page_cache = page_cache_plan(settings.cfg.page_cache, summary, device,
                                 strategies.policy.keeps_page_cache, settings.max_memory.get("cpu", 0), block)
    return Plan(device_map, summary, reserve, settings.headroom, block, predicted, lines, page_cache)


def read_device_map(path: str) -> dict:
    """The device map in the JSON file ``path`` (an object of name -> device)."""
    file = Path(path).expanduser()
    try:
        data = json.loads(file.read_text())
    except OSError as exc:
        raise DeviceMapError(f"device_map={path!r} cannot be read ({exc.strerror}); give a JSON file path") from None
    except ValueError as exc:
        raise DeviceMapError(f"device_map file {path!r} is not valid JSON ({exc}); fix the file") from None
    if not isinstance(data, dict):
        raise DeviceMapError(f"device_map file {path!r} must hold a JSON object of name -> device")
    return data


def check_disk_budget(summary: dict, max_memory: dict, largest_block: int, headroom: int) -> None:
    """A ``disk`` budget is a limit: ``max_memory.disk=0`` means nothing may be offloaded to disk."""
    if "disk" not in max_memory:
        return
    on_disk = summary["devices"].get("disk", {}).get("bytes", 0)
    allowed = max_memory["disk"]
    if on_disk <= allowed:
        return
    short = on_disk - allowed
    needed = summary["devices"].get("cpu", {}).get("bytes", 0) + short + headroom
    memory = ", ".join(f"max_memory.{k}={format_size(v)}" for k, v in max_memory.items() if k != "disk") or "no memory budget"
    if headroom:
        memory += f" less headroom {format_size(headroom)}"
    raise ConfigError(
        f"the model ({format_size(summary['total_bytes'])}; largest unsplittable layer {format_size(largest_block)}) does not "
        f"fit in {memory} with max_memory.disk={format_size(allowed)}: {short} more bytes are needed; "
        f"set max_memory.cpu to at least {needed} ({format_size(needed)}) or allow disk (raise or remove max_memory.disk)"
    )


def check_own_map_budgets(summary: dict, settings: Settings, reserve: dict, strategies: Strategies, model: Any) -> None:
    """A map the policy made itself keeps every budget as the placement's does (with the units in flight and, on
    a CPU run, the headroom held back), or the run is refused in one line naming the option to change."""
    budgets, max_memory = settings.budgets, settings.max_memory
    for dev, info in summary["devices"].items():
        if dev not in budgets:
            continue
        used = info["bytes"] + reserve.get(dev, 0)
        if used <= budgets[dev]:
            continue
        short = used - budgets[dev]
        held = budgets[dev] != max_memory[dev]
        key = f"max_memory.{dev}"
        room = f"{format_size(budgets[dev])} budget" + (
            f" ({key}={format_size(max_memory[dev])} less headroom {format_size(max_memory[dev] - budgets[dev])})" if held else "")
        in_flight = f" ({format_size(reserve[dev])} of it held back for units in flight)" if reserve.get(dev) else ""
        remedy = strategies.policy.own_map_remedy(model, settings.execution_device, dev, short)
        raise ConfigError(
            f"hook={strategies.names.get('hook', '?')}'s own device map puts {format_size(used)} on {dev}{in_flight}, over "
            f"its {room}: {remedy + ', or ' if remedy else ''}raise {key} to at least {max_memory[dev] + short} "
            f"({format_size(max_memory[dev] + short)})")


def print_plan(settings: Settings, strategies: Strategies, plan: Plan, per: str = "generated token") -> None:
    """Print the chosen strategies (a user's ``device_map`` file in place of the placement, which it replaces) and the
    plan (with the device map's keys in a plan-only run); ``per``: what one forward makes (an encoder's is a forward)."""
    from offload_core.storage.residency import page_cache_text
    from offload_core.runner.report import plan_text

    path = settings.cfg.device_map
    print(" ".join([f"device_map={path}" if group == "placement" and path else f"{group}={name}"
                    for group, name in strategies.names.items()]))
    print(plan_text(plan.summary, plan.as_dict(), plan.predicted_bytes_per_token,
                    plan.device_map if settings.cfg.plan_only else None, per=per))
    for line in plan.conversion:
        print(f"  conversion: {line}")
    for line in strategies.policy.plan_lines():
        print(line)
    if plan.page_cache.get("offloaded_bytes"):
        print(page_cache_text(plan.page_cache, per))
    warn_if_fits(plan.summary, settings.execution_device)


def write_plan(settings: Settings, run_model: RunModel, plan: Plan, picture: bool = True) -> None:
    """Write ``device_map.json`` (and ``placement.png`` with ``picture``) for a plan-only run."""
    from offload_core.planning import compute_module_sizes
    from offload_core.runner.report import plot_placement

    out_dir = settings.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "device_map.json").write_text(json.dumps(plan.device_map, indent=1))
    written = "device_map.json"
    if picture:
        sizes = compute_module_sizes(run_model.model, dtype=run_model.dtype)
        written = f"{plot_placement(run_model.model, plan.device_map, sizes, out_dir / 'placement.png')} and {written}"
    print(f"wrote {written} (plan only: nothing was loaded)")


def warn_if_fits(summary: dict, execution_device: torch.device) -> None:
    """Offloading costs time: say so when the whole model would fit where it runs."""
    import psutil

    per_device = summary["devices"]
    total = sum(info["bytes"] for info in per_device.values())
    offloaded = sum(info["bytes"] for dev, info in per_device.items() if is_offloaded(dev, execution_device))
    if offloaded == 0:
        return
    if devices.is_accelerator(execution_device):
        free = devices.active().mem_get_info(execution_device.index or 0)[0]
    else:
        free = psutil.virtual_memory().available
    if total < 0.8 * free:
        print(
            f"  warning: the whole model ({format_size(total)}) would fit in the free memory of {execution_device} "
            f"({format_size(free)}), yet {format_size(offloaded)} is offloaded by max_memory; raise the budget "
            "to run it in memory, which is faster"
        )
