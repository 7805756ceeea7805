"""A 2 x 2 sweep through Hydra's Ray launcher on a loopback Ray cluster gives the same summary as the basic launcher."""

from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from offload_core.runner.sweep import COLUMNS

from tests import ROOT, preloaded

pytestmark = pytest.mark.slow

RAY_CLI = Path(sys.executable).parent / "ray"
SWEEP = [
    "model=synthetic",
    "model.preset=tiny",
    "progress=false",
    "max_new_tokens=2",
    "headroom=0",
    "max_memory.cpu=1MiB",
    "headroom=0",
    "storage=memmap,safetensors",
    "hook=align_per_call,chained",
]
#: columns that do not depend on timing or on the machine's memory
STABLE = [
    "job",
    "placement",
    "storage",
    "hook",
    "model",
    "overrides",
    "status",
    "matches_in_memory",
    "bytes_moved_per_token",
    "error",
]
#: Ray otherwise swaps 127.0.0.1 for the machine's outward address; with this the head node and its
#: agents advertise and listen on loopback only.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


try:
    import hydra_plugins.hydra_ray_launcher.ray_launcher  # noqa: F401
    import ray  # noqa: F401
except ImportError as exc:
    pytest.skip(
        f"Ray or its Hydra launcher cannot be imported ({exc}); pip install -e '.[ray]'", allow_module_level=True
    )
if not RAY_CLI.exists():
    pytest.skip(f"the ray command is not beside {sys.executable}", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return {**os.environ, **LOOPBACK_ENV}


@pytest.fixture(scope="module")
def ray_address():
    """A one-node Ray cluster on 127.0.0.1 with 2 CPUs; stopped at the end, also when starting it failed."""
    port = _free_port()
    try:
        subprocess.run(
            [
                str(RAY_CLI),
                "start",
                "--head",
                "--node-ip-address=127.0.0.1",
                f"--port={port}",
                "--num-cpus",
                "2",
                "--include-dashboard=false",
                "--disable-usage-stats",
            ],
            env=_env(),
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        )
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([str(RAY_CLI), "stop", "--force"], env=_env(), capture_output=True, timeout=120)


def _sweep(cwd: Path, *hydra_overrides: str) -> tuple[subprocess.CompletedProcess, list[dict[str, str]]]:
    sweep_dir = cwd / "sweep"
    proc = preloaded.run(
        [sys.executable, str(ROOT / "run.py"), "-m", *SWEEP, *hydra_overrides, f"hydra.sweep.dir={sweep_dir}"],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc, _summary(sweep_dir)


def _basic_sweep(cwd: Path, capsys) -> list[dict[str, str]]:
    """The same sweep through the basic launcher, in this process (which runs its jobs in the process that starts it;
    such a sweep as users start it, a process: tests/end_to_end/test_as_users_run.py)."""
    from offload_core.runner.cli import hydra_main

    sweep_dir, argv = cwd / "sweep", sys.argv
    sys.argv = ["run.py", "-m", *SWEEP, f"hydra.sweep.dir={sweep_dir}"]
    try:
        hydra_main()
    except SystemExit as exit_:
        assert not exit_.code, capsys.readouterr().err[-3000:]
    finally:
        sys.argv = argv
    return _summary(sweep_dir)


def _summary(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len((sweep_dir / "summary.md").read_text().splitlines()) == 2 + len(rows)
    return rows


def test_ray_launcher_sweep_has_the_basic_launchers_summary(ray_address, tmp_path, capsys):
    (tmp_path / "ray").mkdir()
    (tmp_path / "basic").mkdir()
    # The launcher asks ray.init for a small object store, which Ray refuses when joining a running
    # cluster; null leaves the cluster's own.
    proc, ray_rows = _sweep(
        tmp_path / "ray",
        "hydra/launcher=ray",
        f"hydra.launcher.ray.init.address={ray_address}",
        "+hydra.launcher.ray.init.object_store_memory=null",
    )
    out = proc.stdout + proc.stderr
    assert "Ray Launcher is launching 4 jobs" in out
    assert f"Connecting to existing Ray cluster at address: {ray_address}" in out
    basic_rows = _basic_sweep(tmp_path / "basic", capsys)

    assert list(ray_rows[0]) == list(basic_rows[0]) == COLUMNS
    assert len(ray_rows) == len(basic_rows) == 4
    assert [r["status"] for r in ray_rows] == ["ok"] * 4, [r["error"] for r in ray_rows]
    assert [[r[c] for c in STABLE] for r in ray_rows] == [[r[c] for c in STABLE] for r in basic_rows]
    assert {(r["storage"], r["hook"]) for r in ray_rows} == {
        (s, h) for s in ("memmap", "safetensors") for h in ("align_per_call", "chained")
    }
