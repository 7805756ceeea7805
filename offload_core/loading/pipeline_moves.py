"""What a pipeline run's plan predicts it moves: per denoising step (the denoiser's units) and per image (every
component once, the denoiser once per step), where a decoder's plan predicts per generated token."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn


def is_denoiser(component: str) -> bool:
    """Whether the pipeline calls ``component`` once per denoising step (not a text encoder, not the VAE)."""
    from offload_core.loading.pipeline import _call_order

    return _call_order(component) == 1


def predicted_pipeline_moves(
    modules: nn.Module,
    device_map: Mapping[str, int | str],
    policy: Any,
    execution_device: torch.device | str,
    dtype: Any,
    no_split_module_classes: list[str] | None,
    steps: int,
) -> tuple[int, int]:
    """(bytes brought in per denoising step, per call of the pipeline) for ``modules`` (the pipeline's components as
    children named by component) under ``device_map``, by the policy's own rule (``predict_moved``) as
    :func:`offload_core.plan.make.predicted_bytes_per_token` applies it to a decoder's forward: a call runs every
    component once and the denoiser ``steps`` times, so it moves one pass through every offloaded unit and
    ``steps - 1`` further passes through the denoiser's (``chained`` keeps a lone offloaded denoiser from step to
    step: nothing moves per step). The pass counts every offloaded unit the call runs once at least, as the first
    image moves it (``chained`` then keeps a lone offloaded unit for the next image)."""
    from offload_core.loading.moves import unit_reads
    from offload_core.loading.routes import route_tensors
    from offload_core.module_hooks.units import find_units
    from offload_core.planning import no_split_classes, normalize_device_map
    from offload_core.values import parse_dtype

    device = torch.device(execution_device)
    dtype = parse_dtype(dtype)
    tensors = route_tensors(modules, normalize_device_map(device_map), device)
    units = find_units(
        modules, tensors.offloaded, no_split_classes(modules, no_split_module_classes), policy.granularity
    )
    shares = policy.read_shares(modules)
    reads = [
        (unit.name.split(".")[0], unit_reads(unit, dtype, shares, False, {})) for unit in units if called(unit.name)
    ]
    denoiser = [size for component, size in reads if is_denoiser(component)]
    per_step = int(policy.predict_moved(denoiser)) if denoiser else 0
    every = [size for _, size in reads]
    return per_step, int(max(policy.predict_moved(every), sum(every))) + max(steps - 1, 0) * per_step


def called(unit: str) -> bool:
    """Whether text-to-image calls the unit named ``unit``: not the VAE's encoder (an image comes out of the
    decoder; only image-to-image encodes one)."""
    component, _, rest = unit.partition(".")
    return not (component in VAES and rest.split(".")[0] in ("encoder", "quant_conv"))


#: the components that turn latents into images
VAES = ("vae", "movq", "vqvae")
