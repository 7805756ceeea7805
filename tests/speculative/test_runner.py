"""``run.py speculative=...``: the figures in metrics.json, the printed result, the plan's estimate and the sweep's
columns; the draft's bytes taken from the budget; the refusals, each one line."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from offload_core.errors import ConfigError
from offload_core.runner.job import run
from offload_core.runner.config import register_configs
from offload_core.runner.sweep import job_row

from tests import ROOT
from tests.speculative import models


def _cfg(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=overrides)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative_runner")
    return {"target": models.target(root / "target"), "draft": models.draft(root / "draft")}


def _base(checkpoints, tmp_path, cpu="400KiB"):
    return [
        "model=local",
        "model.tokenizer=bytes",
        f"model.path={checkpoints['target']}",
        "model.chat_template=false",
        "prompt='abcdabcdabcdabcd'",
        "max_new_tokens=10",
        f"max_memory.cpu={cpu}",
        "headroom=64KiB",
        "progress=false",
        f"offload_folder={tmp_path / 'off'}",
    ]


def test_prompt_lookup_run_reports_its_figures_and_matches_memory(checkpoints, tmp_path, capsys):
    result = run(
        _cfg(
            _base(checkpoints, tmp_path)
            + ["speculative=prompt_lookup", "speculative.tokens=4", "compare_in_memory=true"]
        ),
        output_dir=tmp_path,
    )
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["speculative"] == "prompt_lookup" and metrics["generated_tokens"] == 10
    assert metrics["target_passes"] + metrics["accepted_tokens"] == 10
    assert metrics["tokens_per_pass"] == 10 / metrics["target_passes"]
    assert metrics["drafted_tokens"] >= metrics["accepted_tokens"] and "acceptance_rate" in metrics
    assert metrics["bytes_moved_per_token"] > 0
    assert metrics["matches_in_memory_speculative"] is True and result.matches_in_memory is not None
    assert metrics["tokens_differing_from_plain"] == sum(
        a != b for a, b in zip(metrics["token_ids"], metrics["in_memory_tokens"])
    )
    out = capsys.readouterr().out
    assert f"speculative=prompt_lookup: {metrics['tokens_per_pass']:.2f} tokens per pass" in out
    if "predicted_step_s" in metrics:  # the plan's estimate: the step divided by the expected tokens per pass
        assert metrics["predicted_s_per_token"] == pytest.approx(
            metrics["predicted_step_s"] / metrics["predicted_tokens_per_pass"]
        )
        assert "(estimate, assuming acceptance" in out
    row = job_row(tmp_path)
    assert row["speculative"] == "prompt_lookup" and row["tokens_per_pass"] == round(metrics["tokens_per_pass"], 4)


def test_plain_run_counts_one_token_per_pass(checkpoints, tmp_path):
    run(_cfg(_base(checkpoints, tmp_path)), output_dir=tmp_path)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["speculative"] == "none" and metrics["target_passes"] == 10 and metrics["tokens_per_pass"] == 1.0


def test_the_draft_is_taken_from_the_budget_before_the_target(checkpoints, tmp_path, capsys):
    draft = ["speculative=draft", f"speculative.path={checkpoints['draft']}", "plan_only=true"]
    plain = run(
        _cfg(_base(checkpoints, tmp_path, cpu="600KiB") + ["plan_only=true"]), output_dir=tmp_path / "a", plot=False
    )
    with_draft = run(_cfg(_base(checkpoints, tmp_path, cpu="600KiB") + draft), output_dir=tmp_path / "b", plot=False)
    resident = lambda result: result.summary["devices"].get("cpu", {}).get("bytes", 0)  # noqa: E731
    assert resident(with_draft) < resident(plain)
    assert "resident beside the target" in capsys.readouterr().out
    with pytest.raises(ConfigError) as caught:
        run(_cfg(_base(checkpoints, tmp_path, cpu="100KiB") + draft), output_dir=tmp_path / "c", plot=False)
    assert (
        "needs" in str(caught.value) and "raise max_memory.cpu" in str(caught.value) and "\n" not in str(caught.value)
    )


def test_refusals_are_one_line(checkpoints, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n")
    with pytest.raises(ConfigError) as caught:
        run(
            _cfg(_base(checkpoints, tmp_path) + ["speculative=prompt_lookup", f"prompts={prompts}"]),
            output_dir=tmp_path,
        )
    assert "one prompt at a time" in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        run(
            _cfg(
                _base(checkpoints, tmp_path, cpu="100KiB")
                + ["speculative=self", "speculative.layers=2", "plan_only=true"]
            ),
            output_dir=tmp_path,
            plot=False,
        )
    assert "speculative=self drafts with the first 2 layers" in str(caught.value) and "\n" not in str(caught.value)
