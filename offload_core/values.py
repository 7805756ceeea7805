"""Values users write, parsed once at the edge: byte sizes ("2GiB", "500MB") into ints, dtype names, and device keys."""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping

import torch

from offload_core.errors import ConfigError

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?[Bb]|B)?\s*$")


def parse_size(size: int | str, what: str = "size") -> int:
    """Return ``size`` in bytes.

    ``GiB/MiB/KiB`` are powers of 2, ``GB/MB/KB`` powers of 10, an int (or a digit string) is bytes.
    A lowercase ``b`` means bits (``"8Mb"`` is 1 MB). Anything else, negative numbers and ``"10G"``
    included, raises :class:`ConfigError`.
    """
    if isinstance(size, bool):
        raise ConfigError(f"{what}={size!r} is not a size: give bytes or a string like '2GiB' or '500MB'")
    if isinstance(size, int):
        if size < 0:
            raise ConfigError(f"{what}={size} is negative: give a size of 0 bytes or more")
        return size
    if isinstance(size, float) and size.is_integer() and size >= 0:
        return int(size)
    match = _SIZE.match(str(size))
    if match is None and str(size).strip().startswith("-") and _SIZE.match(str(size).strip()[1:]):
        raise ConfigError(f"{what}={size!r} is negative: give a size of 0 bytes or more")
    if match is None:
        raise ConfigError(
            f"{what}={size!r} is not a size: use bytes or a number with one of "
            "B, KB, MB, GB, TB (powers of 10) or KiB, MiB, GiB, TiB (powers of 2), e.g. '2GiB'"
        )
    number, unit = match.groups()
    unit = unit or "B"
    bits = unit.endswith("b") and unit != "B"
    value = float(number) * _UNITS[unit.upper()]
    if bits:
        value /= 8
    return int(value)


def format_size(num_bytes: int) -> str:
    """Human-readable size in powers of 2 (``1.50 GiB``)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"  # pragma: no cover


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
}


def parse_dtype(dtype: str | torch.dtype | None, what: str = "dtype") -> torch.dtype | None:
    """Turn ``"bfloat16"``/``"bf16"``/``torch.bfloat16`` into a torch dtype; ``None``/``"auto"`` stay ``None``."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name == "auto":
        return None
    if name not in _DTYPES:
        raise ConfigError(f"{what}={dtype!r} is unknown: use one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


def dtype_byte_size(dtype: torch.dtype) -> float:
    """Bytes per element (``bool`` counts 1/8, as a bit, like the reference sizing)."""
    if dtype == torch.bool:
        return 1 / 8
    return torch.empty((), dtype=dtype).element_size()


# Device keys: the one parser for every place a user names a device (device maps, max_memory,
# execution devices). Planning, loading, the runner and module hooks all call these.

NAMED_DEVICES = ("cpu", "disk", "mps")
DEVICE_FORMS = "a GPU index (0, '0' or 'cuda:0'), 'cpu', 'disk' or 'mps'"


def budget_key(device: torch.device) -> int | str:
    """The key of ``device``'s budget in ``max_memory`` and in a reservation: ``"cpu"`` for a CPU, else its index (0
    for a bare ``cuda``, as :func:`device_key` reads it). The one rule: every place that keys a budget by a device
    calls this."""
    return "cpu" if device.type == "cpu" else (device.index or 0)


def device_key(value: object) -> int | str | None:
    """``value`` as an int GPU id, ``"cpu"``, ``"disk"`` or ``"mps"``; ``None`` when it names no device we know.

    A GPU is named by its index, ``cuda``/``cuda:N``, or the active accelerator's own type (``xpu:N``)."""
    from offload_core.devices import active

    kinds = {"cuda", active().index_type}
    if isinstance(value, torch.device):
        if value.type in kinds:
            return value.index or 0
        value = value.type
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in NAMED_DEVICES:
            return text
        kind, _, digits = text.partition(":")
        if kind in kinds and not digits:
            return 0
        if kind in kinds:
            text = digits
        if text.isdigit():
            return int(text)
    return None


def is_offloaded(device: int | str, execution_device: torch.device) -> bool:
    """Whether tensors a device map puts on ``device`` are offloaded (held by a store, streamed in).

    ``disk`` always is; ``cpu`` is when the model runs on an accelerator (on a CPU run it is resident).
    """
    return device == "disk" or (device == "cpu" and execution_device.type != "cpu")


def torch_device(device: int | str, execution_device: torch.device) -> torch.device:
    """The torch device a device-map value computes on: an offloaded tier computes on ``execution_device``."""
    if isinstance(device, int):
        from offload_core.devices import gpu

        return gpu(device)
    if is_offloaded(device, execution_device):
        return execution_device
    return torch.device(device)


def read_fields(cls: type, value: object, what: str, example: str) -> object:
    """``value`` as the frozen dataclass ``cls``: itself, ``cls()`` for None, or a dict of its fields (anything else,
    or a key it does not have, refused in one line naming the fields it takes; ``example`` shows one)."""
    names = [f.name for f in dataclasses.fields(cls)]
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{what}={value!r} is not a {cls.__name__} or a dict of its fields; give for example {what}={example} "
            f"(fields: {', '.join(names)})"
        )
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ConfigError(f"{what} has no field {', '.join(map(repr, unknown))}; its fields: {', '.join(names)}")
    return cls(**dict(value))
