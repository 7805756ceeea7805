"""The package as a wheel: pyproject.toml lists every package folder, and a wheel built from the sources installs and
runs ``python -m offload_core --help`` and the main job from outside the checkout (its configs travel inside it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib

import pytest

from tests import ROOT


def _listed() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


def test_every_package_folder_is_listed():
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "offload_core").rglob("__init__.py")}
    missing = folders - _listed()
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


@pytest.mark.slow
def test_a_built_wheel_installs_and_runs_the_main_job(tmp_path):
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("offload_core", "plugins", "conf"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", source], check=True)
    (wheel,) = (tmp_path / "dist").glob("offload_core-*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", site, wheel], check=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    away = tmp_path / "elsewhere"
    away.mkdir()

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "offload_core", *args],
            cwd=away,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    where = subprocess.run(
        [sys.executable, "-c", "import offload_core; print(offload_core.__file__)"],
        cwd=away,
        env=env,
        text=True,
        capture_output=True,
    )
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr
    helped = run("--help")
    assert helped.returncode == 0 and "plugins" in helped.stdout, helped.stderr
    job = run("run", "progress=false", "max_new_tokens=4", f"hydra.run.dir={tmp_path / 'out'}")
    assert job.returncode == 0, job.stderr[-3000:]
    assert "offload_core: error" not in job.stderr
    assert (tmp_path / "out" / "metrics.json").is_file()
