"""The memory budget holds: peak anonymous RSS minus the baseline stays within max_memory.cpu, loading and generating."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import ROOT
BUDGET_MIB = 32  # the "small" synthetic model is 42 MiB in bf16; less the planned KV cache, activations and runtime slack
# (9 MiB) this keeps ~half of it on disk


@pytest.mark.parametrize("storage", ["memmap", "safetensors"])
def test_peak_anonymous_rss_stays_within_the_cpu_budget(storage, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "model=synthetic", "model.preset=small", f"storage={storage}",
         f"max_memory.cpu={BUDGET_MIB}MiB", "max_new_tokens=8", "progress=false", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    devices = metrics["devices"]
    assert devices["disk"]["bytes"] > 0 and devices["cpu"]["bytes"] > 0
    assert 0 < metrics["peak_anon_rss_bytes"] <= BUDGET_MIB * 2**20
    # The offloaded bytes are read through mappings: they show up as file-backed pages, not as ours.
    assert metrics["peak_file_rss_bytes"] >= devices["disk"]["bytes"] * 0.9
    if storage == "safetensors":
        assert metrics["store_bytes_written"] == 0
