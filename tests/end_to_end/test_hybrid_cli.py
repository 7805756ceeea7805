"""``hybrid=true`` from the command line on a machine without a GPU: one line saying why, exit 2, nothing run."""

from __future__ import annotations

import os
import sys

from tests import ROOT, preloaded


def test_hybrid_without_a_gpu_is_refused_in_one_line(tmp_path):
    proc = preloaded.run(
        [
            sys.executable,
            str(ROOT / "run.py"),
            "model=synthetic",
            "hook=prefetch",
            "hybrid=true",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HYDRA_FULL_ERROR": "0", "OFFLOAD_CORE_ACCELERATOR": "cpu"},
    )
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("offload_core: error:")]
    assert errors == [
        "offload_core: error: hybrid=true computes part of the offloaded blocks on the host while the others stream "
        "to a GPU; this run computes on cpu: leave hybrid out (or run on a GPU)"
    ]
    assert "Traceback" not in proc.stderr and not (tmp_path / "metrics.json").exists()
