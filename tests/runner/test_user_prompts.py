"""Prompts as a user may plausibly write them (a JSON line with an empty prompt, a file saved with a byte-order mark)
are read as meant, or refused in one line naming the line; never a traceback, never JSON generated from as text."""

from __future__ import annotations

import json

from gguf import GGMLQuantizationType as T

from offload_core.runner.inputs import read_prompts
from tests.end_to_end.helpers import assert_one_line, cli
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
