"""Time predicted from the plan and the machine's calibration: load time, time to first token and time per decoding
step for the chosen placement, store, policy and batch."""

from __future__ import annotations

from typing import Any

from pathlib import Path

import psutil
import torch
from torch import nn

from offload_core import devices
from offload_core.values import is_offloaded


def count_blocks(model: nn.Module, no_split: list[str]) -> int:
    """How many blocks of the calibrated kind (the first no-split module's class) a forward runs."""
    from offload_core.plan.calibrate import first_block

    block = first_block(model, no_split)
    return 0 if block is None else sum(type(m) is type(block) for m in model.modules())


def fits_page_cache(nbytes: int) -> bool:
    """Whether ``nbytes`` of files stay in the page cache: they fit in half the available memory."""
    return nbytes < psutil.virtual_memory().available / 2


def disk_bytes_per_forward(
    page_cache: dict[str, Any], offloaded: int, bytes_per_token: int, reads_from: str, cold: bool = False
) -> int:
    """Bytes one forward reads from the disk itself: every byte moved when ``cold`` (the page cache dropped before
    each token); else the page-cache plan's streamed bytes where it keeps a set; otherwise none while the offloaded
    files fit in the page cache, every byte moved when they do not."""
    if reads_from == "memory":
        return 0
    if cold:
        return bytes_per_token
    if "predicted_disk_bytes_per_token" in page_cache:
        return int(page_cache["predicted_disk_bytes_per_token"])
    return 0 if fits_page_cache(offloaded) else bytes_per_token


def io_s(
    calibration: dict[str, Any],
    bytes_per_token: int,
    disk_bytes: int,
    reads_from: str,
    pinned: bool,
    execution_device: torch.device,
) -> float:
    """Seconds one forward spends bringing offloaded tensors to the execution device: ``disk_bytes`` at the store's
    cold read rate, and on a GPU every moved byte across the host-to-device copy (from page-cached pages first unless
    the store is pinned). On a CPU run a page-cached tensor is computed on where it lies: no copy."""
    seconds = 0.0
    if disk_bytes and reads_from != "memory":
        disk = calibration["checkpoint" if reads_from == "checkpoint" else "offload_folder"]
        seconds += disk_bytes / disk["cold_read_bps"]
    if devices.is_accelerator(execution_device) and bytes_per_token:
        seconds += bytes_per_token / calibration["h2d_bps"]
        if reads_from != "memory" and not pinned:
            disk = calibration["checkpoint" if reads_from == "checkpoint" else "offload_folder"]
            seconds += bytes_per_token / disk["warm_read_bps"]
    return seconds


def first_touch_s(
    calibration: dict[str, Any], bytes_per_token: int, reads_from: str, execution_device: torch.device
) -> float:
    """Seconds the first forward of a CPU run pays, once, to map the offloaded weights it computes on where they lie:
    their residency asked and a page fault per window, at ``first_touch_bps`` (:mod:`.first_touch`: measured on the
    checkpoint's own pages for a store reading it in place); later forwards find them mapped. None on
    a GPU (its copies read them) or for a store holding them in memory. (The dispatched probe's first offloaded
    generation is no measure of it: that is mostly the policy's one-time setup, which does not grow with the bytes;
    scaled by them, it predicted functional_call's first token 6x.)"""
    if reads_from == "memory" or devices.is_accelerator(execution_device) or not bytes_per_token:
        return 0.0
    rate = calibration.get("checkpoint" if reads_from == "checkpoint" else "offload_folder", {}).get("first_touch_bps")
    return bytes_per_token / rate if rate else 0.0


def load_s(calibration: dict[str, Any], total: int, offloaded: int, reads_from: str) -> float:
    """Seconds to load: the bytes read from the checkpoint (the page-cached share of them at its rate, the rest at
    the disk's), the resident part copied again into memory, and a store that writes an offload folder writing the
    offloaded part. A store reading the checkpoint in place reads only the resident part at load (its offloaded
    part is read as it runs: SmolLM2 loaded in 0.068 s from a cold checkpoint, where reading all of it says 0.26 s)."""
    ckpt = calibration["checkpoint"]
    share = ckpt.get("cached_share", 1.0 if fits_page_cache(total) else 0.0)  # measured where it could be
    read = total - offloaded if reads_from == "checkpoint" else total
    seconds = read * (share / ckpt["warm_read_bps"] + (1 - share) / ckpt["cold_read_bps"])
    seconds += (total - offloaded) / ckpt["warm_read_bps"]
    if reads_from == "offload_folder":  # written unflushed while loading (copied file to file where it can)
        folder = calibration["offload_folder"]
        seconds += offloaded / folder.get("copy_bps", folder["write_bps"])
    return seconds


def predict_time(
    blocks: int,
    plan: Any,
    storage: Any,
    policy: Any,
    execution_device: torch.device,
    calibration: dict[str, Any],
    cold: bool = False,
    dequant_s: float = 0.0,
) -> dict[str, float]:
    """``predicted_load_s``, ``predicted_ttft_s`` and ``predicted_step_s`` of a run whose forwards were calibrated
    as ``prefill`` (the batch's rows over its prompt) and ``decode`` (one token per row).

    A forward costs ``blocks`` times the calibrated block, the output embedding, and, from the dispatched probe
    (:mod:`offload_core.plan.probe`) where it ran: what lies outside the blocks (embedding, norms, the generate
    loop) and a fixed cost per offloaded tensor the policy brings in (its hooks, the store's read path, the reader's
    overlap: ``plan.predicted_loads_per_token`` of them); the first token adds what a process's first generation
    pays once (unless the probe ran in this process: it paid it) and the first touch of the weights it reads through
    a mapping (:func:`first_touch_s`), the load a fixed cost per tensor. Then the plan's
    reads from the disk itself (:func:`io_s`; on a GPU without a probe, the host-to-device copy too), overlapped (the
    larger of the two) for a policy that ``overlaps_io``. ``dequant_s``: the seconds a forward spends dequantizing
    what a store reading a GGUF file in place brings in (:mod:`.dequant`): the host's cores do it, so on a CPU run it
    adds to the compute; on a GPU an overlapping policy does it while the device computes, beside the reads.
    Empty when no block could be timed."""
    compute = calibration.get("compute") or {}
    if any("block_s" not in compute.get(name, {}) for name in ("prefill", "decode")):
        return {}
    probe = calibration.get("probe") or {}
    accelerated = devices.is_accelerator(execution_device)
    placed = plan.summary["devices"]
    total = sum(info["bytes"] for info in placed.values())
    offloaded = sum(info["bytes"] for dev, info in placed.items() if is_offloaded(dev, execution_device))
    moved = plan.predicted_bytes_per_token
    disk = disk_bytes_per_forward(plan.page_cache, offloaded, moved, storage.reads_from, cold)
    # the probe's tensors came through the real path (a GPU's copy included): only the cold disk reads are left
    io = io_s(
        calibration, moved, disk, storage.reads_from, storage.pinned, torch.device("cpu") if probe else execution_device
    )
    loads = plan.predicted_loads_per_token

    def forward(shape: str) -> float:
        times = compute[shape]
        work = blocks * times["block_s"] + times.get("head_s", 0.0)
        if probe:
            work += probe[f"outside_{shape}_s"] + loads * probe[f"per_load_{shape}_s"]
        if accelerated and policy.overlaps_io:
            return max(work, io + dequant_s)
        work += dequant_s
        return max(work, io) if policy.overlaps_io else work + io

    first_call = 0.0 if calibration.get("probed_here") else probe.get("first_call_s", 0.0)
    first_touch = first_touch_s(calibration, moved, storage.reads_from, execution_device)
    if storage.reads_from == "checkpoint":  # what of it is not in the page cache the first token reads from the disk
        ckpt = calibration["checkpoint"]
        first_touch += moved * (1 - ckpt.get("cached_share", 1.0)) / ckpt["cold_read_bps"]
    load = load_s(calibration, total, offloaded, storage.reads_from)
    if probe.get("probe_tensors"):  # loading's fixed cost per tensor, beyond the probe's own bytes
        written = {**calibration, "checkpoint": {**calibration["checkpoint"], "cached_share": 1.0}}  # just written
        bytes_s = load_s(written, probe["probe_bytes"], probe["probe_offloaded_bytes"], storage.reads_from)
        tensors = sum(info.get("tensors", 0) for info in placed.values())
        load += tensors * max(probe["probe_load_s"] - bytes_s, 0.0) / probe["probe_tensors"]
    return {
        "predicted_load_s": load,
        "predicted_ttft_s": forward("prefill") + first_call + first_touch,
        "predicted_step_s": forward("decode"),
        "predicted_first_call_s": first_call,
        "predicted_first_touch_s": first_touch,
        "predicted_io_s": io,
        "predicted_dequant_s": dequant_s,
    }


def calibrate_and_predict(
    settings: Any, strategies: Any, run_model: Any, plan: Any, rows: int, prompt_tokens: int, cold: bool = False
) -> dict[str, float]:
    """Calibrate (cached; ``calibrate=true`` measures again) and predict the run's times from its plan, for ``rows``
    sequences of ``prompt_tokens`` tokens generated at once (``cold``: see :func:`disk_bytes_per_forward`)."""
    import tempfile

    from offload_core.loading.hub import probe_folder
    from offload_core.plan.calibrate import calibrate

    folders = {
        "offload_folder": Path(settings.offload_folder or tempfile.gettempdir()),
        "checkpoint": probe_folder(run_model.checkpoint_dir),
    }
    shapes = {"prefill": (rows, prompt_tokens), "decode": (rows, 1)}
    refresh = settings.calibrate
    try:
        calibration = calibrate(
            run_model.model,
            run_model.no_split,
            run_model.dtype,
            settings.execution_device,
            folders,
            shapes,
            refresh=refresh,
            probe=dispatched_probe(settings, run_model, rows, prompt_tokens),
        )
    except OSError as exc:  # a probe that cannot be written (a full disk): the run goes on without a prediction
        print(f"  no time prediction: calibration failed ({exc.strerror or exc})")
        return {}
    calibration = with_checkpoint_pages(calibration, run_model.checkpoint_dir)
    return predict_time(
        count_blocks(run_model.model, run_model.no_split),
        plan,
        strategies.storage,
        strategies.policy,
        settings.execution_device,
        calibration,
        cold,
        plan_dequant_s(plan, strategies.policy, settings.execution_device, refresh),
    )


def plan_dequant_s(plan: Any, policy: Any, execution_device: torch.device, refresh: bool = False) -> float:
    """Seconds per forward dequantizing what the plan reads from a GGUF file in place (0 for other stores), at this
    machine's rates (:mod:`.dequant`); each of ``plan.dequant``'s rows gets its ``predicted_s``. A policy that
    overlaps its reads fills the buffers it holds on a CPU run (``hook=prefetch``); the others read through the
    store's own pool of buffers (:mod:`offload_core.storage.gguf.buffers`): no allocation per read either. On a GPU a
    policy that ``decodes_on_device`` dequantizes the blocks there (rows marked ``on_device``: no host
    time)."""
    from offload_core.plan.dequant import dequant_rates, dequant_seconds

    device = devices.is_accelerator(execution_device) and policy.decodes_on_device
    for row in plan.dequant:  # on a GPU the blocks that can cross as they are are dequantized there
        row["on_device"] = device and row["device"]
    rows = [row for row in plan.dequant if not row["on_device"]]
    if not rows:
        return 0.0
    rates = dequant_rates({row["type"] for row in rows}, refresh)
    return dequant_seconds(rows, rates, True)


def with_checkpoint_pages(calibration: dict[str, Any], checkpoint_dir: Path) -> dict[str, Any]:
    """``calibration`` with what the checkpoint's pages are now, where it can be told: ``first_touch_bps``, the rate
    its cached pages map at (how they came into the page cache decides it), and ``cached_share``, the share of its
    bytes in the page cache (a checkpoint read after a reboot comes from the disk, and its first token with it)."""
    from offload_core.plan.first_touch import file_pages

    found = file_pages(sorted(Path(checkpoint_dir).glob("*.safetensors")))
    if not found:
        return calibration
    return {**calibration, "checkpoint": {**calibration["checkpoint"], **found}}


def dispatched_probe(settings: Any, run_model: Any, rows: int, tokens: int) -> tuple[str, Any]:
    """The probe of the run's store and policy (built afresh from their sections) at its batch shape: its cache key
    and the function measuring it (:func:`offload_core.plan.probe.probe_times`)."""
    import json
    import os
    import tempfile

    from offload_core.loading.hub import probe_folder
    from offload_core.registry.manager import get_registry
    from offload_core.plan.calibrate import existing_folder
    from offload_core.plan.probe import PROBE_VERSION, probe_times

    storage, hook = probed_storage(settings.sections["storage"]), settings.sections["hook"]
    key = json.dumps(
        {"v": PROBE_VERSION, "storage": storage, "hook": hook, "shape": [rows, tokens]}, sort_keys=True, default=str
    )
    folder = existing_folder(probe_folder(run_model.checkpoint_dir))
    if not os.access(folder, os.W_OK):
        folder = existing_folder(Path(tempfile.gettempdir()))

    def measure() -> dict[str, float]:
        registry = get_registry()
        return probe_times(
            run_model,
            registry.create("storage", storage["name"], storage),
            registry.create("policy", hook["name"], hook),
            settings.execution_device,
            rows,
            tokens,
            folder,
        )

    return key, measure


#: the store a dispatched probe of a store reading GGUF files in place runs through
GGUF_PROBED = {"name": "safetensors"}


def probed_storage(section: dict[str, Any]) -> dict[str, Any]:
    """The storage section the dispatched probe runs (and is cached under): the run's own, but a store reading GGUF
    files in place is probed as ``storage=safetensors`` (the probe's model is no GGUF file: its tensors are read in
    place as the file's would be, the dequantization priced apart, :mod:`.dequant`). Cached under the store probed,
    the GGUF configurations share the converted files' probe of the same policy: one measurement, not two whose
    noise would rank one store against the other."""
    from offload_core.registry.manager import get_registry

    if get_registry().get("storage", section["name"]).factory.reads_gguf:
        return dict(GGUF_PROBED)
    return section


def print_prediction(predicted: dict[str, float], rows: int) -> None:
    """One line: the predicted load time, time to first token and decoding rate."""
    if predicted:
        step, runs = predicted["predicted_step_s"], predicted.get("prediction_runs", 0)
        learned = f" (corrected by {runs} earlier run{'s' if runs != 1 else ''} on this machine)" if runs else ""
        print(
            f"predicted: load {predicted['predicted_load_s']:.2f} s | "
            f"first token {predicted['predicted_ttft_s']:.3f} s | "
            f"{step:.3f} s per decoding step ({rows / step:.1f} tok/s at batch {rows}){learned}"
        )
