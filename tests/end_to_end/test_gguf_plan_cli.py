"""``python run.py ... storage=gguf plan_only=true`` as users run it: the plan shows, per GGML type, the quantized
bytes read in place, the float32 bytes dequantized and the predicted dequantization time per token, from rates
measured on this machine and cached with the calibration (``calibrate=true`` measures them again)."""

from __future__ import annotations

import json
import sys

from gguf import GGMLQuantizationType as T

from tests import ROOT, preloaded
from tests.end_to_end.helpers import child_env
from tests.gguf_files import write_gguf


def _plan(args, tmp_path, env):
    command = [sys.executable, "run.py", "progress=false", f"hydra.run.dir={tmp_path}", "plan_only=true", *args]
    return preloaded.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_plan_only_shows_the_dequantization_per_type_from_rates_measured_here(tmp_path):
    (tmp_path / "model").mkdir()
    path = write_gguf(tmp_path / "model" / "tiny.gguf", "qwen2", {"ffn_down": int(T.Q4_K)}, default=int(T.Q8_0))
    calibration = tmp_path / "calibration.json"
    env = {
        **child_env(),
        "OFFLOAD_CORE_CACHE": str(tmp_path / "cache"),
        "OFFLOAD_CORE_CALIBRATION": str(calibration),
        "OFFLOAD_CORE_BUSY_LOAD": "inf",  # a loaded test machine still writes what it measured
    }
    args = [
        "model=local",
        f"model.path={path}",
        "storage=gguf",
        "max_memory.cpu=1MiB",
        "headroom=0",
        "over_budget=warn",
    ]
    done = _plan(args, tmp_path / "first", env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "dequantized per generated token, by GGML type (read in place -> dequantized, predicted time):" in out
    assert "  Q4_K x" in out and "  Q8_0 x" in out and "  in all: " in out
    metrics = json.loads((tmp_path / "first" / "metrics.json").read_text())
    rows = metrics["predicted_dequant_by_type"]
    assert {row["type"] for row in rows} >= {"Q4_K", "Q8_0"}
    assert all(0 < row["read_bytes"] <= row["dequant_bytes"] and row["predicted_s"] > 0 for row in rows)
    assert all(row["read_bytes"] < row["dequant_bytes"] / 3 for row in rows if row["type"] != "F32")
    assert sum(row["read_bytes"] for row in rows) == metrics["predicted_bytes_per_token"]
    assert metrics["predicted_dequant_s"] == sum(row["predicted_s"] for row in rows)
    cached = json.loads(calibration.read_text())["dequant"]
    (rates,) = cached.values()
    assert {"Q4_K", "Q8_0", "convert_bps"} <= set(rates)
    # the cached rates are read back: the same prediction; a damaged entry is measured again, the rest kept
    rates["Q4_K"] = {"fresh_bps": "fast"}
    calibration.write_text(json.dumps({**json.loads(calibration.read_text()), "dequant": cached}))
    again = _plan(args, tmp_path / "again", env)
    assert again.returncode == 0, again.stderr[-3000:]
    repaired = next(iter(json.loads(calibration.read_text())["dequant"].values()))
    assert all(isinstance(v, float) and v > 0 for v in repaired["Q4_K"].values()) and len(repaired["Q4_K"]) == 2
    assert repaired["Q8_0"] == rates["Q8_0"]  # whole: kept
