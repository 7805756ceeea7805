"""The run's plan from its settings (:func:`offload_core.plan.make.make_plan` for a run), made before anything is
loaded: the device map, the bytes held back for units in flight, and what it predicts."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from offload_core import devices
from offload_core.errors import DeviceMapError
from offload_core.plan.make import Plan, PlanInputs
from offload_core.plan.make import make_plan as plan_model
from offload_core.plan.model import RunModel
from offload_core.runner.settings import Settings, Strategies
from offload_core.storage.checkpoint import Checkpoint
from offload_core.storage.residency import offloaded_in_plan
from offload_core.values import format_size


def make_plan(settings: Settings, strategies: Strategies, run_model: RunModel, checkpoint: Checkpoint) -> Plan:
    """The run's plan (:func:`offload_core.plan.make.make_plan`, the rule ``from_pretrained`` plans by): a user's
    ``device_map`` file, else the policy's own map, else the placement's within the budgets less the headroom."""
    from offload_core.runner.validate import check_device_map_devices, check_module_classes

    path = settings.device_map_file
    check_module_classes(run_model.model, settings.model.get("no_split_module_classes"))
    device_map = read_device_map(path) if path else None
    if path:
        check_device_map_devices(device_map, settings.execution_device)
    inputs = PlanInputs(
        placement=strategies.placement,
        storage=strategies.storage,
        policy=strategies.policy,
        execution_device=settings.execution_device,
        budgets=settings.budgets,
        no_split=run_model.no_split,
        dtype=run_model.dtype,
        max_memory=settings.max_memory,
        headroom=settings.headroom,
        device_map=device_map,
        page_cache=settings.page_cache,
        policy_name=strategies.policy_name,
        over_budget=settings.over_budget,
    )
    return plan_model(run_model.model, checkpoint, inputs)


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


def print_plan(
    settings: Settings,
    strategies: Strategies,
    plan: Plan,
    per: str = "generated token",
    held_for: str = "the KV cache and activations",
) -> None:
    """Print the chosen strategies (a user's ``device_map`` file in place of the placement, which it replaces) and the
    plan (with the device map's keys in a plan-only run); ``per``: what one forward makes (an encoder's is a
    forward); ``held_for``: what the headroom holds."""
    from offload_core.storage.residency import page_cache_text
    from offload_core.plan.report import plan_text

    path = settings.device_map_file
    print(
        " ".join(
            [
                f"device_map={path}" if group == "placement" and path else f"{group}={name}"
                for group, name in strategies.names.items()
            ]
        )
    )
    print(
        plan_text(
            plan.summary,
            plan.as_dict(),
            plan.predicted_bytes_per_token,
            plan.device_map if settings.plan_only else None,
            per=per,
            held_for=held_for,
        )
    )
    if plan.redealt:
        print(f"  {plan.redealt}")
    if plan.lightened:
        print(f"  {plan.lightened}")
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
    from offload_core.plan.report import plot_placement

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

    total = sum(info["bytes"] for info in summary["devices"].values())
    offloaded = offloaded_in_plan(summary, execution_device)
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
