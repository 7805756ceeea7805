"""The rates a hybrid split is solved from, measured on the dispatched model itself before its module hooks attach (the
door without a prior plan, ``from_pretrained(..., hybrid=True)``): one offloaded block copied from the store to the GPU,
and a decoding step of it computed on the GPU and on the host from the store's tensors."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping

import torch
from torch import nn

from offload_core import devices
from offload_core.module_hooks.units import Unit
from offload_core.planning.hybrid import Rates

CPU = torch.device("cpu")


def _median_s(fn: Callable[[], Any], sync: Callable[[], None], reps: int = 3) -> float:
    fn()  # kernels built for the shape, pages touched
    sync()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _step_inputs(model: nn.Module, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, dict]:
    """One position's random hidden states on ``device`` and, where the model has a rotary embedding, its cos/sin."""
    hidden = model.config.get_text_config().hidden_size
    x = torch.randn(1, 1, hidden, dtype=dtype, device=device)
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    if rotary is None:
        return x, {}
    on = next(iter(rotary.buffers()), None)
    at = on.device if on is not None and on.device.type != "meta" else device
    cos, sin = rotary(x.to(at), torch.zeros(1, 1, dtype=torch.long, device=at))
    return x, {"position_embeddings": (cos.to(device), sin.to(device))}


def measure_rates(
    model: nn.Module, unit: Unit, store: Mapping[str, torch.Tensor], device: torch.device, resident_blocks: int
) -> Rates:
    """The rates of ``unit`` (an offloaded block of ``model``, hooks not attached yet): copying it from ``store`` to
    ``device``, and a one-token step of it there and on the host (the GPU's time of the ``resident_blocks`` too)."""
    accelerator = devices.for_device(device)

    def sync() -> None:
        accelerator.synchronize(device)

    nbytes = unit.nbytes(store)
    dtype = next((store[k].dtype for k in unit.keys if store[k].is_floating_point()), torch.float32)
    with torch.inference_mode(False):
        copied: dict[str, torch.Tensor] = {}

        def copy() -> None:
            copied.update({key: store[key].to(device, non_blocking=True) for key in unit.keys})

        h2d_s = _median_s(copy, sync)
    with torch.no_grad():  # not inference mode: its tensors on an accelerator may not move (the fake one's)
        x, kwargs = _step_inputs(model, dtype, device)
        host_x, host_kwargs = x.to(CPU), {k: tuple(t.to(CPU) for t in v) for k, v in kwargs.items()}
        unit.load(store, device, None, fetched=copied)
        try:
            gpu_s = _median_s(lambda: unit.module(x, **kwargs), sync)
        finally:
            unit.release()
        copied.clear()
        unit.load(store, CPU, None, fetched={key: store[key] for key in unit.keys})
        try:
            host_s = _median_s(lambda: unit.module(host_x, **host_kwargs), lambda: None)
        finally:
            unit.release()
    return Rates(nbytes / h2d_s, nbytes / host_s, nbytes / gpu_s, resident_blocks * gpu_s)
