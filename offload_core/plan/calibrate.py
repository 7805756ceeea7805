"""Machine calibration for time predictions: disk read bandwidth (cold and page-cached) per filesystem, pinned
host-to-device bandwidth, and compute time of one block and the output embedding of the model at hand per input shape;
cached in ``calibration.json``."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from offload_core import devices
from offload_core.atomic import fsync_path, write_text_atomic
from offload_core.plan.busy import busy_notice

PROBE_BYTES = 64 * 2**20
#: what :func:`disk_bandwidth` measures per filesystem (a cached entry without each is measured again)
DISK_KEYS = frozenset({"write_bps", "cold_read_bps", "warm_read_bps", "first_touch_bps", "copy_bps"})
CHUNK = 4 * 2**20
#: said before a calibration first measures anything (seconds: a block's compute, a dispatched probe, the disk), so the
#: pause before the plan is explained; once a process (``auto=true`` calibrates each configuration it ranks)
MEASURING = (
    "offload_core: calibrating the time prediction on this machine (a few seconds, once per model, configuration and "
    "prompt length)"
)
#: whether this process has said :data:`MEASURING`
told = False


def _measuring() -> None:
    global told
    if not told:
        told = True
        print(MEASURING, file=sys.stderr, flush=True)


def calibration_file() -> Path:
    """``$OFFLOAD_CORE_CALIBRATION``, else ``calibration.json`` beside the model cache (``$OFFLOAD_CORE_CACHE`` or
    ``~/.cache/offload_core``)."""
    env = os.environ.get("OFFLOAD_CORE_CALIBRATION")
    if env:
        return Path(env).expanduser()
    from offload_core.loading.sources import cache_root

    return cache_root() / "calibration.json"


def _numbers(value: Any) -> bool:
    """A JSON object of names to finite, positive numbers (one disk's bandwidths, one shape's compute times)."""
    return isinstance(value, dict) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf") for v in value.values()
    )


def calibration_problem(data: Any) -> str | None:
    """What is wrong with the shape of a read ``calibration.json`` (None when it has the shape :func:`calibrate`
    writes): ``disks``: device id -> bandwidths, ``h2d_bps``: device -> bytes/s, ``compute``: model key -> shape ->
    times."""
    if not isinstance(data, dict):
        return "it is not a JSON object"
    disks, h2d, compute = data.get("disks", {}), data.get("h2d_bps", {}), data.get("compute", {})
    if not isinstance(disks, dict) or not all(_numbers(v) for v in disks.values()):
        return "'disks' is not an object of bandwidths per filesystem"
    if not _numbers(h2d):
        return "'h2d_bps' is not an object of bandwidths per device"
    if not isinstance(compute, dict) or not all(
        isinstance(v, dict) and all(_numbers(t) for t in v.values()) for v in compute.values()
    ):
        return "'compute' is not an object of times per model and shape"
    probes = data.get("probe", {})
    if not isinstance(probes, dict) or not all(
        isinstance(v, dict)
        and all(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t < float("inf") for t in v.values())
        for v in probes.values()
    ):
        return "'probe' is not an object of times per configuration"
    return None


def _read_cached() -> dict[str, Any]:
    """The cached calibration; an unreadable file or one of another shape is measured again (and overwritten), with one
    line saying why."""
    file = calibration_file()
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        problem: str | None = f"it cannot be read as JSON ({exc})"
    else:
        problem = calibration_problem(data)
    if problem is None:
        return data
    print(f"offload_core: {file} is damaged ({problem}); measuring the machine again", file=sys.stderr)
    return {}


def _write_cached(data: dict[str, Any]) -> None:
    """Write the calibration whole or not at all (a crash or a second process never leaves half a file)."""
    write_text_atomic(calibration_file(), json.dumps(data, indent=1))


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
        copy, touch = _copy_once(path)
    finally:
        path.unlink(missing_ok=True)
    return {
        "copy_bps": PROBE_BYTES / copy,
        "write_bps": PROBE_BYTES / write,
        "cold_read_bps": PROBE_BYTES / cold,
        "warm_read_bps": PROBE_BYTES / warm,
        # where it cannot be measured (not cached after the copy), as fast as reading from the page cache
        "first_touch_bps": touch or PROBE_BYTES / warm,
    }


def _copy_once(path: Path) -> tuple[float, float | None]:
    """Seconds to copy ``path`` (in the page cache) to a new file beside it as an offload folder is written while a
    run loads: file to file in the kernel where it can, not flushed (the folder is flushed after loading, or never
    when it is temporary; SmolLM2's 0.4 GB offloaded loaded in 0.25-0.29 s where the flushed write rate said
    1.19 s); and the copy's first-touch rate (:mod:`offload_core.plan.first_touch`: a run computes on its
    offload folder's pages as the copy left them)."""
    from offload_core.plan.first_touch import file_pages
    from offload_core.storage.filecopy import FileSpan

    target = path.with_name(path.name + ".copy")
    started = time.perf_counter()
    try:
        with open(target, "wb") as out:
            FileSpan(path, 0, PROBE_BYTES).copy_to(out.fileno())
        seconds = time.perf_counter() - started
        return seconds, file_pages([target]).get("first_touch_bps")
    finally:
        target.unlink(missing_ok=True)


def h2d_bandwidth(device: torch.device) -> float:
    """Bytes/s copying pinned host memory to ``device`` (64 MiB, or a quarter of the device's free memory where
    that is less, at least 1 MiB; best of three)."""
    accelerator = devices.for_device(device)
    free, _ = accelerator.mem_get_info(device.index or 0)
    nbytes = max(2**20, min(PROBE_BYTES, free // 4 // 2**20 * 2**20))
    host = accelerator.pinned_arena(nbytes)
    try:
        target = torch.empty(nbytes, dtype=torch.uint8, device=device)
        best = float("inf")
        for _ in range(3):
            accelerator.synchronize(device)
            started = time.perf_counter()
            target.copy_(host, non_blocking=True)
            accelerator.synchronize(device)
            best = min(best, time.perf_counter() - started)
    finally:
        accelerator.free_arena(host)
    return nbytes / best


def first_block(model: nn.Module, no_split: list[str]) -> nn.Module | None:
    """The first module of a no-split class (a decoder layer): the unit the compute calibration times."""
    for module in model.modules():
        if type(module).__name__ in no_split:
            return module
    return None


def _sync(device: torch.device) -> None:
    devices.for_device(device).synchronize(device)


def _best_of(fn: Any, device: torch.device, reps: int = 5) -> float:
    """Seconds of ``fn()``'s median of ``reps`` calls, after one untimed call (which builds kernels for the shape): what
    a run sees on a busy machine, where the fastest call is an optimistic guess."""
    import statistics

    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


#: bytes of block copies the compute calibration cycles through at least (more than a CPU's last-level cache:
#: a run's blocks come from memory, not from the cache one block timed alone would stay in)
ROTATION_BYTES = 128 * 2**20
#: at most this many copies
ROTATION_COPIES = 8


def _materialized(module: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A copy of a meta ``module`` on ``device`` in ``dtype`` with small random weights (a quantized checkpoint's
    layers packed as they are run: :func:`~offload_core.loading.quantized.random_copy`)."""
    from offload_core.loading.quantized import random_copy

    return random_copy(module, dtype, device)


#: rows the output embedding is timed with at most (the time of more rows is scaled), one position each (generation
#: computes the logits of the last position only): timed on a strided slice of the prompt's positions, a bfloat16
#: head with random weights took 150 ms where the model's own took 2.4 ms, and the first token was predicted 1.9x
HEAD_ROWS = 8


def block_seconds(
    model: nn.Module, blocks: list[nn.Module], dtype: torch.dtype, device: torch.device, rows: int, tokens: int
) -> float:
    """Seconds each of ``blocks`` (of ``model``, cycled through in turn) takes on ``device`` over ``rows`` sequences of
    ``tokens`` random hidden states, the positions from the model's rotary embedding when it has one."""
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    if rotary is not None:
        with torch.device(device):
            rotary = type(rotary)(model.config)
    hidden = model.config.get_text_config().hidden_size
    with torch.inference_mode():
        x = torch.randn(rows, tokens, hidden, dtype=dtype, device=device)
        kwargs: dict[str, Any] = {}
        if rotary is not None:
            kwargs["position_embeddings"] = rotary(x, torch.arange(tokens, device=device)[None])
        return _best_of(lambda: [b(x, **kwargs) for b in blocks], device) / len(blocks)


def compute_times(
    model: nn.Module, no_split: list[str], dtype: torch.dtype, device: torch.device, rows: int, tokens: int
) -> dict[str, float]:
    """Seconds one block of ``model`` (copies with random weights, cycled through as a run's blocks are) takes on
    ``device`` over ``rows`` sequences of ``tokens`` tokens (``block_s``), and the output embedding over the last
    position of each row (``head_s``); the model's rotary embedding gives the
    positions when it has one."""
    meta_block = first_block(model, no_split)
    if meta_block is None:
        return {}
    block = _materialized(meta_block, dtype, device)
    size = sum(p.numel() * p.element_size() for p in block.parameters()) or 1
    blocks = [block] + [
        _materialized(meta_block, dtype, device) for _ in range(min(ROTATION_COPIES, ROTATION_BYTES // size) - 1)
    ]
    hidden = model.config.get_text_config().hidden_size
    times: dict[str, float] = {"block_s": block_seconds(model, blocks, dtype, device, rows, tokens)}
    with torch.inference_mode():
        del block, blocks
        meta_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if isinstance(meta_head, nn.Linear):
            head = _materialized(meta_head, dtype, device)
            timed = min(rows, HEAD_ROWS)
            last = torch.randn(timed, 1, hidden, dtype=dtype, device=device)
            times["head_s"] = _best_of(lambda: head(last), device) * rows / timed
    return times


#: config entries that name where a model came from, not what it computes: left out of the compute key, so a GGUF
#: file read in place and the float32 files converted from it (the same blocks, computed in the same dtype) share one
#: timing (each timed apart, the noise of two measurements ranked one store against the other: SmolLM2's GGUF had its
#: prompt's blocks timed 2.6x the converted files' on one calibration)
#: (``architectures`` too: a GGUF file's header names none; the model's own class stands for it in the key)
PROVENANCE = ("_name_or_path", "_commit_hash", "transformers_version", "architectures")


def _model_key(model: nn.Module, dtype: torch.dtype, device: torch.device) -> str:
    """The compute calibration's key: what the model computes (its class, its config less :data:`PROVENANCE`), in
    which dtype, on which device, with how many threads."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in PROVENANCE}
    text = json.dumps({"class": type(model).__name__, **config}, sort_keys=True, default=str)
    return hashlib.sha256(f"compute-v5|{text}|{dtype}|{device}|{torch.get_num_threads()}".encode()).hexdigest()[:16]


def _probe(measure: Callable[[], dict[str, float]]) -> dict[str, float]:
    """The dispatched probe's terms, or none (and one line saying why) where it cannot run."""
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 - any architecture, store or policy: the term is left out, the run goes on
        print(
            f"  the dispatched probe could not run ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})"
        )
        return {}


def existing_folder(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists as a folder (probes never create the folders they measure)."""
    path = path.expanduser().absolute()
    while not path.is_dir():
        path = path.parent
    return path


def calibrate(
    model: nn.Module,
    no_split: list[str],
    dtype: torch.dtype,
    device: torch.device,
    folders: dict[str, Path],
    shapes: dict[str, tuple[int, int]],
    refresh: bool = False,
    probe: tuple[str, Callable[[], dict[str, float]]] | None = None,
) -> dict[str, Any]:
    """The calibration for this machine and model: per ``folders`` entry (``offload_folder``, ``checkpoint``) its
    filesystem's bandwidths, ``h2d_bps`` on a GPU run, and per named ``(rows, tokens)`` shape in ``shapes`` the
    :func:`compute_times` under ``compute``; with ``probe`` (a key naming the store, the policy and the shape, and
    the function that measures them: :mod:`offload_core.plan.probe`)
    its terms under ``probe`` (empty where it could not run, said in one line). Each is measured once and cached
    (``refresh`` measures again)."""
    data = _read_cached()
    changed = False
    disks = data.setdefault("disks", {})
    found: dict[str, Any] = {}
    for role, folder in folders.items():
        target = existing_folder(folder)
        if not os.access(target, os.W_OK) or os.statvfs(target).f_flag & os.ST_RDONLY:
            target = existing_folder(Path(tempfile.gettempdir()))  # the run reports the folder itself; probe beside it
        key = str(os.stat(target).st_dev)
        if refresh or not DISK_KEYS <= disks.get(key, {}).keys():
            _measuring()
            disks[key] = disk_bandwidth(target)
            changed = True
        found[role] = disks[key]
    if devices.is_accelerator(device):
        gpus = data.setdefault("h2d_bps", {})
        if refresh or str(device) not in gpus:
            _measuring()
            gpus[str(device)] = h2d_bandwidth(device)
            changed = True
        found["h2d_bps"] = gpus[str(device)]
    timed = data.setdefault("compute", {}).setdefault(_model_key(model, dtype, device), {})
    found["compute"] = {}
    for name, (rows, tokens) in shapes.items():
        key = f"{rows}x{tokens}"
        if refresh or not timed.get(key):  # one that could not be timed is tried again: it was not kept
            _measuring()
            try:
                timed[key] = compute_times(model, no_split, dtype, device, rows, tokens)
                changed = True
            except (TypeError, ValueError, RuntimeError) as exc:  # a block whose forward wants more than hidden states
                timed.pop(key, None)
                print(
                    f"  no time prediction: a block of this model could not be timed ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''})"
                )
        found["compute"][name] = timed.get(key, {})
    if probe is not None:
        probes = data.setdefault("probe", {})
        key = f"{_model_key(model, dtype, device)}|{probe[0]}"
        if refresh or key not in probes:
            _measuring()
            probes[key] = _probe(probe[1])
            changed = found["probed_here"] = True
        found["probe"] = probes[key]
        if not probes[key]:
            print(
                "  no dispatched probe for this store and policy (it could not run when calibrated; calibrate=true "
                "tries again): the prediction leaves out the per-tensor and outside-the-blocks costs"
            )
    if changed and busy_notice() is None:  # measured on a busy machine: used for this run only, a quieter one measures
        _write_cached(data)
    return found
