"""Checks of a run's own options at the edge (generation ranges, prompt, headroom, device maps, module classes), each
failing with one line."""

from __future__ import annotations

import math
from typing import Any

import torch

from offload_core import devices
from offload_core.errors import ConfigError, DeviceMapError
from offload_core.values import device_key

#: the largest seed ``torch.manual_seed`` takes (a 64-bit unsigned integer)
MAX_SEED = 2**64 - 1


def check_generation(cfg: Any) -> None:
    """``max_new_tokens``, ``seed``, the prompt and (when sampling) ``temperature``, ``top_k`` and ``top_p``."""
    if cfg.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={cfg.max_new_tokens} must be at least 1: give how many tokens to generate")
    if not 0 <= cfg.seed <= MAX_SEED:
        raise ConfigError(f"seed={cfg.seed} is out of range: give an integer from 0 to 2**64-1")
    if not str(cfg.prompt).strip():
        raise ConfigError("prompt is empty: give some text, e.g. prompt='What is the capital of France?'")
    temperature, top_p = float(cfg.temperature), float(cfg.top_p)
    if not (math.isfinite(temperature) and temperature > 0):
        raise ConfigError(f"temperature={cfg.temperature} must be a number above 0 (1.0 samples as the model says)")
    if cfg.top_k < 0:
        raise ConfigError(f"top_k={cfg.top_k} is negative: give 0 (no limit) or a positive number of tokens")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise ConfigError(f"top_p={cfg.top_p} must lie in (0, 1]: give a probability mass such as 0.9")


def check_device_map_devices(device_map: dict, execution_device: torch.device) -> None:
    """Every device a device map names exists on this machine (and is one this run can use)."""
    for name, value in device_map.items():
        dev = None if isinstance(value, bool) else device_key(value)
        if dev is None:
            continue  # not a device at all: the device map check names it with the others
        where = f"device_map entry {name!r}: {value!r}"
        if dev == "mps":
            raise DeviceMapError(f"{where} is not a device this run can use; give cpu, disk or a GPU index")
        if isinstance(dev, int):
            count = devices.gpu_count()
            if not devices.is_accelerator(execution_device) or dev >= count:
                raise DeviceMapError(
                    f"{where} names GPU {dev}, but this run has {count} GPU(s) "
                    f"and executes on {execution_device}; use cpu or disk"
                )


def check_module_classes(model: torch.nn.Module, classes: list[str] | None) -> None:
    """Each name in ``no_split_module_classes`` is the class of some module of the model."""
    if not classes:
        return
    present = {type(module).__name__ for module in model.modules()}
    unknown = [name for name in classes if name not in present]
    if unknown:
        raise ConfigError(
            f"model.no_split_module_classes names {', '.join(map(repr, unknown))}, which the model "
            f"lacks; use classes it has, e.g. {', '.join(sorted(present)[:4])}"
        )
