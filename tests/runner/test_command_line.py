"""The command line as users type it: unknown keys refused in one line, the listing's names are the ones the command
line takes, prompts with commas and apostrophes read as typed, a GPU budget without ``+``; ``offload-core run`` is
``run.py``; the sweep tool's ``--help``; a plan-only sweep compares plans."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from offload_core.errors import ConfigError
from offload_core.runner.overrides import check_parses, prepare
from offload_core.runner.config import register_configs

from tests import ROOT


def _cfg(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=overrides)


def _main(argv, capsys, monkeypatch):
    from offload_core.__main__ import main

    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    "given, hint",
    [
        ("+foo=bar", "unknown key 'foo'"),
        ("policy=prefetch", "use hook=prefetch"),
        ("+policy=prefetch", "use hook=prefetch"),
    ],
)
def test_unknown_keys_are_refused_in_one_line(given, hint, tmp_path, capsys, monkeypatch):
    code, out, err = _main(["run", given, f"hydra.run.dir={tmp_path}"], capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1 and err.startswith("offload_core: error: ") and hint in err, err
    assert out == "" and not any(tmp_path.iterdir())


def test_a_composed_config_with_an_unknown_key_is_refused():
    from offload_core.runner.settings import read_settings

    with pytest.raises(ConfigError, match="unknown key 'foo'"):
        read_settings(_cfg(["model=synthetic", "+foo=bar"]))


@pytest.mark.parametrize("prompt", ["Hi, who are you?", "What's 2+2?", "a\\b'c${x}\\", 'say "yes", or [no]'])
def test_prompts_are_read_as_typed(prompt):
    assert _cfg(prepare([f"prompt={prompt}"])).prompt == prompt


def test_a_prompt_hydra_cannot_read_in_a_sweep_says_how_to_quote():
    with pytest.raises(ConfigError, match=r"""quote the value for Hydra.*e.g. "prompt=\\"What's 2\+2\?\\"\""""):
        check_parses(prepare(["-m", "prompt=What's 2+2?"]))
    assert prepare(["-m", "prompt=a,b"]) == ["-m", "prompt=a,b"]  # a comma sweeps in a multirun


@pytest.mark.parametrize(
    "given, shown",
    [
        ("prompt=Paris, France", "'prompt=\"Paris, France\"'"),
        ("prompt=What's Paris, then?", '"prompt=\\"What\'s Paris, then?\\""'),
        ("pipeline.negative_prompt=blurry, dark", "'pipeline.negative_prompt=\"blurry, dark\"'"),
    ],
)
def test_a_swept_text_with_a_comma_and_a_space_is_refused_with_its_quoted_form(given, shown):
    with pytest.raises(ConfigError) as caught:
        prepare(["-m", given])
    message = str(caught.value)
    assert "in a sweep (-m) is split at its commas into 2 jobs" in message and f"e.g. {shown};" in message
    key = given.split("=")[0]
    typed = shown[1:-1].replace('\\"', '"')  # what the shell hands over
    assert check_parses(prepare(["-m", typed])) is None
    assert OmegaConf.select(_cfg(prepare([typed])), key) == given.split("=", 1)[1]


@pytest.mark.parametrize("swept", ['prompt="Paris, France","Lyon"', "prompt=Paris,Lyon", "prompt=choice(a, b)"])
def test_a_sweep_written_unambiguously_passes_as_typed(swept):
    assert prepare(["-m", swept]) == ["-m", swept]


def test_a_single_runs_negative_prompt_is_read_as_typed():
    assert _cfg(prepare(["pipeline.negative_prompt=blurry, dark"])).pipeline.negative_prompt == "blurry, dark"


def test_a_gpu_budget_needs_no_plus():
    cfg = _cfg(prepare(["max_memory.0=10GiB", "max_memory.cpu=1GiB"]))
    assert cfg.max_memory["0"] == "10GiB" and cfg.max_memory.cpu == "1GiB"


def test_plugins_lists_the_names_the_command_line_takes(capsys, monkeypatch):
    code, out, _ = _main(["plugins"], capsys, monkeypatch)
    assert code == 0 and "hook=prefetch" in out and "policy=" not in out
    _cfg(["hook=prefetch"])  # the listed name is the one the command line takes


def test_offload_core_run_is_the_main_job(tmp_path, capsys, monkeypatch):
    code, out, err = _main(
        ["run", "model=synthetic", "plan_only=true", "max_memory.cpu=1MiB", "headroom=0", f"hydra.run.dir={tmp_path}"],
        capsys,
        monkeypatch,
    )
    assert code in (0, None) and "plan only: nothing was loaded" in out, err
    assert json.loads((tmp_path / "metrics.json").read_text())["plan_only"] is True


def test_sweep_tool_help_and_a_wrong_folder(tmp_path, capsys):
    from offload_core.runner.sweep import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "sweep_dir" in capsys.readouterr().out
    assert main([str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith("offload_core: error: ")


def test_a_plan_only_sweep_compares_plans(tmp_path):
    from offload_core.runner.job import run
    from offload_core.runner.sweep import summarize

    for job, budget in (("0", "1MiB"), ("1", "3MiB")):
        cfg = _cfg(["model=synthetic", "plan_only=true", f"max_memory.cpu={budget}", "headroom=0"])
        run(
            cfg,
            output_dir=tmp_path / job,
            labels={"choices": {"model": "synthetic"}, "overrides": [budget]},
            plot=False,
        )
    rows = summarize(tmp_path)
    assert [r["status"] for r in rows] == ["planned", "planned"]
    assert rows[0]["offloaded_mib"] > 0 == rows[1]["offloaded_mib"]
    assert all(isinstance(r["predicted_step_s"], float) for r in rows)


def test_a_device_map_file_replaces_the_placement_in_the_header(tmp_path, capsys):
    from offload_core.runner.job import run

    base = ["model=synthetic", "plan_only=true", "max_memory.cpu=1MiB", "headroom=0"]
    run(_cfg(base), output_dir=tmp_path / "a", plot=False)
    capsys.readouterr()
    path = tmp_path / "a" / "device_map.json"
    run(_cfg([*base, f"device_map={path}"]), output_dir=tmp_path / "b", plot=False)
    header = capsys.readouterr().out.splitlines()[0]
    assert header == f"device_map={path} storage=safetensors hook=align_per_call"


def test_counters_print_sizes_in_binary_units():
    from offload_core.jobs.results import counter_text

    assert (
        counter_text("kept_bytes", 3 * 2**20) == "3.00 MiB"
        and counter_text("expert_bytes_per_token", 1536.0) == "1.50 KiB"
    )
    assert counter_text("hits", 5) == "5" and counter_text("wait_s_per_token", 0.25) == "0.250"


def test_a_sweep_summary_names_metrics_of_another_shape_instead_of_failing(tmp_path):
    from offload_core.runner.sweep import summarize

    for job, content in (
        ("0", "[1, 2]"),
        (
            "1",
            json.dumps(
                {"choices": "x", "overrides": 3, "load_s": "slow", "peak_anon_rss_bytes": "lots", "peak_gpu_bytes": [1]}
            ),
        ),
        ("2", "\udcff"),
    ):
        (tmp_path / job).mkdir()
        (tmp_path / job / "metrics.json").write_text(content, errors="surrogateescape")
    rows = summarize(tmp_path)
    assert rows[0]["status"] == "failed" and "not a JSON object" in rows[0]["error"]
    assert rows[1]["status"] == "ok" and rows[1]["load_s"] == "" and rows[1]["peak_anon_rss_mib"] == ""
    assert rows[2]["status"] == "failed" and "not valid JSON" in rows[2]["error"]


def test_hydras_own_options_pass_through():
    args = ["-m", "hydra/launcher=joblib", "hydra.run.dir=x", "--config-name", "config", "+hydra.job.env_set.A=1"]
    assert prepare(args) == args


def test_the_sweep_tool_counts_the_failed_jobs_and_names_them(tmp_path, capsys):
    from offload_core.runner.sweep import main

    for job, metrics in (
        ("0", {"overrides": ["storage=memmap"], "load_s": 0.5}),
        ("1", {"overrides": ["storage=ssd"], "error": "storage=ssd is not an option"}),
    ):
        (tmp_path / job).mkdir()
        (tmp_path / job / "metrics.json").write_text(json.dumps(metrics))
    assert main([str(tmp_path)]) == 0  # it wrote the summary; the sweep itself exited 1
    assert capsys.readouterr().out.startswith("2 jobs ran, 1 failed: job 1 (storage=ssd) -> ")
