"""Time predicted from the plan and the machine's calibration: load time, time to first token and time per decoding
step for the chosen placement, store, policy and batch."""

from __future__ import annotations

from typing import Any

import psutil
import torch
from torch import nn

from offload_core.values import is_offloaded


def _linear_params(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def compute_s(block: dict[str, float], scale: float, tokens: int) -> float:
    """Seconds of one forward over ``tokens`` tokens: the block's time along the line through its 1- and 64-token
    measurements (never falling with more tokens: a noisy pair gives a flat line), times ``scale`` (the model's
    linear parameters over the block's)."""
    t1, t64 = block["t1_s"], block["t64_s"]
    return scale * (t1 + max(t64 - t1, 0.0) * (tokens - 1) / 63)


def fits_page_cache(nbytes: int) -> bool:
    """Whether ``nbytes`` of files stay in the page cache: they fit in half the available memory."""
    return nbytes < psutil.virtual_memory().available / 2


def read_bps(calibration: dict[str, Any], reads_from: str, cached: bool, execution_device: torch.device) -> float:
    """Bytes/s at which offloaded tensors reach the execution device: the store's disk (from the page cache when
    ``cached``, cold otherwise), then the host-to-device copy on a GPU."""
    rates = []
    if reads_from != "memory":
        disk = calibration["checkpoint" if reads_from == "checkpoint" else "offload_folder"]
        rates.append(disk["warm_read_bps" if cached else "cold_read_bps"])
    if execution_device.type == "cuda":
        rates.append(calibration["h2d_bps"])
    if not rates:
        return float("inf")
    return 1 / sum(1 / r for r in rates)


def predict_time(model: nn.Module, summary: dict, bytes_per_token: int, storage: Any, policy: Any,
                 execution_device: torch.device, calibration: dict[str, Any], rows: int, prompt_tokens: int,
                 page_cache: bool | None = None) -> dict[str, float]:
    """``predicted_load_s``, ``predicted_ttft_s`` and ``predicted_step_s`` (one decoding step for ``rows`` sequences
    of ``prompt_tokens``). Counted: reading the checkpoint (and writing a store's offload folder) at load; per
    forward the compute of every linear layer (scaled from the calibrated block) plus the plan's bytes moved per
    token at the store's read rate, overlapped (the larger of the two) for a policy that ``overlaps_io``. Not
    counted: attention over a long cache, module-hook overheads. ``page_cache`` says whether offloaded reads hit the
    page cache (default: when the offloaded bytes fit in it). Empty when the block could not be timed."""
    block = calibration.get("block") or {}
    if "t1_s" not in block:
        return {}
    scale = _linear_params(model) / max(block["params"], 1)
    devices = summary["devices"]
    total = sum(info["bytes"] for info in devices.values())
    offloaded = sum(info["bytes"] for dev, info in devices.items() if is_offloaded(dev, execution_device))
    ckpt = calibration["checkpoint"]
    load = total / ckpt["warm_read_bps" if fits_page_cache(total) else "cold_read_bps"]
    if storage.reads_from == "offload_folder":
        load += offloaded / calibration["offload_folder"]["write_bps"]
    cached = fits_page_cache(offloaded) if page_cache is None else page_cache
    io = bytes_per_token / read_bps(calibration, storage.reads_from, cached, execution_device)

    def forward(tokens: int) -> float:
        work = compute_s(block, scale, tokens)
        return max(work, io) if policy.overlaps_io else work + io

    return {"predicted_load_s": load, "predicted_ttft_s": forward(rows * prompt_tokens), "predicted_step_s": forward(rows)}


def calibrate_and_predict(settings: Any, strategies: Any, run_model: Any, plan: Any, rows: int, prompt_tokens: int,
                          page_cache: bool | None = None) -> dict[str, float]:
    """Calibrate (cached; ``calibrate=true`` measures again) and predict the run's times from its plan."""
    import tempfile
    from pathlib import Path

    from offload_core.runner.calibrate import calibrate

    cfg = settings.cfg
    folders = {"offload_folder": Path(cfg.offload_folder or tempfile.gettempdir()), "checkpoint": run_model.checkpoint_dir.parent}
    try:
        calibration = calibrate(run_model.model, run_model.no_split, run_model.dtype, settings.execution_device, folders,
                                refresh=bool(cfg.get("calibrate", False)))
    except OSError as exc:  # a probe that cannot be written (a full disk): the run goes on without a prediction
        print(f"  no time prediction: calibration failed ({exc.strerror or exc})")
        return {}
    return predict_time(run_model.model, plan.summary, plan.predicted_bytes_per_token, strategies.storage, strategies.policy,
                        settings.execution_device, calibration, rows, prompt_tokens, page_cache)


def print_prediction(predicted: dict[str, float], rows: int) -> None:
    """One line: the predicted load time, time to first token and decoding rate."""
    if predicted:
        step = predicted["predicted_step_s"]
        print(f"predicted: load {predicted['predicted_load_s']:.2f} s | first token {predicted['predicted_ttft_s']:.3f} s | "
              f"{step:.3f} s per decoding step ({rows / step:.1f} tok/s at batch {rows})")
