"""What the end-to-end tests share: ``run.py`` run in this process or in a child, its one error line checked, and
a folder's files fingerprinted."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from offload_core.runner.cli import hydra_main
from offload_core.storage.folder import INDEX

from tests import ROOT

HYDRA_HINT = "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace."


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (hidden ones included) by relative path -> sha256 of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def cli_said(args: list[str], tmp_path: Path, capsys) -> tuple[int, str, str]:
    """Run ``run.py args`` in this process; return (exit code, stdout, stderr): what the test printed since it last
    read ``capsys`` too."""
    argv = ["run.py", "progress=false", "max_new_tokens=2", f"hydra.run.dir={tmp_path / 'hydra'}", *args]
    old = sys.argv
    sys.argv = argv
    try:
        hydra_main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.argv = old
    said = capsys.readouterr()
    return code, said.out, said.err


def cli(args: list[str], tmp_path: Path, capsys) -> tuple[int, str]:
    """Run ``run.py args`` in this process; return (exit code, stderr)."""
    code, _, err = cli_said(args, tmp_path, capsys)
    return code, err


def assert_one_line(err: str, *parts: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("offload_core: error: ")]
    assert len(lines) == 1, err
    for part in parts:
        assert part in lines[0], lines[0]
    assert "Traceback" not in err


def run_args(ckpt: Path, folder: Path | None = None) -> list[str]:
    args = ["model=local", "storage=memmap", f"model.path={ckpt}", "max_memory.cpu=1KiB", "headroom=0"]  # all on disk
    return args + ([f"offload_folder={folder}"] if folder is not None else [])


def run_metrics(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "hydra" / "metrics.json").read_text())


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "tests") + os.pathsep + str(ROOT), "PYTHONUNBUFFERED": "1"}


def wait_for_line(proc: subprocess.Popen, wanted: str, timeout: float = 200) -> str:
    """The first line of ``proc``'s stdout that holds ``wanted``; fails (killing ``proc``) once ``timeout`` seconds
    pass without it, even while the process prints nothing (a reader thread reads, this waits on a queue). The
    default bounds a hang, not a speed: a process that imports torch and calibrates took 70 s to reach its load on a
    2-core machine at load average 20."""
    lines: queue.Queue[str | None] = queue.Queue()
    reader = getattr(proc, "_line_reader", None)
    if reader is None:

        def read() -> None:
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        reader = proc._line_reader = (threading.Thread(target=read, daemon=True), lines)
        reader[0].start()
    lines = reader[1]
    deadline = time.monotonic() + timeout
    seen = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if wanted in line:
            return line
    proc.kill()
    _, err = proc.communicate(timeout=30)
    raise AssertionError(f"never saw {wanted!r} in {timeout} s; stdout: {''.join(seen)[-2000:]}; stderr: {err[-2000:]}")


GENERATING_SCRIPT = textwrap.dedent("""
    import sys
    from transformers.generation.utils import GenerationMixin
    real = GenerationMixin.generate

    def announced(self, *args, **kwargs):
        caller = sys._getframe(1)
        while caller is not None and caller.f_globals.get("__name__") != "offload_core.plan.probe":
            caller = caller.f_back
        if caller is None:  # the run's generation, not the calibration probe's (a model of two blocks, in memory)
            print("GENERATING", flush=True)
        return real(self, *args, **kwargs)

    GenerationMixin.generate = announced
    from offload_core.runner.cli import hydra_main
    sys.argv = ["run.py", *sys.argv[1:]]
    hydra_main()
""")


def signal_after_load(tiny: Path, tmp_path: Path, sig: int) -> tuple[int, str, Path]:
    """Start a long run of ``tiny`` with its temporary files under ``tmp_path/tmp``, send ``sig`` once generation
    has started (the run prints GENERATING as it enters ``generate``), and return its exit code, stderr and that
    scratch folder."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            GENERATING_SCRIPT,
            *run_args(tiny),
            "max_new_tokens=1500",
            "progress=false",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**child_env(), "TMPDIR": str(scratch)},
        cwd=ROOT,
        # As a terminal's foreground job: a suite started in the background (`cmd &`) has SIGINT ignored, which
        # its children would inherit, and Python then never raises KeyboardInterrupt.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    wait_for_line(proc, "GENERATING")
    assert any((p / INDEX).exists() for p in scratch.glob("offload_core-*")), "generation started before the store"
    proc.send_signal(sig)
    proc._line_reader[0].join(timeout=60)  # stdout closes as the process exits
    try:
        proc.wait(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, proc.stderr.read(), scratch
