"""Machine calibration for time predictions: disk read bandwidth (cold and page-cached) per filesystem, pinned
host-to-device bandwidth, and compute time of one block of the model at hand; cached in ``calibration.json``."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload_core.atomic import fsync_path

PROBE_BYTES = 64 * 2**20
CHUNK = 4 * 2**20


def calibration_file() -> Path:
    """``calibration.json`` beside the model cache (``$OFFLOAD_CORE_CACHE`` or ``~/.cache/offload_core``)."""
    from offload_core.loading.sources import cache_root

    return cache_root() / "calibration.json"


def _read_cached() -> dict[str, Any]:
    try:
        data = json.loads(calibration_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cached(data: dict[str, Any]) -> None:
    file = calibration_file()
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, file)


def _read_all(path: Path) -> float:
    """Seconds to read ``path`` sequentially in large chunks."""
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK)
        while f.readinto(buf):
            pass
    return time.perf_counter() - started


def disk_bandwidth(folder: Path) -> dict[str, float]:
    """Bytes/s writing (with fsync), reading cold (pages dropped with ``posix_fadvise``) and reading from the page
    cache, for a probe file of 64 MiB written and removed in ``folder``."""
    fd, name = tempfile.mkstemp(prefix=".calibrate-", dir=folder)
    path = Path(name)
    try:
        block = os.urandom(CHUNK)
        started = time.perf_counter()
        with os.fdopen(fd, "wb") as f:
            for _ in range(PROBE_BYTES // CHUNK):
                f.write(block)
        fsync_path(path)
        write = time.perf_counter() - started
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        cold = _read_all(path)
        warm = min(_read_all(path) for _ in range(2))
    finally:
        path.unlink(missing_ok=True)
    return {"write_bps": PROBE_BYTES / write, "cold_read_bps": PROBE_BYTES / cold, "warm_read_bps": PROBE_BYTES / warm}


def h2d_bandwidth(device: torch.device) -> float:
    """Bytes/s copying pinned host memory to ``device`` (64 MiB, best of three)."""
    host = torch.empty(PROBE_BYTES, dtype=torch.uint8).pin_memory()
    target = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        target.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return PROBE_BYTES / best


def _first_block(model: nn.Module, no_split: list[str]) -> nn.Module | None:
    for module in model.modules():
        if type(module).__name__ in no_split:
            return module
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def block_compute(model: nn.Module, no_split: list[str], dtype: torch.dtype, device: torch.device) -> dict[str, float]:
    """Seconds one block of ``model`` (a copy with random weights) takes on ``device`` for 1 and for 64 tokens,
    and the block's parameter count; the model's rotary embedding gives the positions when it has one."""
    meta_block = _first_block(model, no_split)
    if meta_block is None:
        return {}
    block = copy.deepcopy(meta_block).to_empty(device=device).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    if rotary is not None:
        with torch.device(device):
            rotary = type(rotary)(model.config)
    hidden = model.config.get_text_config().hidden_size
    times = {}
    with torch.inference_mode():
        for tokens in (1, 64):
            x = torch.randn(1, tokens, hidden, dtype=dtype, device=device)
            kwargs: dict[str, Any] = {}
            if rotary is not None:
                kwargs["position_embeddings"] = rotary(x, torch.arange(tokens, device=device)[None])
            for _ in range(2):
                block(x, **kwargs)
            _sync(device)
            best = float("inf")
            for _ in range(5):
                started = time.perf_counter()
                block(x, **kwargs)
                _sync(device)
                best = min(best, time.perf_counter() - started)
            times[f"t{tokens}_s"] = best
    return {**times, "params": sum(p.numel() for p in block.parameters())}


def _model_key(model: nn.Module, dtype: torch.dtype, device: torch.device) -> str:
    text = json.dumps(model.config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(f"block-v2|{text}|{dtype}|{device}|{torch.get_num_threads()}".encode()).hexdigest()[:16]


def existing_folder(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists as a folder (probes never create the folders they measure)."""
    path = path.expanduser().absolute()
    while not path.is_dir():
        path = path.parent
    return path


def calibrate(model: nn.Module, no_split: list[str], dtype: torch.dtype, device: torch.device,
              folders: dict[str, Path], refresh: bool = False) -> dict[str, Any]:
    """The calibration for this machine and model: per ``folders`` entry (``offload_folder``, ``checkpoint``) its
    filesystem's bandwidths, ``h2d_bps`` on a GPU run and ``block`` timings; measured once and cached."""
    data = _read_cached()
    changed = False
    disks = data.setdefault("disks", {})
    found: dict[str, Any] = {}
    for role, folder in folders.items():
        target = existing_folder(folder)
        if not os.access(target, os.W_OK) or os.statvfs(target).f_flag & os.ST_RDONLY:
            target = existing_folder(Path(tempfile.gettempdir()))  # the run reports the folder itself; probe beside it
        key = str(os.stat(target).st_dev)
        if refresh or key not in disks:
            disks[key] = disk_bandwidth(target)
            changed = True
        found[role] = disks[key]
    if device.type == "cuda":
        gpus = data.setdefault("h2d_bps", {})
        if refresh or str(device) not in gpus:
            gpus[str(device)] = h2d_bandwidth(device)
            changed = True
        found["h2d_bps"] = gpus[str(device)]
    blocks = data.setdefault("blocks", {})
    key = _model_key(model, dtype, device)
    if refresh or key not in blocks:
        try:
            blocks[key] = block_compute(model, no_split, dtype, device)
        except (TypeError, ValueError, RuntimeError):  # a block whose forward wants more than hidden states and positions
            blocks[key] = {}
        changed = True
    found["block"] = blocks[key]
    if changed:
        _write_cached(data)
    return found
