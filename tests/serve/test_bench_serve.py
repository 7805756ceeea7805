"""``bench/serve.py`` still runs: against the tiny model, at one and two clients, it writes its report."""

from __future__ import annotations

import json
import sys

import pytest

from tests import ROOT, preloaded
from tests.end_to_end.helpers import child_env
from tests.serve.tiny import save_tiny_chat_model

pytestmark = pytest.mark.slow


def test_bench_serve_writes_its_report(tmp_path):
    tiny = save_tiny_chat_model(tmp_path / "tiny")
    done = preloaded.run(
        [
            sys.executable,
            "bench/serve.py",
            "--clients",
            "1,2",
            "--tokens",
            "3",
            "--rounds",
            "1",
            "--tag",
            "tiny",
            "--out",
            str(tmp_path),
            "model=local",
            f"model.path={tiny}",
            "storage=memmap",
            "max_memory.cpu=1KiB",
            "headroom=0",
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=280,
        nested=True,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "serve-tiny.json").read_text())
    assert [row["clients"] for row in result["loads"]] == [1, 2]
    assert all(row["generated_tokens"] > 0 and row["bytes_moved_per_token"] > 0 for row in result["loads"])
    assert result["exactness"]["prompts"] == 8
    assert "| 2 |" in (tmp_path / "serve-tiny.md").read_text()
