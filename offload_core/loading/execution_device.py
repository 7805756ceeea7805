"""Where a dispatched model runs what is offloaded, unless the caller says: one rule for every door."""

from __future__ import annotations

from typing import Mapping

import torch

from offload_core import devices


def default_execution_device(device_map: Mapping[str, int | str] | None = None) -> torch.device:
    """Where offloaded tensors run unless told: the first GPU the device map names (``{"": 1}`` runs on GPU
    1, as accelerate's ``dispatch_model`` does), else device 0 of the active accelerator, else the cpu."""
    if device_map is not None:
        gpus = [d for d in device_map.values() if isinstance(d, int) and not isinstance(d, bool)]
        if gpus:
            return devices.gpu(gpus[0])
    return devices.default_execution_device()


def resolve_execution_device(
    value: torch.device | str | int | None, device_map: Mapping[str, int | str] | None
) -> torch.device:
    """An explicit ``execution_device`` as a torch device (an int is a GPU index), else the default for the map."""
    if value is None:
        return default_execution_device(device_map)
    return devices.active().normalize(value)
