"""The runner's side of tasks: the plan of a checkpoint saved with per-expert tensors reports what converting
costs, and one whose names match says so."""

from __future__ import annotations

from hydra import compose, initialize_config_dir

from offload_core.runner.job import run
from offload_core.runner.config import register_configs

from tests import ROOT


def _cfg(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=overrides)


def test_plan_reports_converted_tensors_and_their_cost(saved, tmp_path, capsys):
    cfg = _cfg(
        [
            "plan_only=true",
            "model=local",
            "model.tokenizer=bytes",
            f"model.path={saved('mixtral').path}",
            "max_memory.cpu=60KiB",
            "headroom=1KiB",
            "over_budget=warn",  # the tiny blocks are larger than the budget
        ]
    )
    result = run(cfg, output_dir=tmp_path, plot=False)
    out = capsys.readouterr().out
    built = [line for line in result.plan["conversion"] if "built from several checkpoint tensors" in line]
    assert len(built) == 1 and "6 tensor(s)" in built[0] and "KiB;" in built[0]
    assert "conversion: converted: model.layers.0.mlp.experts.down_proj" in out


def test_plan_of_a_checkpoint_whose_names_match_says_so(saved, tmp_path, capsys):
    cfg = _cfg(
        [
            "plan_only=true",
            "model=local",
            "model.tokenizer=bytes",
            f"model.path={saved('t5').path}",
            "max_memory.cpu=60KiB",
            "headroom=1KiB",
        ]
    )
    result = run(cfg, output_dir=tmp_path, plot=False)
    assert result.plan["conversion"] == ["checkpoint names match the model: nothing converted"]
    assert "conversion: checkpoint names match the model" in capsys.readouterr().out


def test_an_encoder_plan_counts_bytes_per_forward_not_per_generated_token(saved, tmp_path, capsys):
    cfg = _cfg(
        [
            "plan_only=true",
            "model=local",
            "model.tokenizer=bytes",
            f"model.path={saved('bert').path}",
            "max_memory.cpu=60KiB",
            "headroom=1KiB",
        ]
    )
    run(cfg, output_dir=tmp_path, plot=False)
    out = capsys.readouterr().out
    assert "predicted bytes moved per forward:" in out and "per generated token" not in out
