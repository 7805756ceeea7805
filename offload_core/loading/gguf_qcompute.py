"""``storage.compute=quantized``: the GGUF model's linear layers whose weights have a packed kernel (Q4_0, Q4_1, Q4_K,
Q8_0) replaced on the empty model by :class:`~offload_core.storage.gguf.qlinear.QuantLinear`, and the checkpoint
serving their packed tensors (``<layer>.qweight``, ``<layer>.qscale``) in place of ``<layer>.weight``: planned,
loaded and moved packed; every other tensor keeps the exact path."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from offload_core.errors import ConfigError
from offload_core.loading.gguf_checkpoint import GGUFCheckpoint
from offload_core.storage.gguf.qlinear import PARTS, QuantLinear, QuantSpec, leave_exact_reason, pack_into

__all__ = ["QuantizedGGUFCheckpoint", "compute_quantized", "quantized_lines"]


class QuantizedGGUFCheckpoint(GGUFCheckpoint):
    """A GGUF checkpoint whose quantized linear weights are read as their packed tensors (``packed``: packed key ->
    (weight key, part, spec)): each built from the file's blocks on read (once for a resident layer, on every read
    for an offloaded one), with no float pass for the 4-bit types. ``left_exact``: weight key -> why it was not;
    ``replaced``: the weight keys no module computes on any more (a weight tied to an embedding stays, for it)."""

    def __init__(
        self,
        base: GGUFCheckpoint,
        packed: dict[str, tuple[str, str, QuantSpec]],
        left_exact: dict[str, str],
        replaced: set[str],
    ) -> None:
        sources = {k: v for k, v in base.sources.items() if k not in replaced}
        shapes = {k: base._shapes[k] for k in sources}
        for key, (weight, part, spec) in packed.items():
            sources[key] = base.sources[weight]
            shapes[key] = spec.part_spec(part)[0]
        super().__init__(base.path, base.file, sources, shapes, base.processor, base.merged)
        self.packed = packed
        self.left_exact = left_exact

    def computes_quantized(self, key: str) -> bool:
        return key in self.packed

    def dtype(self, key: str) -> torch.dtype:
        if key in self.packed:
            _, part, spec = self.packed[key]
            return spec.part_spec(part)[1]
        return super().dtype(key)

    def nbytes(self, key: str) -> int:
        if key in self.packed:
            _, part, spec = self.packed[key]
            shape, kind = spec.part_spec(part)
            return math.prod(shape) * kind.itemsize
        return super().nbytes(key)

    def stored_nbytes(self, key: str) -> int:
        """A packed tensor's share of its weight's blocks in the file: the 4-bit or 8-bit values for ``qweight``,
        the rest of the blocks (their scales) for ``qscale``; the two read together move the weight's blocks once."""
        if key not in self.packed:
            return super().stored_nbytes(key)
        _, part, spec = self.packed[key]
        values = spec.out_features * spec.in_features * spec.bits // 8
        return values if part == "qweight" else super().stored_nbytes(key) - values

    def converted_in_place(self, key: str) -> bool:
        return key not in self.packed and super().converted_in_place(key)

    def fills(self, key: str) -> bool:
        """A packed tensor is packed a pass of rows at a time into the buffer it is read into."""
        return key in self.packed or super().fills(key)

    def read_into(self, key: str, out: torch.Tensor, held: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        if key in self.packed:
            _, part, spec = self.packed[key]
            return pack_into(self.raw(key) if held is None else held[0], spec, part, out)
        return super().read_into(key, out, held)

    def get(self, key: str) -> torch.Tensor:
        if key in self.packed:
            _, part, spec = self.packed[key]
            shape, kind = spec.part_spec(part)
            return pack_into(self.raw(key), spec, part, torch.empty(shape, dtype=kind))
        return super().get(key)

    def __repr__(self) -> str:
        return f"QuantizedGGUFCheckpoint({str(self.path)!r}, {len(self.packed) // len(PARTS)} linear layers packed)"


def _row_order(checkpoint: GGUFCheckpoint, key: str, rows: int) -> tuple[int, ...] | None | str:
    """The order transformers' processor puts ``key``'s rows in (None: as they lie), or why it cannot be had: the
    processor is run on the row numbers, and must give them back reordered."""
    if checkpoint.converted_in_place(key):
        return None
    if type(checkpoint.processor).__name__ != "LlamaTensorProcessor":
        return f"transformers' {type(checkpoint.processor).__name__} changes it as it loads"
    probe = np.arange(rows, dtype=np.float32).reshape(rows, 1)
    moved = checkpoint.processor.process(weights=probe, name=checkpoint.sources[key]).weights
    order = np.asarray(moved).reshape(-1).astype(np.int64)
    if sorted(order.tolist()) != list(range(rows)):
        return "transformers' processor changes more than its row order"
    return tuple(order.tolist())


def compute_quantized(model: nn.Module, checkpoint: Any, dtype: torch.dtype | None) -> QuantizedGGUFCheckpoint:
    """Replace ``model``'s (empty) linear layers whose GGUF weights have a packed kernel by
    :class:`QuantLinear` and return the checkpoint serving their packed tensors; a checkpoint that is not a GGUF
    file read in place is one line."""
    if not isinstance(checkpoint, GGUFCheckpoint):
        raise ConfigError(
            "storage.compute=quantized computes on a GGUF file's packed blocks, and this model's checkpoint is not "
            "a GGUF file; give model.path=<file.gguf> or drop storage.compute"
        )
    dtype = dtype or torch.float32
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    packed: dict[str, tuple[str, str, QuantSpec]] = {}
    left: dict[str, str] = {}
    replaced: set[str] = set()
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        key = f"{name}.weight"
        tied = names[id(module.weight)]
        source = next((n for n in [key, *tied] if n in checkpoint.sources), None)
        if source is None:
            continue
        entry = checkpoint.file.entries[checkpoint.sources[source]]
        reason = leave_exact_reason(entry.kind, tuple(module.weight.shape))
        order = None if reason else _row_order(checkpoint, source, module.out_features)
        if isinstance(order, str):
            reason = order
        if reason:
            left[source] = reason
            continue
        spec = QuantSpec(entry.kind, module.out_features, module.in_features, order)
        layer = QuantLinear(spec, module.bias is not None, dtype)
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).add_module(child, layer)
        replaced.add(key)
        if set(tied) <= replaced:  # no module computes on the float weight any more
            replaced.add(source)
        for part in PARTS:
            packed[f"{name}.{part}"] = (source, part, spec)
    return QuantizedGGUFCheckpoint(checkpoint, packed, left, replaced)


def quantized_lines(
    checkpoint: Any, device_map: Mapping[str, int | str], model: nn.Module, execution_device: torch.device
) -> list[str]:
    """The plan's lines on quantized compute: per GGML type, the linear weights computed on their packed tensors
    (offloaded and resident, their bytes held) and those left exact with why; none for another checkpoint."""
    if not isinstance(checkpoint, QuantizedGGUFCheckpoint):
        return []
    from offload_core.loading.routes import route_tensors
    from offload_core.planning import normalize_device_map
    from offload_core.values import format_size

    offloaded = set(route_tensors(model, normalize_device_map(dict(device_map)), execution_device).offloaded.values())
    rows: dict[tuple[str, int], list[int]] = {}
    for key, (weight, part, spec) in checkpoint.packed.items():
        row = rows.setdefault((checkpoint.tensor_type(key), spec.bits), [0, 0, 0, 0])
        row[0] += part == "qweight"
        row[1] += part == "qweight" and key in offloaded
        row[2] += checkpoint.nbytes(key)
        row[3] += 4 * spec.out_features * spec.in_features if part == "qweight" else 0
    shown = [
        f"{kind} x{n} as int{bits} ({moved} offloaded; {format_size(held)} packed, float32 {format_size(full)})"
        for (kind, bits), (n, moved, held, full) in sorted(rows.items())
    ]
    lines = [f"computed quantized (storage.compute=quantized): {', '.join(shown) or 'none'}"]
    for key, (source, part, _) in sorted(checkpoint.packed.items()):
        layer = key.rsplit(".", 1)[0]
        if part == "qweight" and source != f"{layer}.weight":
            lines.append(f"  {layer} computes on a packed copy of {source} (tied; the exact values stay for it)")
    reasons: dict[str, list[str]] = {}
    for key, reason in checkpoint.left_exact.items():
        reasons.setdefault(f"{checkpoint.tensor_type(key)}: {reason}", []).append(key)
    for reason, keys in sorted(reasons.items()):
        lines.append(f"  left exact, {reason}: {len(keys)} linear weight(s), such as {keys[0]}")
    return lines


def quantized_checkpoint(model: nn.Module, checkpoint: Any, storage: Any, dtype: torch.dtype | None) -> Any:
    """``checkpoint``, or for a store built with ``compute="quantized"`` (``storage.compute=quantized``) the GGUF
    checkpoint serving the packed weights of the linear layers it replaces on the empty ``model``
    (:func:`compute_quantized`): the one rule ``run.py`` and ``from_pretrained`` follow."""
    return compute_quantized(model, checkpoint, dtype) if storage.quantized_compute else checkpoint
