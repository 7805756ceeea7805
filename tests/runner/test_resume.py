"""A prompts run keeps each finished batch in ``generations.jsonl`` as it ends; ``resume=<run folder>`` goes on where
an interrupted run stopped, with the same outputs as a run never interrupted; a torn last line is generated again and
a folder of other prompts or settings is refused."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

import offload_core.jobs.batch as batch
from offload_core.errors import ConfigError
from offload_core.runner.job import run
from offload_core.runner.config import register_configs

from tests import ROOT

PROMPTS = [f"prompt number {i} about {w}" for i, w in enumerate(["cats", "dogs", "rain", "tea", "maps", "ink"])]


def _cfg(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=overrides)


def _run(tmp_path, folder, *extra):
    prompts = tmp_path / "prompts.txt"
    if not prompts.exists():
        prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = _cfg(
        [
            "model=synthetic",
            "storage=safetensors",
            "max_memory.cpu=20MiB",
            f"prompts={prompts}",
            "batch_size=2",
            "max_new_tokens=3",
            "progress=false",
            *extra,
        ]
    )
    return run(cfg, output_dir=tmp_path / folder)


def _lines(folder):
    return [json.loads(line) for line in (folder / "generations.jsonl").read_text().splitlines()]


def _interrupt_after(monkeypatch, batches):
    real = batch.generate_rows
    calls = []

    def generate_rows(*args, **kwargs):
        if len(calls) == batches:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(batch, "generate_rows", generate_rows)


def test_interrupted_run_keeps_finished_batches_and_resume_completes_it(tmp_path, monkeypatch):
    whole = _run(tmp_path, "whole")
    expected = _lines(tmp_path / "whole")
    assert [r["prompt"] for r in expected] == PROMPTS
    with monkeypatch.context() as m:
        _interrupt_after(m, 2)
        with pytest.raises(KeyboardInterrupt):
            _run(tmp_path, "cut")
    assert _lines(tmp_path / "cut") == expected[:4]  # two finished batches, on disk before the interruption
    resumed = _run(tmp_path, "second", f"resume={tmp_path / 'cut'}")
    assert _lines(tmp_path / "cut") == expected and resumed.token_ids == whole.token_ids
    assert resumed.figures["prompts"] == 2  # only the last batch was generated again


def test_torn_last_line_and_unfinished_batch_are_generated_again(tmp_path):
    _run(tmp_path, "whole")
    expected = _lines(tmp_path / "whole")
    folder = tmp_path / "whole"
    raw = (folder / "generations.jsonl").read_bytes().split(b"\n")
    # three whole lines (one batch and half of the next) and a fourth cut short by a kill
    (folder / "generations.jsonl").write_bytes(b"\n".join(raw[:3]) + b"\n" + raw[3][:7])
    resumed = _run(tmp_path, "again", f"resume={folder}")
    assert _lines(folder) == expected and resumed.figures["prompts"] == 4


@pytest.mark.slow  # whole runs (the quick subset stays under a minute)
def test_resume_refuses_other_prompts_settings_and_foreign_lines(tmp_path):
    _run(tmp_path, "whole")
    folder = tmp_path / "whole"
    with pytest.raises(ConfigError, match="other max_new_tokens"):
        _run(tmp_path, "x", f"resume={folder}", "max_new_tokens=4")
    (tmp_path / "prompts.txt").write_text("another prompt\n")
    with pytest.raises(ConfigError, match="other prompts"):
        _run(tmp_path, "x", f"resume={folder}")
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    lines = (folder / "generations.jsonl").read_text().splitlines()
    lines[1] = json.dumps({"prompt": "not ours", "text": "", "token_ids": []})
    (folder / "generations.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="line 2 of generations.jsonl"):
        _run(tmp_path, "x", f"resume={folder}")
    with pytest.raises(ConfigError, match="already holds generations"):
        _run(tmp_path, "whole")  # the same folder without resume: the finished prompts are never overwritten
    with pytest.raises(ConfigError, match="not a folder"):
        _run(tmp_path, "x", f"resume={tmp_path / 'missing'}")
