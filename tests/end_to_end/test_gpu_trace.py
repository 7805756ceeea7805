"""``bench/gpu_trace.py``: a profiled warm decoding step runs on a CPU and writes its trace and summary; the figures
it reads from a trace (GPU busy time, idle gaps, the copy stream) are the ones the trace's intervals give."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import sys

import pytest

from tests import ROOT, preloaded


def _gpu_trace():
    spec = importlib.util.spec_from_file_location("gpu_trace", ROOT / "bench" / "gpu_trace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_figures_of_a_trace():
    """A 1000 us step: kernels on stream 7 at 100-300, 250-400 and 700-900 us; a copy on stream 20 at 350-650 us;
    a copy on stream 7 at 950-960 us; one hook range of 40 us; an event outside the step is left out."""

    def event(cat, name, ts, dur, stream=None, nbytes=None):
        args = {} if stream is None else {"stream": stream}
        if nbytes is not None:
            args["bytes"] = nbytes
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    events = [
        event("user_annotation", "offload_core::decode_step", 1000, 1000),
        event("kernel", "gemm", 1100, 200, 7),
        event("kernel", "gemm", 1250, 150, 7),
        event("kernel", "gemm", 1700, 200, 7),
        event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1350, 300, 20, 4_000_000),
        event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1950, 10, 7, 100),
        event("kernel", "gemm", 5000, 100, 7),
        event("user_annotation", "offload_core::hook", 1010, 40),
    ]
    figures = _gpu_trace().trace_figures(events)
    assert figures["step_ms"] == 1.0 and figures["kernels"] == 3 and figures["compute_stream"] == 7
    assert figures["compute_busy_ms"] == pytest.approx(0.5)  # 100-400 and 700-900
    assert figures["gpu_busy_ms"] == pytest.approx(0.76)  # 100-650, 700-900, 950-960
    # idle: 0-100, 650-700, 900-950, 960-1000
    assert figures["gpu_idle_ms"] == pytest.approx(0.24) and figures["gpu_largest_gap_ms"] == pytest.approx(0.1)
    assert figures["compute_idle_ms"] == pytest.approx(0.5) and figures["compute_largest_gap_ms"] == pytest.approx(0.3)
    assert figures["compute_gaps_over_50us"] == 3  # 0-100, 400-700, 900-1000
    assert figures["copy_streams"] == [20] and figures["copy_stream_busy_ms"] == pytest.approx(0.3)
    assert figures["h2d_on_compute_stream_ms"] == pytest.approx(0.01) and figures["h2d_bytes"] == 4_000_100
    assert figures["hook_host_ms_in_trace"] == pytest.approx(0.04)


def test_a_cpu_run_writes_its_trace_and_summary(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OFFLOAD_CORE_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, str(ROOT / "bench" / "gpu_trace.py"), "--preset", "tiny", "--device", "cpu"]
    done = preloaded.run(
        [*command, "--steps", "2", "--warm", "1", "--out", str(tmp_path / "out")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "out" / "gpu-trace-tiny-cpu.json").read_text())
    assert result["offloaded_bytes"] > 0 and result["bytes_moved_per_step"] > 0 and len(result["step_wall_ms"]) == 2
    assert result["profiled"]["step_ms"] > 0 and result["profiled"]["gpu_busy_ms"] is None  # no GPU here
    assert {"model.layers.0", "model.layers.3"} <= set(result["hook_host_ms_per_layer"])
    with gzip.open(tmp_path / "out" / "gpu-trace-tiny-cpu.json.gz", "rt") as trace:
        names = {e.get("name") for e in json.load(trace)["traceEvents"]}
    assert {"offload_core::decode_step", "offload_core::hook"} <= names
    summary = (tmp_path / "out" / "gpu-trace-tiny-cpu.md").read_text()
    assert "| GPU busy (any stream), ms | n/a |" in summary and "| model.layers.0 |" in summary
