"""The example plugin package (examples/interleaved_placement), pip-installed into a temporary folder, works end to end.

The package goes to a ``pip install --target`` folder put on ``PYTHONPATH`` for subprocesses only, so the
test environment itself is left as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from tests import ROOT, preloaded

EXAMPLE = ROOT / "examples" / "interleaved_placement"
RUN = [sys.executable, str(ROOT / "run.py"), "model=synthetic", "progress=false", "max_new_tokens=4"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("example_plugin")
    source = tmp / "source"  # build from a copy: pip leaves build/ and *.egg-info next to the sources
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp / "site"
    proc = preloaded.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    path = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HYDRA_FULL_ERROR": "0"}
    env.pop("OFFLOAD_CORE_DISABLE_PLUGINS", None)
    return env


def _run(args, env, cwd):
    return preloaded.run(args, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_placement_interleaved_runs(env, tmp_path):
    out = tmp_path / "run"
    proc = _run(
        [*RUN, "placement=interleaved", "placement.k=2", "compare_in_memory=true", f"hydra.run.dir={out}"],
        env,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    device_map = json.loads((out / "device_map.json").read_text())
    layers = [device_map.get(f"model.layers.{i}") for i in range(4)]
    assert layers == ["cpu", "disk", "cpu", "disk"], device_map
    assert json.loads((out / "metrics.json").read_text())["matches_in_memory"] is True


def test_a_wrong_type_for_k_fails_at_compose_time(env, tmp_path):
    proc = _run([*RUN, "placement=interleaved", "placement.k=abc", f"hydra.run.dir={tmp_path / 'run'}"], env, tmp_path)
    assert proc.returncode != 0
    assert "placement.k" in proc.stderr and "abc" in proc.stderr
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_plugins_command_lists_it_with_its_version(env, tmp_path):
    proc = _run([sys.executable, "-m", "offload_core", "plugins"], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("interleaved "))
    assert "0.1.0" in line and "placement=interleaved" in line


def test_disabling_it_by_name_removes_it(env, tmp_path):
    off = {**env, "OFFLOAD_CORE_DISABLE_PLUGINS": "interleaved"}
    listed = _run([sys.executable, "-m", "offload_core", "plugins"], off, tmp_path)
    assert listed.returncode == 0 and "interleaved" not in listed.stdout.replace("DISABLE_PLUGINS", "")
    proc = _run([*RUN, "placement=interleaved", f"hydra.run.dir={tmp_path / 'run'}"], off, tmp_path)
    assert proc.returncode != 0
    assert "placement=interleaved is not an option of placement" in proc.stderr


def test_the_example_package_own_tests_pass(env, tmp_path):
    proc = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests")], env, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
