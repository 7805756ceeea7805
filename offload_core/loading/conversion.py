"""Map checkpoint tensor names to a model's state-dict names with transformers' own conversion mapping (renamings,
per-expert tensors merged into fused experts); :mod:`offload_core.loading.converted` presents a checkpoint under the
model's names."""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from offload_core.errors import CheckpointError
from offload_core.storage.checkpoint import Checkpoint
from offload_core.values import format_size

__all__ = [
    "ConversionMismatchError",
    "ConvertedTensor",
    "ConversionSummary",
    "KeyConversion",
    "key_conversion",
]

#: An index into a target tensor: one int or slice per dimension.
Index = tuple


class ConversionMismatchError(CheckpointError):
    """A checkpoint whose tensors cannot be converted to the model's: a missing expert, or two layouts at once."""


@dataclass
class ConvertedTensor:
    """One model tensor built from several checkpoint tensors by transformers' operations.

    ``parts`` says where each source lies in the target (``target[index] = source``) when the operations
    only place sources side by side (stack, concatenate): such a target is read part by part, in place.
    ``None`` when another operation is involved: the target is then materialised by transformers' converter.
    """

    target: str
    sources: list[str]
    operations: list[str]
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: list[tuple[str, Index]] | None
    converter: Any = field(repr=False, default=None)
    by_pattern: dict[str, list[str]] = field(repr=False, default_factory=dict)

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class ConversionSummary:
    """What the plan report says about conversion: renamed and converted tensors, and what converting costs."""

    renamed: int
    converted: int
    converted_bytes: int
    part_by_part: int  # converted tensors read part by part in place (no copy of the whole source on disk)
    operations: dict[str, int]  # "MergeModulelist+Concatenate" -> how many targets

    def lines(self) -> list[str]:
        if not (self.renamed or self.converted):
            return ["checkpoint names match the model: nothing converted"]
        lines = [f"{self.renamed} tensor(s) renamed to the model's names (no cost)"]
        if self.converted:
            ops = ", ".join(f"{name} x{count}" for name, count in sorted(self.operations.items()))
            lines.append(
                f"{self.converted} tensor(s) built from several checkpoint tensors ({ops}): "
                f"{format_size(self.converted_bytes)}; {self.part_by_part} read part by part in place, the rest "
                "materialised once per read or write"
            )
        return lines


@dataclass
class KeyConversion:
    """Which checkpoint key(s) feed each model tensor: ``renamed`` (model name -> key) and ``converted`` targets."""

    renamed: dict[str, str] = field(default_factory=dict)
    converted: dict[str, ConvertedTensor] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.renamed or self.converted)

    def summary(self) -> ConversionSummary:
        operations: dict[str, int] = {}
        for item in self.converted.values():
            name = "+".join(item.operations)
            operations[name] = operations.get(name, 0) + 1
        return ConversionSummary(
            renamed=len(self.renamed),
            converted=len(self.converted),
            converted_bytes=sum(item.nbytes for item in self.converted.values()),
            part_by_part=sum(1 for item in self.converted.values() if item.parts is not None),
            operations=operations,
        )


def _transforms(model: nn.Module, key_mapping: dict[str, str] | None) -> tuple[list, list]:
    """transformers' renamings and converters for ``model`` (empty for a model that is not a PreTrainedModel)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming
    from transformers.modeling_utils import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return [], []
    mapping = get_model_conversion_mapping(model, key_mapping)
    return (
        [t for t in mapping if isinstance(t, WeightRenaming)],
        [t for t in mapping if isinstance(t, WeightConverter)],
    )


def run_converter(
    converter: Any, target: str, sources: dict[str, list[str]], tensor: Any, model: nn.Module | None
) -> dict:
    """Run a fresh copy of transformers' converter on ``tensor(key)`` for each source key: ``{model name: tensor}``."""
    job = copy.deepcopy(converter)
    for pattern, keys in sources.items():
        for key in keys:
            job.add_tensor(target, key, pattern, lambda key=key: tensor(key))
    out = job.convert(target, model=model, config=getattr(model, "config", None))
    return {name: value[0] if isinstance(value, list) else value for name, value in out.items()}


def _layout(
    operations: list[Any], sources: dict[str, list[str]], shapes: dict[str, tuple[int, ...]]
) -> list[tuple[str, Index]] | None:
    """Where each source lands in the target when the operations are a stack and/or a concatenation; else None."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    # Each pattern is a list of (shape, parts) "tensors"; a part is (key, index) with one entry per dimension.
    current: dict[str, list[tuple[list[int], list[tuple[str, list]]]]] = {
        pattern: [(list(shapes[key]), [(key, [slice(None)] * len(shapes[key]))]) for key in keys]
        for pattern, keys in sources.items()
    }
    for op in operations:
        if type(op) is MergeModulelist:
            merged = {}
            for pattern, items in current.items():
                ndim = len(items[0][0]) + 1
                dim = op.dim % ndim
                parts = [(key, idx[:dim] + [j] + idx[dim:]) for j, (_, ps) in enumerate(items) for key, idx in ps]
                merged[pattern] = [(items[0][0][:dim] + [len(items)] + items[0][0][dim:], parts)]
            current = merged
        elif type(op) is Concatenate:
            items = [item for pattern in sources if pattern in current for item in current[pattern]]
            ndim = len(items[0][0])
            dim = op.dim % ndim
            offset, parts = 0, []
            for shape, ps in items:
                for key, idx in ps:
                    entry = idx[dim]
                    shifted = (
                        entry + offset
                        if isinstance(entry, int)
                        else slice(
                            (entry.start or 0) + offset, (entry.stop if entry.stop is not None else shape[dim]) + offset
                        )
                    )
                    parts.append((key, idx[:dim] + [shifted] + idx[dim + 1 :]))
                offset += shape[dim]
            current = {"": [(items[0][0][:dim] + [offset] + items[0][0][dim + 1 :], parts)]}
        else:
            return None
    (only,) = [item for items in current.values() for item in items]
    return [(key, tuple(idx)) for key, idx in only[1]]


def _missing_source(converter: Any, sources: dict[str, list[str]], expected: tuple[int, ...]) -> str | None:
    """The first per-expert key absent from ``sources`` (numbers at ``*`` run 0..N-1), or None when none is."""
    from transformers.core_model_loading import MergeModulelist

    merges = [op for op in converter.operations if type(op) is MergeModulelist]
    if not merges or not expected:
        return None
    count = expected[merges[0].dim % len(expected)]
    for pattern, keys in sources.items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))
        numbers = {}
        for key in keys:
            match = regex.search(key)
            if match:
                numbers[int(match.group(1))] = key
        for n in range(count):
            if n not in numbers and numbers:
                sample_n, sample = next(iter(numbers.items()))
                match = regex.search(sample)
                return sample[: match.start(1)] + str(n) + sample[match.end(1) :]
    return None


def key_conversion(
    model: nn.Module, checkpoint: Checkpoint, key_mapping: dict[str, str] | None = None
) -> KeyConversion:
    """The conversion from ``checkpoint``'s tensor names to ``model``'s (built on meta), as transformers loads it.

    ``checkpoint`` is a checkpoint folder or file, or an opened :class:`Checkpoint`. Keys are renamed
    and grouped exactly as ``from_pretrained`` does (its mapping, its base-model-prefix rule, its key
    order); nothing is read but headers. ``key_mapping`` is ``from_pretrained``'s argument of that name
    (regex renamings applied first). Raises :class:`ConversionMismatchError` for a missing expert
    tensor or a checkpoint that holds a fused tensor and its per-expert parts at once.
    """
    from offload_core.loading.checkpoint import Checkpoint

    if isinstance(checkpoint, (str, os.PathLike)):
        checkpoint = Checkpoint.open(checkpoint)
    if key_mapping is None and type(checkpoint) is Checkpoint:  # not a view of one: its names are its own
        return checkpoint.worked_out("key_conversion", model, lambda: _key_conversion(model, checkpoint, None))
    return _key_conversion(model, checkpoint, key_mapping)


def _key_conversion(model: nn.Module, checkpoint: Checkpoint, key_mapping: dict[str, str] | None) -> KeyConversion:
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    renamings, converters = _transforms(model, key_mapping)
    conversion = KeyConversion()
    # a quantized layer's packed tensors whose checkpoint names are no attribute names (``weight.absmax``)
    conversion.renamed.update(getattr(model, "offload_packed_renames", {}))
    if not (renamings or converters or getattr(model, "base_model_prefix", "")):
        return conversion
    meta = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None) or None
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    keys = set(checkpoint.keys())
    for key in sorted(keys, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if name not in meta and key in meta:
            name, pattern = rename_source_key(key, [], [], prefix, meta)
        if name not in meta:
            continue
        if pattern is None:
            if name != key:
                conversion.renamed.setdefault(name, key)
            continue
        converter, sources = groups.setdefault(name, (by_pattern[pattern], {}))
        sources.setdefault(pattern, []).append(key)
    for name, (converter, sources) in groups.items():
        expected = tuple(meta[name].shape)
        both = name in keys or name in conversion.renamed
        if both:
            first = next(iter(sources.values()))[0]
            raise ConversionMismatchError(
                f"checkpoint holds both {name!r} and per-expert tensors such as {first!r}; keep one layout "
                "(remove the fused tensor or the per-expert ones)"
            )
        missing = _missing_source(converter, sources, expected)
        if missing is not None:
            raise ConversionMismatchError(
                f"checkpoint lacks {missing!r}, needed to build {name!r}; "
                "re-download the checkpoint or add the missing shard"
            )
        shapes = {key: tuple(checkpoint.shape(key)) for keys_ in sources.values() for key in keys_}
        dtypes = {checkpoint.dtype(key) for key in shapes}
        dtype = dtypes.pop() if len(dtypes) == 1 else meta[name].dtype
        absent = [pattern for pattern in converter.source_patterns if pattern not in sources]
        try:
            built = run_converter(
                converter, name, sources, lambda key: torch.empty(shapes[key], dtype=dtype, device="meta"), model
            )
        except (ValueError, RuntimeError, IndexError) as error:
            if absent:
                built = {}
            else:
                raise ConversionMismatchError(
                    f"cannot build {name!r} from {len(shapes)} checkpoint tensor(s) such as {next(iter(shapes))!r}: "
                    f"{str(error).splitlines()[0]}; check that the checkpoint matches the model's config"
                ) from None
        if absent and tuple(getattr(built.get(name), "shape", ())) != expected:
            raise ConversionMismatchError(
                f"checkpoint has no tensor matching {absent[0]!r} for {name!r}; "
                "re-download the checkpoint or add the missing shard"
            )
        for target, value in built.items():
            ordered = [key for keys_ in sources.values() for key in keys_]
            parts = _layout(converter.operations, sources, shapes) if len(built) == 1 else None
            conversion.converted[target] = ConvertedTensor(
                target,
                ordered,
                [type(op).__name__ for op in converter.operations],
                tuple(value.shape),
                value.dtype,
                parts,
                converter,
                sources,
            )
    return conversion
