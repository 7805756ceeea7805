"""bench/gguf_large.py end to end at a tiny size: it builds the bf16 checkpoint and its Q4_0 GGUF, runs the three
systems as processes, and writes a report whose every run generated tokens; a damaged GGUF file is built again."""

from __future__ import annotations

import json
import sys

import pytest

from tests import ROOT, preloaded

sys.path.insert(0, str(ROOT / "bench"))

import gguf_large  # noqa: E402

SYSTEMS = ["bf16 safetensors", "GGUF Q4_0 exact", "GGUF Q4_0 quantized compute"]


@pytest.mark.slow
def test_tiny_run_writes_a_report_of_three_runs_with_tokens(tmp_path, capsys):
    scratch, results = tmp_path / "scratch", tmp_path / "results"
    command = [sys.executable, str(ROOT / "bench" / "gguf_large.py"), "--scratch", str(scratch), "--preset", "tiny"]
    command += ["--types", "Q4_0", "--budget", "1MB", "--tokens", "2", "--tag", "t", "--results", str(results)]
    command += ["--over-budget", "warn"]  # 1MB: less than the units in flight, so that part of each model is offloaded
    done = preloaded.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, nested=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((results / "gguf-large-t.json").read_text())
    rows = {row["system"]: row for row in report["rows"]}
    assert list(rows) == SYSTEMS
    for row in rows.values():
        assert row["generated_tokens"] == 2 and len(row["token_ids"]) == 2
        assert row["decode_tokens_per_s"] > 0 and row["offloaded_bytes"] > 0  # 1MB: part of each model on disk
        assert "max_memory.cpu=1MB" in row["command"]
    # the tiny models are cheap to hold in memory: the bf16 and exact runs equal transformers' own
    assert rows["bf16 safetensors"]["matches_in_memory"] is True
    assert rows["GGUF Q4_0 exact"]["matches_in_memory"] is True
    assert rows["GGUF Q4_0 quantized compute"]["matches_in_memory"] is None
    assert set(report["info"]["file_bytes"]) == {"bf16", "Q4_0"}
    text = (results / "gguf-large-t.md").read_text()
    assert all(f"| {name} |" in text for name in SYSTEMS) and "| decode tok/s | x bf16 |" in text

    gguf = scratch / "tiny" / "q4_0" / "model.gguf"
    size = gguf.stat().st_size
    with gguf.open("ab") as file:  # damaged after its marker was written: built again, not trusted
        file.write(b"\0")
    assert gguf_large.gguf_file(scratch / "tiny", scratch / "tiny" / "bf16", "Q4_0") == gguf
    assert "marker does not match; building it again" in capsys.readouterr().out
    assert gguf.stat().st_size == size
