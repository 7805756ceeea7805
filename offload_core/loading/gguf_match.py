"""Which of a GGUF file's tensors each of a model's weights is read from (transformers' names for them, checked
against the shapes the file's metadata gives the model), and whether this reader reads them in place."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from offload_core.errors import CheckpointError
from offload_core.storage.gguf.file import GGUFFile
from offload_core.storage.gguf.split import GGUFSplit

__all__ = ["PER_TENSOR_PROCESSORS", "check_in_place", "match_tensors", "reads_in_place"]

#: transformers' tensor processors that change one tensor at a time, keeping its name (the others merge or split
#: tensors into other names as they load: those files are converted once instead of read in place)
PER_TENSOR_PROCESSORS = (
    "TensorProcessor",
    "LlamaTensorProcessor",
    "BloomTensorProcessor",
    "T5TensorProcessor",
    "MambaTensorProcessor",
    "NemotronTensorProcessor",
    "Gemma2TensorProcessor",
    "Qwen2MoeTensorProcessor",  # a fused expert tensor of two (gate and up, concatenated per expert): read by parts
    "MiniMaxM2TensorProcessor",  # the same experts' merge, and its routing bias named by a fallback
)


def _newer_path(architecture: str) -> bool:
    """Whether transformers loads ``architecture`` through its newer GGUF path (not tensor by tensor)."""
    try:
        from transformers.integrations.gguf.utils import is_gguf_arch_supported
    except ImportError:  # an older transformers: only the per-tensor loader
        return False
    return bool(is_gguf_arch_supported(architecture))


def reads_in_place(architecture: str, processor: Any) -> bool:
    """Whether this reader names and reads a GGUF file of ``architecture`` tensor by tensor (``processor``:
    transformers' tensor processor for it)."""
    return not _newer_path(architecture) and type(processor).__name__ in PER_TENSOR_PROCESSORS


def check_in_place(path: Path, architecture: str, processor: Any, split: bool = False) -> None:
    """One line for a file whose tensors transformers transposes, merges or splits at load, or loads through its newer
    GGUF path (``split``: a model split across files, which only this reader reads: merged into one file first)."""
    if reads_in_place(architecture, processor):
        return
    how = (
        "loads it through its own GGUF path"
        if _newer_path(architecture)
        else "changes the layout of its tensors as it loads (transposes, merges or splits them)"
    )
    if split:
        raise CheckpointError(
            f"{path}: a GGUF model of architecture {architecture!r} split across files is not read here (transformers "
            f"{how}, from one file); merge the parts into one file with llama.cpp's `llama-gguf-split --merge`"
        )
    raise CheckpointError(
        f"{path}: storage=gguf cannot read architecture {architecture!r} in place (transformers {how}); leave "
        "storage at its default, which converts the file once"
    )


def match_tensors(
    path: Path, file: GGUFFile | GGUFSplit, mapping: dict[str, str], model: Any
) -> tuple[dict, dict, dict]:
    """:func:`_match` of the file's tensors against ``model`` (built on meta from the file's config)."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return _match(path, file, mapping, expected, list(groups.values()))


def _match(
    path: Path, file: GGUFFile | GGUFSplit, mapping: dict[str, str], expected: dict[str, tuple], groups: list[list[str]]
) -> tuple[dict[str, str], dict[str, tuple], dict[str, tuple[str, ...]]]:
    """``{model name: GGUF name}``, the model's shapes for the file's tensors transformers would load, and the
    tensors several GGUF ones merge into (:attr:`GGUFCheckpoint.merged`); a one-line error where a tensor's size
    disagrees with the config in the file's metadata, or where the file lacks a weight the model has (``groups``:
    the names of each parameter, tied ones together)."""
    found: dict[str, list[str]] = {}
    for name in file.entries:  # an expert tensor named without its suffix, as the MoE processor looks it up
        target = mapping.get(name, mapping.get(name.removesuffix(".weight")))
        if target is not None and target in expected:
            found.setdefault(target, []).append(name)
    sources: dict[str, str] = {}
    shapes: dict[str, tuple] = {}
    merged: dict[str, tuple[str, ...]] = {}
    for target, names in found.items():
        names.sort(key=lambda name: "_gate_" not in name)  # a fused expert tensor: gate first, then up
        shape = expected[target]
        parts = [file.entries[name].shape for name in names]
        if len(names) > 1:
            joined = (parts[0][0], sum(part[1] for part in parts), *parts[0][2:])
            fits = all(len(part) == 3 and part[0] == shape[0] and part[2:] == shape[2:] for part in parts)
            if not fits or joined != tuple(shape):
                raise CheckpointError(
                    f"{path}: tensors {names} have shapes {[list(p) for p in parts]}, but the file's metadata (its "
                    f"config) makes {target!r}, which they make together, {list(shape)}; the file is damaged or was "
                    "written for another configuration"
                )
            merged[target] = tuple(names)
        elif int(np.prod(shape, dtype=np.int64)) != file.entries[names[0]].numel or (
            len(parts[0]) == len(shape) and parts[0] != shape
        ):
            if sorted(parts[0]) == sorted(shape):  # its dimensions in another order: transformers' layout, not damage
                how = f"reads tensor {names[0]!r} of shape {list(parts[0])} into {target!r} of {list(shape)} as it lies"
                raise _unconverted(path, file, how)
            raise CheckpointError(
                f"{path}: tensor {names[0]!r} has shape {list(parts[0])}, but the file's metadata (its config) makes "
                f"{target!r} {list(shape)}; the file is damaged or was written for another configuration, or is a "
                f"variant of {file.architecture!r} whose config transformers does not rebuild from GGUF metadata"
            )
        sources[target] = names[0]
        shapes[target] = shape
    missing = [names[0] for names in groups if not any(name in sources for name in names)]
    unnamed = [name for name in file.entries if name not in mapping and name.removesuffix(".weight") not in mapping]
    experts = [name for name in unnamed if "_exps." in name]
    if missing and experts:  # experts its GGUF loader names after no weight of the model (gpt-oss's): not damage
        raise _unconverted(path, file, f"names no weight after {experts[0]!r} and leaves {missing[0]!r} unloaded")
    if missing:
        raise CheckpointError(
            f"{path} holds {len(file.entries)} tensors but its metadata (its config) needs {len(missing)} more, such "
            f"as {missing[0]!r}; the file is damaged or incomplete: re-download or re-convert it"
        )
    return sources, shapes, merged


def _unconverted(path: Path, file: GGUFFile | GGUFSplit, how: str) -> CheckpointError:
    """One line for a file of an architecture whose tensors transformers' GGUF loader does not bring into its model
    (``how``: what its load does instead, leaving a weight wrong or newly initialized): the file is not damaged."""
    import transformers

    return CheckpointError(
        f"{path}: transformers {transformers.__version__} cannot load GGUF files of architecture "
        f"{file.architecture!r} (its GGUF loader {how}); run the original model's safetensors checkpoint instead, "
        "or a transformers that loads this architecture from GGUF"
    )
