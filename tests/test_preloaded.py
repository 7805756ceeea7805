"""tests/preloaded.py: a command forked from the preloaded interpreter sees and leaves what a fresh interpreter does
(arguments, folder, environment, path, streams, exit status, threads joined and ``atexit`` run at exit), and a
command whose environment differs in what is read while importing runs afresh."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests import preloaded

pytestmark = pytest.mark.slow  # the preloaded interpreter imports torch and transformers once

SCRIPT = textwrap.dedent("""
    import atexit, os, sys, threading, time
    print("argv", sys.argv[1:], "main", __name__, "file", os.path.basename(__file__))
    print("path", sys.path[0] == os.path.dirname(os.path.realpath(__file__)), os.environ.get("PYTHONPATH") in sys.path)
    print("cwd", os.getcwd(), "env", os.environ.get("PRELOADED_TEST"), "stdin", sys.stdin.read())
    atexit.register(lambda: print("atexit ran"))
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
    print("to stderr", file=sys.stderr)
    print("preloaded", "torch" in sys.modules)
    sys.exit(int(sys.argv[1]))
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize("code", [0, 3])
def test_a_forked_command_behaves_as_a_fresh_one(script, tmp_path, code):
    env = {**os.environ, "PRELOADED_TEST": "yes", "PYTHONPATH": str(tmp_path / "lib")}
    command = [sys.executable, str(script), str(code), "two words"]
    kwargs = dict(cwd=tmp_path, env=env, input="in", capture_output=True, text=True, timeout=120)
    fresh = subprocess.run(command, **kwargs)
    forked = preloaded.run(command, **kwargs)
    assert "preloaded False" in fresh.stdout and "preloaded True" in forked.stdout  # it forked
    forked.stdout = forked.stdout.replace("preloaded True", "preloaded False")
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == code and "thread joined\natexit ran" in fresh.stdout


def test_an_uncaught_error_exits_1_with_its_traceback_and_a_hang_times_out(tmp_path):
    (tmp_path / "bad.py").write_text("raise ValueError('boom')\n")
    done = preloaded.run([sys.executable, str(tmp_path / "bad.py")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "ValueError: boom" in done.stderr
    (tmp_path / "hang.py").write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        preloaded.run([sys.executable, str(tmp_path / "hang.py")], capture_output=True, timeout=1)
    assert preloaded.run([sys.executable, "-m", "offload_core", "--help"], capture_output=True).returncode == 0


def test_a_variable_read_while_importing_is_the_commands_own(tmp_path):
    """huggingface_hub reads HF_HUB_OFFLINE as it is imported: each value gets a preloaded interpreter of its own
    (unset: the worker's own, which the suite's other commands use)."""
    (tmp_path / "offline.py").write_text("from huggingface_hub import constants\nprint(constants.HF_HUB_OFFLINE)\n")
    for value, expected in (("1", "True"), (None, "False")):
        env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
        env.update({"HF_HUB_OFFLINE": value} if value else {})
        command = [sys.executable, str(tmp_path / "offline.py")]
        done = preloaded.run(command, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.strip() == expected, done.stderr


def test_a_shell_finds_the_preloaded_python_which_passes_on_streams_signals_and_exit_status(script, tmp_path):
    """What the docs' shell blocks run (conftest.py): ``python`` first on their PATH forwards a signal to its child
    and ends as the child did; ``python -c`` forks too, its arguments and path as a fresh one's."""
    (tmp_path / "wait.py").write_text("import time\nprint('waiting', flush=True)\ntime.sleep(60)\n")
    python, env = preloaded.shim({**os.environ, "PRELOADED_TEST": "shell"})
    shell = f"""
        python {script} 4 arg <<< 'typed' || echo "exit $?"
        python -c 'import sys; print("forked", "tests.preloaded" in sys.modules, sys.path[0] == "", sys.argv)' a
        python {tmp_path / "wait.py"} > {tmp_path / "out"} & child=$!
        until grep -q waiting {tmp_path / "out"}; do sleep 0.1; done
        kill -TERM $child; wait $child || echo "ended $?"
    """
    done = subprocess.run(["bash", "-c", shell], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "argv ['4', 'arg'] main __main__ file script.py"
    assert f"cwd {tmp_path} env shell stdin typed" in lines and "exit 4" in lines and "to stderr" in done.stderr
    assert "thread joined" in lines and "atexit ran" in lines and lines[-1] == "ended 143"
    assert "forked True True ['-c', 'a']" in lines


def test_a_killed_client_takes_its_child_with_it(tmp_path):
    """SIGKILL cannot be passed on: the preloaded interpreter sees its client gone and kills the child itself."""
    (tmp_path / "wait.py").write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n")
    python, env = preloaded.shim(dict(os.environ))
    proc = subprocess.Popen([python, str(tmp_path / "wait.py")], env=env, stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    assert child != proc.pid
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}")
