"""Learning from the run: every run's predicted times against what it measured, and a correction per machine and
configuration kept in ``corrections.json`` beside the model cache, so that the next run of the same configuration
predicts what this machine really does.

A correction is the median of the last :data:`KEPT` ratios measured / predicted by the cost model (load, first token,
decoding step), per configuration: the model's shape and dtype, the device and threads, placement, store, policy and
their options, the budgets, ``page_cache``, the batch's shape and ``max_new_tokens``. The file is validated on read: a
damaged one, or one written on another machine, is ignored with one line and made again. A run on a busy machine
(:func:`offload_core.plan.busy.busy`) is compared but not learned from, and a line says so once."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from offload_core.atomic import write_text_atomic
from offload_core.plan.busy import busy_notice

VERSION = 1
#: ratios kept per configuration and figure (the correction is their median)
KEPT = 5
#: configurations kept in the file (the least recently updated go first)
MAX_ENTRIES = 500
#: the figures corrected: name -> (predicted key, measured key)
FIGURES = {
    "load": ("predicted_load_s", "load_s"),
    "ttft": ("predicted_ttft_s", "time_to_first_token_s"),
    "step": ("predicted_step_s", "time_per_decode_step_s"),
}
#: ratios outside these bounds are not a measurement of the configuration (a stalled machine): never kept
RATIO_BOUNDS = (1e-3, 1e3)


def corrections_file() -> Path:
    """``$OFFLOAD_CORE_CORRECTIONS``, else ``corrections.json`` beside the model cache."""
    env = os.environ.get("OFFLOAD_CORE_CORRECTIONS")
    if env:
        return Path(env).expanduser()
    from offload_core.loading.sources import cache_root

    return cache_root() / "corrections.json"


def machine() -> str:
    """This machine, as the file records it (a copied file from another machine is not trusted)."""
    return f"{platform.node()}|{platform.machine()}|{os.cpu_count()}"


def _ratio(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and RATIO_BOUNDS[0] <= value <= RATIO_BOUNDS[1]
    )


def problem(data: Any) -> str | None:
    """What is wrong with a read corrections file (None: it has the shape :func:`record` writes, for this machine)."""
    if not isinstance(data, dict) or data.get("version") != VERSION:
        return f"it is not a version-{VERSION} corrections object"
    if data.get("machine") != machine():
        return "it was written on another machine"
    entries = data.get("entries")
    if not isinstance(entries, dict):
        return "'entries' is not an object"
    for key, entry in entries.items():
        ratios = entry.get("ratios") if isinstance(entry, dict) else None
        if (
            not isinstance(ratios, dict)
            or not set(ratios) <= set(FIGURES)
            or not isinstance(entry.get("updated"), (int, float))
            or not all(isinstance(v, list) and 0 < len(v) <= KEPT and all(map(_ratio, v)) for v in ratios.values())
        ):
            return f"entry {key!r} is not a set of measured/predicted ratios"
    return None


def read() -> dict[str, Any]:
    """The corrections of this machine; a damaged or foreign file is ignored with one line (and remade by the next
    :func:`record`), never trusted."""
    file = corrections_file()
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        found: str | None = f"it cannot be read as JSON ({exc})"
    else:
        found = problem(data)
    if found is None:
        return data["entries"]
    print(f"offload_core: ignoring {file} ({found}); predictions start again from the cost model", file=sys.stderr)
    return {}


def config_key(job: Any) -> tuple[str, str]:
    """The key of ``job``'s configuration (a :class:`offload_core.plan.prepare.Prepared`) and a short label."""
    settings, strategies = job.settings, job.strategies
    rows, tokens = job.shape
    sections = {group: settings.sections[group] for group in ("placement", "storage", "hook")}
    parts = {
        "model": job.run_model.model.config.to_dict(),
        "dtype": str(job.run_model.dtype),
        "device": str(settings.execution_device),
        "threads": torch.get_num_threads(),
        "strategies": sections,
        "max_memory": {str(k): v for k, v in settings.max_memory.items()},
        "headroom": settings.headroom,
        "device_map": settings.device_map_file,
        "page_cache": settings.page_cache,
        "rows": rows,
        "tokens": tokens,
        "max_new_tokens": settings.sampling.max_new_tokens,
        "speculative": settings.speculative,
        **({"hybrid": True} if settings.hybrid else {}),  # learned apart (other runs' keys unchanged)
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    label = f"{strategies} max_memory={parts['max_memory']} batch={rows}x{tokens}"
    return hashlib.sha256(text.encode()).hexdigest()[:20], label


def correct(job: Any, predicted: dict[str, float]) -> dict[str, float]:
    """``predicted`` (the cost model's times) times this configuration's learned corrections (:func:`corrected`)."""
    return corrected(read().get(config_key(job)[0], {}), predicted) if predicted else predicted


def corrected(entry: dict[str, Any], predicted: dict[str, float]) -> dict[str, float]:
    """``predicted`` times the median ratio measured / predicted of ``entry`` (one configuration's), per figure, with
    the cost model's own figures kept as ``model_predicted_*`` and ``prediction_runs``: how many earlier runs the
    correction learned from (0: none yet)."""
    out = dict(predicted)
    runs = 0
    for name, (key, _) in FIGURES.items():
        ratios = entry.get("ratios", {}).get(name)
        if key in predicted:
            out[f"model_{key}"] = predicted[key]
            if ratios:
                out[key] = predicted[key] * statistics.median(ratios)
                runs = max(runs, len(ratios))
    out["prediction_runs"] = runs
    return out


def compare(predicted: dict[str, Any], figures: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per figure that was both predicted and measured: predicted, measured and the error (predicted - measured) /
    measured."""
    found = {}
    for name, (key, measured_key) in FIGURES.items():
        guess, measured = predicted.get(key), figures.get(measured_key)
        if (
            isinstance(guess, (int, float))
            and isinstance(measured, (int, float))
            and measured > 0
            and math.isfinite(measured)
        ):
            found[name] = {
                "predicted": float(guess),
                "measured": float(measured),
                "error": (guess - measured) / measured,
                "model_predicted": float(predicted.get(f"model_{key}", guess)),
            }
    return found


def record(job: Any, figures: dict[str, Any]) -> dict[str, Any]:
    """Compare the run's prediction with what it measured and learn from it (:func:`learn`); the figures to add
    to ``metrics.json``: ``prediction`` (per figure predicted, measured, error) and ``prediction_runs``."""
    return learn(*config_key(job), job.plan.predicted_time, figures)


def learn(key: str, label: str, predicted: dict[str, Any], figures: dict[str, Any]) -> dict[str, Any]:
    """Keep the ratios measured / predicted by the cost model of configuration ``key`` (the file written whole, a
    damaged one remade) and return the comparison."""
    found = compare(predicted, figures)
    if not found:
        return {}
    if busy_notice() is not None:  # the comparison line says it is not learned from
        return {"prediction": found, "prediction_runs": int(predicted.get("prediction_runs", 0)), "learned": False}
    entries = read()
    entry = entries.setdefault(key, {"label": label, "ratios": {}})
    for name, values in found.items():
        if values["model_predicted"] > 0 and _ratio(ratio := values["measured"] / values["model_predicted"]):
            entry["ratios"][name] = (entry["ratios"].get(name, []) + [ratio])[-KEPT:]
    entry.update(label=label, updated=time.time())
    kept = dict(sorted(entries.items(), key=lambda kv: kv[1].get("updated", 0))[-MAX_ENTRIES:])
    try:
        write_text_atomic(
            corrections_file(), json.dumps({"version": VERSION, "machine": machine(), "entries": kept}, indent=1)
        )
    except OSError as exc:  # a read-only cache: the run's figures stand, nothing is learned
        print(f"offload_core: the prediction correction was not saved ({exc.strerror or exc})", file=sys.stderr)
    return {"prediction": found, "prediction_runs": int(predicted.get("prediction_runs", 0)), "learned": True}


def comparison_line(learned: dict[str, Any]) -> str:
    """One line: predicted against measured, per figure, and what the prediction was corrected from."""
    found = learned.get("prediction")
    if not found:
        return ""
    names = {"load": "load", "ttft": "first token", "step": "decoding step"}
    cells = " | ".join(
        f"{names[n]} {v['predicted']:.3g} s vs {v['measured']:.3g} s ({100 * v['error']:+.0f}%)"
        for n, v in found.items()
    )
    runs = learned.get("prediction_runs", 0)
    source = (
        f"corrected by {runs} earlier run{'s' if runs != 1 else ''} of this configuration"
        if runs
        else "cost model only"
    )
    if learned.get("learned") is False:
        source += "; not learned from: the machine is busy"
    elif not runs:
        source += "; learned for the next run of this configuration"
    return f"predicted vs measured: {cells} ({source})"


def print_comparison(learned: dict[str, Any]) -> None:
    """Print :func:`comparison_line` when the run both predicted and measured."""
    line = comparison_line(learned)
    if line:
        print(line)
