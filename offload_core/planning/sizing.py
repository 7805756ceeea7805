"""Bytes of every tensor and module of a model, tied parameters, and the largest unit that cannot be split."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, Iterator, Mapping

import torch
from torch import nn

from offload_core.values import dtype_byte_size, parse_dtype

Named = tuple[str, "nn.Module | torch.Tensor"]


def named_module_tensors(
    module: nn.Module, include_buffers: bool = True, recurse: bool = False, remove_duplicate: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for the parameters of ``module``, then (if asked) its buffers.

    ``remove_duplicate`` skips a tensor already yielded under another name (tied parameters).
    """
    yield from module.named_parameters(recurse=recurse, remove_duplicate=remove_duplicate)
    if include_buffers:
        yield from module.named_buffers(recurse=recurse, remove_duplicate=remove_duplicate)


#: the model attribute naming the tensors that keep their checkpoint dtype whatever the run's (the packed tensors of a
#: quantized checkpoint's layers: codes, scales and quantization state, read as they were saved)
KEPT_DTYPES = "offload_kept_dtypes"


def kept_dtypes(model: nn.Module) -> frozenset[str]:
    """The names of ``model``'s tensors that are never converted to the run's dtype (see :data:`KEPT_DTYPES`)."""
    return getattr(model, KEPT_DTYPES, frozenset())


def tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Bytes of ``tensor`` if stored in ``dtype`` (floating tensors only shrink to it; ints and bools keep theirs)."""
    width = dtype_byte_size(tensor.dtype)
    if dtype is not None and tensor.is_floating_point():
        width = min(width, dtype_byte_size(dtype))
    return math.ceil(tensor.numel() * width)


def compute_module_sizes(
    model: nn.Module,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
    buffers_only: bool = False,
) -> defaultdict[str, int]:
    """Bytes of every tensor, every module prefix and the whole model (key ``""``).

    Parameters and buffers count; a tensor shared under several names counts once, at its first name.
    With ``dtype`` each floating tensor counts at the smaller of its own width and ``dtype``'s;
    ``special_dtypes`` gives the dtype of single tensors by full name and wins over both.
    ``buffers_only`` counts buffers alone.
    """
    dtype = parse_dtype(dtype)
    special = {
        name: parse_dtype(value, what=f"special_dtypes[{name!r}]") for name, value in (special_dtypes or {}).items()
    }
    kept = kept_dtypes(model)
    sizes: defaultdict[str, int] = defaultdict(int)
    tensors = model.named_buffers() if buffers_only else named_module_tensors(model, recurse=True)
    for name, tensor in tensors:
        if name in special:
            size = math.ceil(tensor.numel() * dtype_byte_size(special[name]))
        elif name in kept:
            size = tensor_bytes(tensor)
        else:
            size = tensor_bytes(tensor, dtype)
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            sizes[".".join(parts[:depth])] += size
    return sizes


def tensor_aliases(model: nn.Module) -> dict[str, str]:
    """The one tie rule: every parameter and buffer name -> the first name of the same tensor object.

    Covers tied parameters (``lm_head.weight`` -> ``embed.weight``) and every name under a module
    registered twice (``nn.Sequential(layer, layer)``: ``1.weight`` -> ``0.weight``). Works on meta models.
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in named_module_tensors(model, recurse=True, remove_duplicate=False):
        aliases[name] = first.setdefault(id(tensor), name)
    return aliases


def tie_groups(model: nn.Module, parameters_only: bool = False) -> dict[str, list[str]]:
    """First name -> every name of that tensor, for tensors registered under more than one name."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)} if parameters_only else None
    groups: dict[str, list[str]] = {}
    for name, first in tensor_aliases(model).items():
        if params is None or name in params:
            groups.setdefault(first, []).append(name)
    return {first: names for first, names in groups.items() if len(names) > 1}


def find_tied_parameters(model: nn.Module, **kwargs: object) -> list[list[str]]:
    """Groups of names under which one ``Parameter`` object is registered, each sorted, the groups sorted.

    A module registered under two names (``nn.Sequential(layer, layer)``) ties all its parameters.
    """
    return sorted(sorted(names) for names in tie_groups(model, parameters_only=True).values())


def shared_modules(model: nn.Module) -> list[list[str]]:
    """Groups of names under which one module object is registered (``nn.Sequential(layer, layer)``)."""
    names: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def is_unsplittable(unit: nn.Module | torch.Tensor, no_split_module_classes: Iterable[str]) -> bool:
    """A tensor, a module without children, or a module whose class is named in ``no_split_module_classes``."""
    if not isinstance(unit, nn.Module):
        return True
    return type(unit).__name__ in set(no_split_module_classes) or next(unit.children(), None) is None


def get_max_layer_size(
    modules: Iterable[Named], module_sizes: Mapping[str, int], no_split_module_classes: Iterable[str]
) -> tuple[int, list[str]]:
    """The largest unsplittable unit under ``modules`` (``(name, module)`` pairs): its bytes and the names that have it.

    Splittable modules are opened into their children; leaves, tensors and no-split classes are the units.
    """
    no_split = set(no_split_module_classes or ())
    max_size, names = 0, []
    todo = list(modules)
    while todo:
        name, unit = todo.pop(0)
        if is_unsplittable(unit, no_split):
            size = module_sizes.get(name, 0)
            if size > max_size:
                max_size, names = size, [name]
            elif size == max_size:
                names.append(name)
        else:
            todo = [(f"{name}.{child}" if name else child, sub) for child, sub in unit.named_children()] + todo
    return max_size, names


def largest_block_size(
    model: nn.Module, no_split_module_classes: Iterable[str], dtype: torch.dtype | str | None = None
) -> int:
    """Bytes of the largest unit of ``model`` that a placement never splits (a no-split block, a leaf module or a direct
    tensor)."""
    sizes = compute_module_sizes(model, dtype=dtype)
    units: list[Named] = [
        *model.named_parameters(recurse=False),
        *model.named_children(),
        *model.named_buffers(recurse=False),
    ]
    return get_max_layer_size(units, sizes, no_split_module_classes)[0]


def reads_its_children(module: nn.Module) -> bool:
    """Whether ``module``'s forward may read its submodules' weights itself rather than through their forward: it
    owns parameters beside leaf submodules that hold some, and holds no deeper ones (a state-space mixer's ``A_log``
    beside the ``dt_proj`` whose weight it multiplies by; not a model owning a ``logit_scale`` beside its towers).
    Such a module's tensors are brought in together, its subtree's with its own."""
    holding = [child for child in module.children() if any(True for _ in child.parameters())]
    return (
        any(True for _ in module.parameters(recurse=False))
        and bool(holding)
        and not any(True for child in holding for _ in child.children())
    )


def largest_module_size(model: nn.Module, dtype: torch.dtype | str | None = None) -> int:
    """Bytes of the largest unit a module-by-module policy brings in: a leaf module, a direct tensor, or a module that
    :func:`reads_its_children` with its whole subtree."""
    whole = {type(module).__name__ for module in model.modules() if reads_its_children(module)}
    return largest_block_size(model, sorted(whole), dtype=dtype)


def no_split_classes(model: nn.Module, given: Iterable[str] | None = None) -> list[str]:
    """The module classes never split across devices: ``given`` when it names any, else the model's own
    ``_no_split_modules`` (transformers' rule, and accelerate's)."""
    return list(given or getattr(model, "_no_split_modules", None) or [])
