"""Prompts as a user may plausibly write them (a JSON line with an empty prompt, a file saved with a byte-order mark)
are read as meant, or refused in one line naming the line; never a traceback, never JSON generated from as text."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as T

from offload_core.runner.inputs import read_prompts
from tests import ROOT
from tests.end_to_end.helpers import assert_one_line, child_env, cli, snapshot
from tests.gguf_files import write_gguf


def test_a_byte_order_mark_is_no_part_of_the_first_prompt(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes("\ufeff".encode() + b'{"prompt": "first"}\n{"prompt": "second"}\n')
    assert read_prompts(path) == ["first", "second"]
    path.write_bytes("\ufeffplain\n".encode())
    assert read_prompts(path) == ["plain"]


def test_an_empty_prompt_in_json_lines_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    gguf = write_gguf(tmp_path / "tiny.gguf", "llama", default=int(T.Q8_0), layers=2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "one"}) + "\n" + json.dumps({"prompt": ""}) + "\n")
    code, err = cli(["model=local", f"model.path={gguf}", "storage=gguf", f"prompts={prompts}"], tmp_path, capsys)
    assert code == 2
    assert_one_line(err, "line 2 holds an empty prompt")


@pytest.mark.slow  # a run.py process: Hydra's own files are made only there
def test_resume_of_a_folder_no_prompts_run_made_writes_nothing_there(tmp_path):
    mine = tmp_path / "my-notes"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\n")
    before = snapshot(mine)
    command = [sys.executable, "run.py", "progress=false", "model=synthetic", f"prompts={prompts}", f"resume={mine}"]
    env = {**child_env(), "OFFLOAD_CORE_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert_one_line(done.stderr, f"resume={mine}: the folder holds no generations.run.json")
    assert snapshot(mine) == before  # no log of the run made there
    assert "predicted" not in done.stdout  # refused before the model is opened
