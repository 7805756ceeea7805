"""What users bring, run as they run it (``python run.py``, ``python -m offload_core``, ``offload-core``, each a
process): a folder without its tokenizer stops in one line (in this process: tests/end_to_end/test_documented_inputs.py
runs that line's process; and runs with ``model.tokenizer=``), a swept prompt with a
comma stops in one line (and its quoted form is one job), a sweep with a failed job exits 1 naming it, a broken
third-party plugin is named with how to skip it, ``speculative=self`` suggests only what would change, ``--help``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from omegaconf import OmegaConf

from offload_core.loading import sources
from tests import ROOT, preloaded
from tests.end_to_end.helpers import cli_said
from tests.plugins_dist import install_distribution, placement_plugin
from tests.speculative import models

ERROR = "offload_core: error: "


def run_py(args: list[str], cwd: Path, env: dict[str, str] | None = None, *, module: bool = False):
    """``python run.py args`` (``python -m offload_core args`` with ``module``) in a process of its own."""
    command = [sys.executable, "-m", "offload_core"] if module else [sys.executable, str(ROOT / "run.py")]
    return preloaded.run(
        [*command, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def error_line(proc: subprocess.CompletedProcess | str) -> str:
    """The one ``offload_core: error:`` line of a process that failed (or of what a run in this process wrote to its
    stderr), without a traceback."""
    stderr = proc if isinstance(proc, str) else proc.stderr
    lines = [line for line in stderr.splitlines() if line.startswith(ERROR)]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0][len(ERROR) :]


# -- a folder without its tokenizer ---------------------------------------------------------------------------------


def test_a_tiny_bert_without_a_tokenizer_stops_in_one_line_as_the_tasks_recipe_says(tmp_path, capsys):
    config = transformers.BertConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128
    )
    transformers.BertForMaskedLM(config).save_pretrained(tmp_path / "tiny-bert")
    capsys.readouterr()
    code, out, err = cli_said(["model=local", f"model.path={tmp_path / 'tiny-bert'}"], tmp_path, capsys)
    assert code == 2 and out == "", out
    line = error_line(err)
    assert line.startswith(f"the checkpoint folder '{tmp_path / 'tiny-bert'}' holds no tokenizer (tokenizer.json")
    assert "model.tokenizer=<a folder or Hub repo id holding them>" in line
    # the docs quote the line as it is
    recipe = " ".join((ROOT / "docs" / "recipes" / "tasks.md").read_text().split())
    assert (
        "cannot read a prompt for them: it stops before planning with one line, `the checkpoint folder '…' " in recipe
    )
    quoted = (ROOT / "docs" / "troubleshooting.md").read_text().split("a checkpoint folder without its tokenizer")[1]
    shown = quoted.split("`")[1].removesuffix(" …")
    assert line.startswith(shown.split("'…'")[0]) and shown.split("'…'")[1] in line


def _without_tokenizer(folder: Path, into: Path) -> Path:
    """``folder``'s weights, config and generation config, hard-linked (copied across file systems), no tokenizer."""
    into.mkdir()
    for path in folder.iterdir():
        if path.name.startswith("tokenizer") or path.name == "chat_template.jinja" or not path.is_file():
            continue
        try:
            os.link(path, into / path.name)
        except OSError:
            shutil.copy2(path, into / path.name)
    return into


def test_smollm2_weights_without_the_tokenizer_stop_then_run_with_model_tokenizer(tmp_path, capsys):
    smollm2 = sources.smollm2_checkpoint()
    bare = _without_tokenizer(smollm2, tmp_path / "smol")
    common = ["model=local", f"model.path={bare}", "max_new_tokens=6", "progress=false"]
    code, _, err = cli_said(common, tmp_path / "refused", capsys)
    assert code == 2 and "holds no tokenizer" in error_line(err) and str(bare) in error_line(err)
    assert not list((tmp_path / "refused").rglob("metrics.json"))

    # the same folder with the tokenizer named: the chat template applied, the answer read back as text
    named = run_py([*common, f"model.tokenizer={smollm2}", f"hydra.run.dir={tmp_path / 'named'}"], tmp_path)
    assert named.returncode == 0, named.stderr[-3000:]
    got = json.loads((tmp_path / "named" / "metrics.json").read_text())
    assert got["text"] == "The capital of France is Paris" and got["text"] in named.stdout


# -- sweeps -----------------------------------------------------------------------------------------------------------


def test_a_swept_prompt_with_a_comma_stops_and_its_quoted_form_is_one_job(tmp_path):
    sweep = tmp_path / "sweep"
    common = ["model=synthetic", "plan_only=true", "progress=false", "headroom=0", f"hydra.sweep.dir={sweep}"]
    proc = run_py(["-m", "prompt=Paris, France", *common], tmp_path)
    assert proc.returncode == 2 and not sweep.exists() and "Launching" not in proc.stdout + proc.stderr
    line = error_line(proc)
    assert "split at its commas into 2 jobs (prompt=Paris, prompt=France)" in line
    assert "e.g. 'prompt=\"Paris, France\"'" in line

    # the form the line gives, and a job that fails: one job per value, the failure counted and named, exit 1
    proc = run_py(["-m", 'prompt="Paris, France"', "max_memory.cpu=1MiB,abc", *common], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    prompts = [OmegaConf.load(sweep / job / ".hydra" / "config.yaml").prompt for job in ("0", "1")]
    assert prompts == ["Paris, France", "Paris, France"] and not (sweep / "2").exists()
    summary = [line for line in proc.stdout.splitlines() if line.startswith("sweep summary: ")]
    assert summary == [
        f"sweep summary: 2 jobs ran, 1 failed: job 1 (max_memory.cpu=abc) -> {sweep}/summary.md (and .csv, .png)"
    ]
    line = error_line(proc)
    assert line.startswith("1 of 2 jobs of the sweep failed; job 1: max_memory.cpu='abc' is not a size")


# -- third-party plugins ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def broken_plugins(tmp_path_factory) -> Path:
    """Two installed distributions with ``offload_core`` entry points: ``lacking`` registers a placement without
    ``make_device_map``, ``broken`` names a module that does not exist."""
    site = tmp_path_factory.mktemp("site")
    files = {"lacking_plugin/__init__.py": placement_plugin(lacking=True)}
    install_distribution(site, "lacking_plugin", "1.0", {"lacking": "lacking_plugin"}, files)
    return install_distribution(site, "broken", "0.1", {"broken": "no_mod"})


def _with(site: Path, **extra: str) -> dict[str, str]:
    return {"PYTHONPATH": f"{site}{os.pathsep}{ROOT}", **extra}


def test_a_broken_plugin_is_named_with_why_and_how_to_skip_it(broken_plugins, tmp_path):
    listed = run_py(["plugins"], tmp_path, _with(broken_plugins), module=True)
    assert listed.returncode == 0, listed.stderr
    failed = {line.split()[0]: line for line in listed.stdout.splitlines() if " FAILED " in line}
    assert (
        "lacks make_device_map()" in failed["lacking"] and "OFFLOAD_CORE_DISABLE_PLUGINS=lacking" in failed["lacking"]
    )
    assert "No module named 'no_mod'" in failed["broken"] and "OFFLOAD_CORE_DISABLE_PLUGINS=broken" in failed["broken"]
    assert "storage=memmap" in listed.stdout  # the built-ins are all there

    plan = ["model=synthetic", "plan_only=true", "progress=false", "headroom=0", f"hydra.run.dir={tmp_path / 'r'}"]
    asked = run_py(["placement=every_other", *plan], tmp_path, _with(broken_plugins))
    assert asked.returncode == 2
    line = error_line(asked)
    assert line.startswith("placement=every_other is not an option of placement: use one of balanced")
    assert "plugin 'lacking' failed to load (placement 'every_other': EveryOther lacks make_device_map()" in line
    assert line.endswith("skip it with OFFLOAD_CORE_DISABLE_PLUGINS=lacking")

    default = run_py(plan, tmp_path, _with(broken_plugins))
    assert default.returncode == 0, default.stderr[-2000:]
    said = [line for line in default.stderr.splitlines() if "failed to load and is skipped" in line]
    assert len(said) == 2 and all("OFFLOAD_CORE_DISABLE_PLUGINS=" in line for line in said)


# -- speculative=self ---------------------------------------------------------------------------------------------


def test_speculative_self_suggests_another_placement_only_when_it_is_another(tmp_path):
    target = models.target(tmp_path / "target")
    args = [
        "model=local",
        f"model.path={target}",
        "model.tokenizer=bytes",
        "model.chat_template=false",
        "prompt=abcdabcdabcdabcd",
        "max_new_tokens=10",
        "max_memory.cpu=100KiB",
        "headroom=64KiB",
        "speculative=self",
        "speculative.layers=2",
        "plan_only=true",
        f"hydra.run.dir={tmp_path / 'r'}",
    ]
    default = error_line(run_py(args, tmp_path))  # placement=sequential, the default
    assert "speculative=self drafts with the first 2 layers" in default and "placement=" not in default
    balanced = error_line(run_py([*args, "placement=balanced"], tmp_path))
    assert "use placement=sequential" in balanced


# -- --help ---------------------------------------------------------------------------------------------------------


def test_help_says_each_thing_once_in_plain_text_and_names_the_command_used(tmp_path):
    script = Path(sys.executable).with_name("offload-core")
    runs = {
        "python run.py": run_py(["--help"], tmp_path),
        "python -m offload_core run": run_py(["run", "--help"], tmp_path, module=True),
    }
    if script.exists():
        runs["offload-core run"] = preloaded.run(
            [str(script), "run", "--help"], capture_output=True, text=True, timeout=300, cwd=tmp_path
        )
    for command, proc in runs.items():
        out = proc.stdout
        assert proc.returncode == 0, proc.stderr
        assert f"running it in memory. {command} [group=option ...]" in out
        assert f"  {command} -m 'prompt=\"Paris, France\"'" in out
        others = [c for c in runs if c != command and not command.startswith(c)]
        assert not any(f"{c} [group" in out or f"\n  {c} model=" in out for c in others), command
        speculative = out.split("speculative=\n")[1].split("\n\n")[0].splitlines()
        summaries = [line.split(None, 1)[1].split(" [")[0] for line in speculative]
        assert len(speculative) == 4 and len(set(summaries)) == 4, speculative
        assert "speculative=null" not in out and "PipelineConfig(" not in out and "{'" not in out
        assert "pipeline.num_inference_steps=20" in out and "max_memory={cpu: 200MiB}" in out
        assert "``" not in out and "docs/reference/" not in out
    main = run_py(["--help"], tmp_path, module=True)
    assert (
        main.returncode == 0 and "``" not in main.stdout and "python -m offload_core (or offload-core)" in main.stdout
    )
