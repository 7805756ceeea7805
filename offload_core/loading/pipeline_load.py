"""A diffusers pipeline folder opened for one plan: its empty pipeline, its module components' weights as one
checkpoint, and the dispatched pipeline put back together."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from offload_core.loading.pipeline import EmptyPipeline, attach_entries, build_empty_pipeline, component_no_split


def open_pipeline(
    path: str | Path, dtype: torch.dtype | None, limit: int | None, no_split: list[str] | None = None
) -> tuple[EmptyPipeline, Any, list[str]]:
    """The empty pipeline, its components' weights as one checkpoint, and the no-split classes its plan uses
    (:func:`open_components`)."""
    empty = build_empty_pipeline(path, dtype)
    return (empty, *open_components(empty, path, limit, no_split))


def open_components(
    empty: EmptyPipeline, path: str | Path, limit: int | None, no_split: list[str] | None = None
) -> tuple[Any, list[str]]:
    """The components' weights of the pipeline folder ``path`` as one checkpoint, and the no-split classes its plan
    uses: ``no_split`` when given, else each component of at most ``limit`` bytes whole (:func:`component_no_split`)."""
    from offload_core.loading.pipeline_checkpoint import PipelineCheckpoint

    classes = list(no_split) if no_split else component_no_split(empty, limit, empty.dtype)
    checkpoint = PipelineCheckpoint.open_components(Path(path).expanduser(), list(empty.modules._modules))
    return checkpoint, classes


def finish_dispatch(empty: EmptyPipeline, device: torch.device) -> Any:
    """After the components are dispatched: their entries run the module hooks; the pipeline, ready, is returned."""
    entries = attach_entries(empty, device)
    empty.modules.offload_state.extra_handles.append(entries)
    return empty.pipeline
