"""Sweep summaries: after ``python run.py -m …``, one CSV, one markdown table and one PNG plot at the sweep's root.

Runs as a Hydra callback (``on_multirun_end``) and reads each job's ``metrics.json``, so the summary is
the same whichever launcher ran the jobs (basic, joblib, submitit, ray). Also callable by hand:
``python -m offload_core summarize <sweep dir>``.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

log = logging.getLogger(__name__)

COLUMNS = [
    "job", "placement", "storage", "hook", "model", "overrides", "status", "matches_in_memory",
    "load_s", "time_to_first_token_s", "decode_tokens_per_s", "peak_anon_rss_mib", "peak_file_rss_mib",
    "peak_gpu_mib", "bytes_moved_per_token", "error",
]


def _row(metrics_file: Path) -> dict[str, Any]:
    data = json.loads(metrics_file.read_text())
    choices = data.get("choices", {})
    mib = 2**20

    def fmt(value: Any, digits: int = 3) -> Any:
        return round(value, digits) if isinstance(value, float) and math.isfinite(value) else value

    peak_gpu = data.get("peak_gpu_bytes") or {}
    return {
        "job": metrics_file.parent.name,
        "placement": choices.get("placement", ""),
        "storage": choices.get("storage", ""),
        "hook": choices.get("hook", ""),
        "model": choices.get("model", ""),
        "overrides": " ".join(data.get("overrides", [])),
        "status": "failed" if data.get("error") else "ok",
        "matches_in_memory": data.get("matches_in_memory", ""),
        "load_s": fmt(data.get("load_s", "")),
        "time_to_first_token_s": fmt(data.get("time_to_first_token_s", "")),
        "decode_tokens_per_s": fmt(data.get("decode_tokens_per_s", ""), 2),
        "peak_anon_rss_mib": fmt(data["peak_anon_rss_bytes"] / mib, 1) if "peak_anon_rss_bytes" in data else "",
        "peak_file_rss_mib": fmt(data["peak_file_rss_bytes"] / mib, 1) if "peak_file_rss_bytes" in data else "",
        "peak_gpu_mib": " ".join(f"{k}:{v / mib:.0f}" for k, v in peak_gpu.items()),
        "bytes_moved_per_token": int(data["bytes_moved_per_token"]) if "bytes_moved_per_token" in data else "",
        "error": data.get("error", ""),
    }


def summarize(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """Write ``summary.csv``, ``summary.md`` and ``summary.png`` in ``sweep_dir``; return the rows."""
    sweep_dir = Path(sweep_dir)
    files = sorted(sweep_dir.glob("*/metrics.json"), key=lambda p: (len(p.parent.name), p.parent.name))
    rows = [_row(f) for f in files]
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(str(row[c]).replace("|", "\\|") for c in COLUMNS) + " |")
    (sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")
    _plot(rows, sweep_dir / "summary.png")
    return rows


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    labels = [f"{r['placement']}/{r['storage']}/{r['hook']}" or r["job"] for r in ok]
    fig, axes = plt.subplots(1, 3, figsize=(15, max(3, 0.35 * len(ok) + 1.5)))
    for ax, key, title in zip(axes, ("decode_tokens_per_s", "load_s", "peak_anon_rss_mib"),
                              ("decode tokens/s", "load time (s)", "peak anonymous RSS (MiB)")):
        values = [r[key] if isinstance(r[key], (int, float)) else 0 for r in ok]
        colors = ["tab:green" if r["matches_in_memory"] in (True, "") else "tab:red" for r in ok]
        ax.barh(range(len(ok)), values, color=colors)
        ax.set_yticks(range(len(ok)), labels if ax is axes[0] else [""] * len(ok), fontsize=8)
        ax.set_title(title)
        ax.invert_yaxis()
    failed = len(rows) - len(ok)
    fig.suptitle(f"{len(ok)} runs" + (f", {failed} failed (see summary.md)" if failed else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class SweepSummary(Callback):
    """Hydra callback: summarise a multirun when it ends."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.exists():
            rows = summarize(sweep_dir)
            print(f"sweep summary: {len(rows)} runs -> {sweep_dir / 'summary.md'} (and .csv, .png)")
