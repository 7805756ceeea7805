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


def _written(path, tokenizer: bool = True):
    """A tiny GGUF file (``tokenizer``: with its tokenizer), written with logging off: gguf-py logs as it writes, and
    a handler an earlier in-process run left on a closed stream would print a logging error into this test's
    stderr."""
    import logging

    import tests.gguf_files

    logging.disable(logging.INFO)
    try:
        with pytest.MonkeyPatch.context() as patch:
            if not tokenizer:
                patch.setattr(tests.gguf_files, "_add_tokenizer", lambda writer: None)  # weights alone
            return write_gguf(path, "llama", default=int(T.Q8_0), layers=2)
    finally:
        logging.disable(logging.NOTSET)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _written(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_a_byte_order_mark_is_no_part_of_the_first_prompt(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes("\ufeff".encode() + b'{"prompt": "first"}\n{"prompt": "second"}\n')
    assert read_prompts(path) == ["first", "second"]
    path.write_bytes("\ufeffplain\n".encode())
    assert read_prompts(path) == ["plain"]


def test_an_empty_prompt_in_json_lines_is_one_line_naming_it(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    gguf = tiny
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


def test_a_gguf_file_without_a_tokenizer_says_to_name_one_not_to_copy_files_into_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    gguf = _written(tmp_path / "no-tokenizer.gguf", tokenizer=False)
    for store in (["storage=gguf"], []):  # read in place; converted into the model cache
        code, err = cli(["model=local", f"model.path={gguf}", *store], tmp_path, capsys)
        assert code == 2
        assert_one_line(err, "the model's GGUF file carries no tokenizer", "give model.tokenizer=")
        assert "copy the model's tokenizer files" not in err
