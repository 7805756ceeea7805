"""How close the time prediction came over a sweep: per row and as medians, |predicted - measured| / measured of the
load time, the time to first token and the time per decoding step, from the sweep's ``summary.csv``.

    python bench/predict_error.py multirun/<date>/<time>/summary.csv --out bench/results/predict-sweep-0.3b.csv
"""

from __future__ import annotations

import argparse
import csv
import shutil
import statistics
from pathlib import Path

#: measured column -> predicted column of the sweep summary
PAIRS = {
    "load_s": "predicted_load_s",
    "time_to_first_token_s": "predicted_ttft_s",
    "time_per_decode_step_s": "predicted_step_s",
}


def errors(rows: list[dict]) -> dict[str, list[float]]:
    """Per measured column, the relative error of every row that has both figures."""
    found: dict[str, list[float]] = {name: [] for name in PAIRS}
    for row in rows:
        for measured, predicted in PAIRS.items():
            if row.get(measured) and row.get(predicted):
                found[measured].append(abs(float(row[predicted]) - float(row[measured])) / float(row[measured]))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("summary", help="a sweep's summary.csv")
    parser.add_argument("--out", help="copy the summary here (bench/results/...)")
    args = parser.parse_args()
    rows = list(csv.DictReader(open(args.summary, newline="")))
    failed = [row["job"] for row in rows if row.get("status") != "ok"]
    print(f"{len(rows)} runs, {len(rows) - len(failed)} ok" + (f" (failed: {', '.join(failed)})" if failed else ""))
    for row in rows:
        if row.get("status") == "ok":
            cells = " | ".join(
                f"{m} {float(row[m]):.2f}/{float(row[p]):.2f}" for m, p in PAIRS.items() if row.get(m) and row.get(p)
            )
            print(f"  {row['job']:>3} {row['overrides']}: measured/predicted {cells}")
    every = []
    for measured, values in errors(rows).items():
        every += values
        if values:
            print(f"{measured}: median error {100 * statistics.median(values):.0f}% over {len(values)} runs")
    if every:
        print(f"all three: median error {100 * statistics.median(every):.0f}% over {len(every)} figures")
    if args.out:
        shutil.copyfile(args.summary, Path(args.out))


if __name__ == "__main__":
    main()
