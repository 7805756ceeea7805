"""A diffusers pipeline folder (``model_index.json``) as one model to plan: its ``nn.Module`` components gathered under
one module, keys prefixed by component, built empty and dispatched like a transformers model; diffusers is imported
only here, and only when a pipeline folder is given."""

from __future__ import annotations

import functools
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from offload_core.errors import CheckpointError, ConfigError
from offload_core.loading.quiet import without_image_processor_notices

PIPELINE_INDEX = "model_index.json"
#: methods besides ``forward`` by which pipelines call a component (a VAE's ``decode``)
ENTRY_METHODS = ("encode", "decode")


def is_pipeline_folder(path: Any) -> bool:
    """Whether ``path`` is a folder holding a diffusers ``model_index.json``."""
    return path is not None and (Path(path).expanduser() / PIPELINE_INDEX).is_file()


def _import_diffusers() -> Any:
    """diffusers, its pipelines imported without transformers' notices about image processors."""
    without_image_processor_notices()
    try:
        return importlib.import_module("diffusers")
    except ImportError:
        raise ConfigError(
            "this folder is a diffusers pipeline (it has model_index.json) and diffusers is not installed: "
            "pip install 'offload_core[diffusion]'"
        ) from None


def read_index(path: Path) -> tuple[str, dict[str, tuple[str, str]]]:
    """The pipeline class name and ``{component: (library, class name)}`` of ``model_index.json`` (empty slots left
    out)."""
    file = path / PIPELINE_INDEX
    try:
        index = json.loads(file.read_text(encoding="utf-8"))
        name = index["_class_name"]
        if not isinstance(name, str):
            raise TypeError
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"{file} is not a diffusers model index (JSON naming _class_name and each component); "
            "re-save the pipeline with save_pretrained"
        ) from None
    components = {}
    for key, value in index.items():
        if key.startswith("_") or not isinstance(value, list) or len(value) != 2 or None in value:
            continue
        components[key] = (str(value[0]), str(value[1]))
    return name, components


def _component_class(path: Path, name: str, library: str, class_name: str) -> type:
    try:
        return getattr(importlib.import_module(library), class_name)
    except (ImportError, AttributeError):
        raise CheckpointError(
            f"{path / PIPELINE_INDEX} names component {name!r} as {library}.{class_name}, which is not "
            "installed; install that library or fix the index"
        ) from None


def _call_order(name: str) -> int:
    """Components in the order a text-to-image pipeline calls them: encoders, the denoiser, then the VAE."""
    if "encoder" in name:
        return 0
    return 2 if name in ("vae", "movq", "vqvae") else 1


def _plan_order(name: str) -> tuple[int, int]:
    """Components in the order the plan keeps them on the execution device: the denoiser first (called once per
    denoising step, so each of its bytes kept there saves a move per step), then the rest in call order (once per
    image)."""
    order = _call_order(name)
    return (order != 1, order)


class PipelineModules(nn.Module):
    """The pipeline's ``nn.Module`` components as children named by component, the denoiser first, then the rest in
    call order (the placement fills the budget in this order: :func:`_plan_order`). Calling it runs the
    pipeline (its ``forward`` is the pipeline's ``__call__``), so module hooks on it see each image as one forward."""

    def __init__(self, components: Mapping[str, nn.Module]) -> None:
        super().__init__()
        for name, module in components.items():
            self.add_module(name, module)
        self.pipeline: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _unwrapped_call(type(self.pipeline))(self.pipeline, *args, **kwargs)


def _unwrapped_call(cls: type) -> Any:
    return cls.__bases__[0].__call__ if getattr(cls, "_offload_core_pipeline", False) else cls.__call__


@functools.lru_cache(maxsize=None)
def _routed_class(cls: type) -> type:
    """``cls`` whose call goes through its :class:`PipelineModules` (so the module hooks there run around it)."""

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self.offload_modules(*args, **kwargs)

    return type(
        cls.__name__,
        (cls,),
        {
            "__call__": __call__,
            "_offload_core_pipeline": True,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        },
    )


@dataclass
class EmptyPipeline:
    """A pipeline whose module components hold meta weights (``modules``), the dtype they run in and their no-split
    classes."""

    pipeline: Any
    modules: PipelineModules
    dtype: torch.dtype
    block_classes: dict[str, list[str]]  # component -> its own no-split classes


def _default_dtype(path: Path, names: list[str]) -> torch.dtype:
    """The dtype of the first floating tensor of the largest component's weights (float32 when none)."""
    from offload_core.loading.pipeline_checkpoint import open_component

    best: tuple[int, torch.dtype] = (-1, torch.float32)
    for name in names:
        with open_component(path / name) as part:
            floats = [k for k in part.keys() if part.dtype(k).is_floating_point]
            if floats and part.total_bytes() > best[0]:
                best = (part.total_bytes(), part.dtype(floats[0]))
    return best[1]


def build_empty_pipeline(path: str | Path, dtype: torch.dtype | None = None) -> EmptyPipeline:
    """The pipeline of ``path`` with every module component built on the meta device in ``dtype`` (None: the
    checkpoint's); tokenizers and schedulers are loaded as the pipeline loads them. From here on, large allocations
    are mapped apart (:data:`offload_core.loading.pipeline_memory.PIPELINE_MMAP_THRESHOLD`)."""
    from offload_core.loading.empty import init_empty_weights
    from offload_core.loading.pipeline_memory import PIPELINE_MMAP_THRESHOLD, mmap_threshold
    from offload_core.loading.quiet import library_bars

    mmap_threshold(PIPELINE_MMAP_THRESHOLD)

    path = Path(path).expanduser()
    diffusers = _import_diffusers()
    class_name, entries = read_index(path)
    pipeline_cls = getattr(diffusers, class_name, None)
    if pipeline_cls is None:
        raise CheckpointError(
            f"{path / PIPELINE_INDEX} names pipeline {class_name!r}, which diffusers "
            f"{diffusers.__version__} does not have; upgrade diffusers or fix the index"
        )
    classes = {name: _component_class(path, name, lib, cls) for name, (lib, cls) in entries.items()}
    names = sorted((n for n, c in classes.items() if isinstance(c, type) and issubclass(c, nn.Module)), key=_plan_order)
    dtype = dtype or _default_dtype(path, names)
    modules: dict[str, nn.Module] = {}
    for name in names:
        cls = classes[name]
        with init_empty_weights():
            if issubclass(cls, diffusers.ModelMixin):
                module = cls.from_config(cls.load_config(path / name))
            else:
                from transformers import AutoConfig

                module = cls._from_config(AutoConfig.from_pretrained(path / name, local_files_only=True))
        modules[name] = nn.Module.to(module, dtype).eval()  # the module's own ``to`` warns about float32 modules
    with library_bars(False, "diffusers"):  # its tokenizers and schedulers: no weights, nothing to watch
        pipeline = pipeline_cls.from_pretrained(path, local_files_only=True, low_cpu_mem_usage=False, **modules)
    container = PipelineModules(modules)
    container.pipeline = pipeline
    blocks = {name: list(getattr(module, "_no_split_modules", None) or []) for name, module in modules.items()}
    return EmptyPipeline(pipeline, container, dtype, blocks)


def component_no_split(empty: EmptyPipeline, whole_limit: int | None, dtype: torch.dtype | None) -> list[str]:
    """No-split classes for the pipeline: a component of at most ``whole_limit`` bytes (None: any) moves whole (its
    class is a block, so chained policies chain whole components); a larger one splits at its own blocks, less
    those with an instance over a limit above 0 (a UNet's up block can be a third of it), whose inner blocks
    and modules are the units instead."""
    from offload_core.planning import compute_module_sizes

    sizes = compute_module_sizes(empty.modules, dtype=dtype)
    classes: list[str] = []
    for name, module in empty.modules.named_children():
        whole = whole_limit is None or sizes.get(name, 0) <= whole_limit
        if whole:
            chosen = [type(module).__name__]
        else:
            too_large = {
                type(inner).__name__
                for inner_name, inner in module.named_modules(prefix=name)
                if whole_limit and sizes.get(inner_name, 0) > whole_limit
            }
            chosen = [cls for cls in empty.block_classes[name] if cls not in too_large]
        for cls in chosen:
            if cls not in classes:
                classes.append(cls)
    return classes


class _EntryPatches:
    """Undoes :func:`attach_entries`: the components' own methods and classes come back."""

    def __init__(self, patched: list[tuple[nn.Module, str]], modules: list[nn.Module], pipeline: Any) -> None:
        self.patched = patched
        self.modules = modules
        self.pipeline = pipeline

    def remove(self) -> None:
        from offload_core.loading.model_device import restore_device_report

        for module, method in self.patched:
            module.__dict__.pop(method, None)
        for module in self.modules:
            restore_device_report(module)
        if getattr(type(self.pipeline), "_offload_core_pipeline", False):
            self.pipeline.__class__ = type(self.pipeline).__bases__[0]


def attach_entries(empty: EmptyPipeline, execution_device: torch.device) -> _EntryPatches:
    """After dispatch: a component's ``encode``/``decode`` run its module hooks as ``forward`` does (pipelines call a
    VAE that way), each component reports the execution device, and the pipeline's call runs through its modules."""
    from offload_core.loading.model_device import report_execution_device
    from offload_core.module_hooks.base import call_with_module_hooks, module_hooks

    patched = []
    for name, module in empty.modules.named_children():
        report_execution_device(module, execution_device)
        if not module_hooks(module):
            continue
        for method in ENTRY_METHODS:
            original = getattr(module, method, None)
            if callable(original):
                wrapped = functools.partial(call_with_module_hooks, module, original)
                module.__dict__[method] = functools.update_wrapper(wrapped, original)
                patched.append((module, method))
    pipeline = empty.pipeline
    pipeline.__class__ = _routed_class(type(pipeline))
    pipeline.offload_modules = empty.modules
    pipeline.offload_state = empty.modules.offload_state
    pipeline.hf_device_map = empty.modules.hf_device_map
    return _EntryPatches(patched, list(empty.modules.children()), pipeline)
