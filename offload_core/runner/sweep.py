"""Sweep summaries: after ``python run.py -m …``, one CSV, one markdown table and one PNG plot at the sweep's root.

Runs as a Hydra callback (``on_multirun_end``) and reads each job's ``metrics.json``, so the summary is
the same whichever launcher ran the jobs (basic, joblib, submitit, ray). A job folder with no
``metrics.json`` (a job killed before it could write one) is a failed row; a sweep with a failed row exits 1. Also
callable by hand: ``python -m offload_core.runner.sweep <sweep dir>``.
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
    "job",
    "placement",
    "storage",
    "hook",
    "model",
    "overrides",
    "status",
    "matches_in_memory",
    "batch_size",
    "load_s",
    "predicted_load_s",
    "time_to_first_token_s",
    "predicted_ttft_s",
    "decode_tokens_per_s",
    "time_per_decode_step_s",
    "predicted_step_s",
    "aggregate_tokens_per_s",
    "latency_median_s",
    "latency_p90_s",
    "peak_anon_rss_mib",
    "peak_file_rss_mib",
    "peak_gpu_mib",
    "bytes_moved_per_token",
    "predicted_bytes_per_token",
    "offloaded_mib",
    "speculative",
    "tokens_per_pass",
    "acceptance_rate",
    "drafted_tokens",
    "predicted_s_per_token",
    "error",
]

#: figures copied from metrics.json as they are (rounded); empty where a run has none (a run that did not record it,
#: no batch)
PLAIN = (
    "batch_size",
    "predicted_load_s",
    "predicted_ttft_s",
    "time_per_decode_step_s",
    "predicted_step_s",
    "aggregate_tokens_per_s",
    "latency_median_s",
    "latency_p90_s",
    "speculative",
    "tokens_per_pass",
    "acceptance_rate",
    "drafted_tokens",
    "predicted_s_per_token",
)


#: the numbers a summary row computes with
FIGURES = {
    *(set(PLAIN) - {"speculative"}),
    "load_s",
    "time_to_first_token_s",
    "decode_tokens_per_s",
    "peak_anon_rss_bytes",
    "peak_file_rss_bytes",
    "bytes_moved_per_token",
    "predicted_bytes_per_token",
    "offloaded_bytes",
    "peak_gpu_bytes",
}


def _squashed(text: Any) -> str:
    return " ".join(str(text).split())


def _read(job_dir: Path) -> dict[str, Any]:
    """A job's ``metrics.json``, or a failed record when it is missing or unreadable."""
    metrics_file = job_dir / "metrics.json"
    try:
        data = json.loads(metrics_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {"error": "the job wrote no metrics.json (it was killed or crashed); see its log in this folder"}
    except (OSError, ValueError) as exc:
        return {"error": f"metrics.json is not valid JSON ({exc})"}
    if not isinstance(data, dict):
        return {"error": "metrics.json is not a JSON object; the job's figures are lost"}
    # a figure of another type is left empty, never trusted
    return {
        k: v
        for k, v in data.items()
        if k not in FIGURES
        or (isinstance(v, (int, float)) and not isinstance(v, bool))
        or (k == "peak_gpu_bytes" and isinstance(v, dict))
    }


def job_row(job_dir: Path) -> dict[str, Any]:
    """One job's row of the sweep's summary (its choices, overrides and figures, or its one-line error)."""
    data = _read(job_dir)
    choices = data.get("choices") if isinstance(data.get("choices"), dict) else _choices(job_dir)
    if not isinstance(data.get("overrides"), (list, type(None))):
        data["overrides"] = None
    mib = 2**20

    def fmt(value: Any, digits: int = 3) -> Any:
        return round(value, digits) if isinstance(value, float) and math.isfinite(value) else value

    peak_gpu = {k: v for k, v in (data.get("peak_gpu_bytes") or {}).items() if isinstance(v, (int, float))}
    return {
        "job": job_dir.name,
        "placement": choices.get("placement", ""),
        "storage": choices.get("storage", ""),
        "hook": choices.get("hook", ""),
        "model": choices.get("model", ""),
        "overrides": " ".join(data.get("overrides") or _overrides(job_dir)),
        "status": "failed" if data.get("error") else "planned" if data.get("plan_only") else "ok",
        "matches_in_memory": "" if data.get("matches_in_memory") is None else data["matches_in_memory"],
        "load_s": fmt(data.get("load_s", "")),
        "time_to_first_token_s": fmt(data.get("time_to_first_token_s", "")),
        "decode_tokens_per_s": fmt(data.get("decode_tokens_per_s", ""), 2),
        "peak_anon_rss_mib": fmt(data["peak_anon_rss_bytes"] / mib, 1) if "peak_anon_rss_bytes" in data else "",
        "peak_file_rss_mib": fmt(data["peak_file_rss_bytes"] / mib, 1) if "peak_file_rss_bytes" in data else "",
        "peak_gpu_mib": " ".join(f"{k}:{v / mib:.0f}" for k, v in peak_gpu.items()),
        "bytes_moved_per_token": int(data["bytes_moved_per_token"]) if "bytes_moved_per_token" in data else "",
        "predicted_bytes_per_token": data.get("predicted_bytes_per_token", ""),
        "offloaded_mib": fmt(data["offloaded_bytes"] / mib, 1) if "offloaded_bytes" in data else "",
        "error": _squashed(data.get("error") or ""),
        **{key: fmt(data.get(key, ""), 4) for key in PLAIN},
    }


def _overrides(job_dir: Path) -> list[str]:
    """The job's task overrides as Hydra saved them (for jobs that wrote no metrics)."""
    from omegaconf import OmegaConf

    saved = job_dir / ".hydra" / "overrides.yaml"
    return [str(o) for o in OmegaConf.load(saved)] if saved.exists() else []


def _choices(job_dir: Path) -> dict[str, Any]:
    """The job's config-group choices as Hydra saved them (for jobs that wrote no metrics)."""
    from omegaconf import OmegaConf

    saved = job_dir / ".hydra" / "hydra.yaml"
    if not saved.exists():
        return {}
    return dict(OmegaConf.load(saved).hydra.runtime.choices)


def _job_dirs(sweep_dir: Path) -> list[Path]:
    """Folders of the sweep's jobs: those holding a ``metrics.json`` or Hydra's ``.hydra`` record."""
    found = {p.parent for p in sweep_dir.glob("*/metrics.json")} | {p.parent for p in sweep_dir.glob("*/.hydra")}
    return sorted(found, key=lambda p: (len(p.name), p.name))


def summarize(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """Write ``summary.csv``, ``summary.md`` and ``summary.png`` in ``sweep_dir``; return the rows."""
    sweep_dir = Path(sweep_dir)
    rows = [job_row(d) for d in _job_dirs(sweep_dir)]
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
    panels = (
        ("decode_tokens_per_s", "decode tokens/s"),
        ("load_s", "load time (s)"),
        ("peak_anon_rss_mib", "peak anonymous RSS (MiB)"),
    )
    if not ok:  # a plan-only sweep: compare the plans
        ok = [r for r in rows if r["status"] == "planned"]
        panels = (
            ("predicted_step_s", "predicted s per decoding step"),
            ("predicted_load_s", "predicted load time (s)"),
            ("offloaded_mib", "offloaded (MiB)"),
        )
    labels = _labels(rows, ok)
    fig, axes = plt.subplots(1, 3, figsize=(15, max(3, 0.35 * len(ok) + 1.5)), squeeze=False)
    axes = list(axes[0])
    for ax, (key, title) in zip(axes, panels):
        values = [r[key] if isinstance(r[key], (int, float)) else 0 for r in ok]
        colors = ["tab:green" if r["matches_in_memory"] in (True, "") else "tab:red" for r in ok]
        ax.barh(range(len(ok)), values, color=colors)
        ax.set_yticks(range(len(ok)), labels if ax is axes[0] else [""] * len(ok), fontsize=8)
        ax.set_title(title)
        ax.invert_yaxis()
    failed = sum(r["status"] == "failed" for r in rows)
    fig.suptitle(
        f"{len(ok)} runs"
        + (f", {failed} failed (see summary.md)" if failed else "")
        + "; red: tokens differ from the in-memory model"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _labels(rows: list[dict[str, Any]], shown: list[dict[str, Any]]) -> list[str]:
    """Each run's job number and the overrides that differ between runs of the sweep."""
    sets = [set(r["overrides"].split()) for r in rows]
    common = set.intersection(*sets) if sets else set()
    return [
        f"{r['job']}: "
        + (
            " ".join(o for o in r["overrides"].split() if o not in common)
            or f"{r['placement']}/{r['storage']}/{r['hook']}"
        )
        for r in shown
    ]


def counted(rows: list[dict[str, Any]]) -> str:
    """How many jobs ran and how many of them failed, naming the failed ones (``2 jobs ran, 1 failed: job 1
    (prompt=x)``)."""
    failed = [r for r in rows if r["status"] == "failed"]
    text = f"{len(rows)} job{'s' * (len(rows) != 1)} ran, {len(failed)} failed"
    return text + (": " + ", ".join(_failed_labels(rows, failed)) if failed else "")


def _failed_labels(rows: list[dict[str, Any]], failed: list[dict[str, Any]]) -> list[str]:
    """``job N (the overrides that set it apart)`` for each failed row."""
    labels = [label.split(": ", 1) for label in _labels(rows, failed)]
    return [f"job {job} ({what})" for job, what in labels]


class SweepSummary(Callback):
    """Hydra callback: summarise a multirun when it ends; a sweep whose jobs failed then exits with status 1, after one
    error line naming them (each job's error is in its row)."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.exists():
            return
        rows = summarize(sweep_dir)
        print(f"sweep summary: {counted(rows)} -> {sweep_dir / 'summary.md'} (and .csv, .png)", flush=True)
        failed = [r for r in rows if r["status"] == "failed"]
        if failed:
            from offload_core.runner.console import print_line

            first = failed[0]["error"]
            print_line(
                f"error: {len(failed)} of {len(rows)} jobs of the sweep failed; job {failed[0]['job']}: "
                f"{first[:300]}{'…' if len(first) > 300 else ''}; every job's error is in the error column of "
                f"{sweep_dir / 'summary.md'}"
            )
            raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    """``python -m offload_core.runner.sweep <sweep dir>``: summarise a sweep's folder again (after more jobs ran)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m offload_core.runner.sweep",
        description="Write summary.csv, summary.md and summary.png for the jobs of a sweep "
        "folder (python run.py -m ... writes them itself when the sweep ends).",
    )
    parser.add_argument("sweep_dir", help="the sweep's folder (hydra.sweep.dir, e.g. multirun/2026-01-31/12-00-00)")
    args = parser.parse_args(argv)
    folder = Path(args.sweep_dir)
    if not folder.is_dir() or not _job_dirs(folder):
        print(
            f"offload_core: error: {folder} is not a sweep's folder (no job folder with metrics.json or .hydra in it); "
            "give the folder python run.py -m wrote",
            file=sys.stderr,
        )
        return 2
    rows = summarize(folder)
    print(f"{counted(rows)} -> {folder / 'summary.md'} (and .csv, .png)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
