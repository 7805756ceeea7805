"""``run(command, ...)``: ``subprocess.run`` for the tests, where a ``python <script>.py …`` or ``python -m
offload_core …`` child starts from an interpreter that has already imported what every job imports; ``shim(env)``:
the ``python`` with which a shell (the docs' blocks, conftest.py) or a ``Popen`` (the serve tests' servers) gets the
same, its ``python -c …`` too.

A job's process spends about 4 of its 5 CPU seconds importing torch, transformers' modelling code, Hydra and
offload_core; the suite starts a few hundred. Each test worker keeps a *preloaded* interpreter per import-time
environment (started at first use) that imports those modules once, listens on a Unix socket and forks a child per
command: the child takes the command's standard streams (passed over the socket), working folder, environment,
``sys.path`` (the script's folder, then ``PYTHONPATH``) and arguments, runs the script or module as ``__main__``
and exits as an interpreter does (its threads joined, its ``atexit`` functions run); its exit status goes back over
the socket, and a client that goes away (killed) takes its child with it. What differs from a fresh interpreter is
only when those modules were imported, so the variables read while importing them (``HF_*``, ``TRANSFORMERS_*``,
``OMP_*``, ``PYTHON*``, …) pick the interpreter: a command that sets another value gets one of its own. Tests of what
only a fresh process shows (its imports, peak memory, SIGKILL, warnings printed while importing, running as users do:
tests/end_to_end/test_as_users_run.py) call ``subprocess`` themselves.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import re
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

from tests import ROOT
from tests import preloaded_client as client

#: what every job imports before it reads its arguments (run.py's import, transformers' models), and what nearly
#: every job imports next (its generation, the Auto classes, Llama's modelling, the runner's job: a fifth of a
#: second a command, over a hundred commands a worker)
PRELOAD = (
    "offload_core.runner.cli",
    "transformers.modeling_utils",
    "transformers.generation.utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama",
    "offload_core.runner.job",
)
#: variables that a preloaded module may read while it is imported: a command that sets another value runs fresh
IMPORT_TIME = re.compile(
    r"^(HF_|HUGGINGFACE|TRANSFORMERS|TORCH|PYTORCH|OMP_|MKL_|KMP_|OPENBLAS|CUDA|TOKENIZERS|"
    r"DIFFUSERS|XDG_|HOME$|PYTHON|LD_|LANG|LC_)"
)
#: set by ``run(..., nested=True)``: the ``sys.executable`` its child sees (the shim)
EXECUTABLE_ENV = "OFFLOAD_CORE_TEST_PRELOADED_EXECUTABLE"
#: handled by the child itself, as a fresh interpreter would (tokenizers reads TOKENIZERS_PARALLELISM when it first
#: splits work, not while it is imported: bench/diffusion.py gives its runs that value, and they fork too)
CHILD_HANDLES = {"PYTHONPATH", "PYTHONUNBUFFERED", "TOKENIZERS_PARALLELISM"}

SERVER = r"""
import importlib, sys
sys.path.insert(0, sys.argv[1])
from tests.preloaded import serve
serve(sys.argv[2], sys.argv[1], sys.argv[3:])
"""


def _key(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if IMPORT_TIME.match(k) and k not in CHILD_HANDLES))


def serve(path: str, root: str, modules: list[str]) -> None:
    """The preloaded interpreter: import ``modules``, then fork a child per connection to socket ``path``; send each
    connection its child's pid, later its exit status. Once its standard input closes (its test worker ended or
    closed it), it takes no more and ends when its children have."""
    before = dict(os.environ)
    key = _key(before)
    for name in modules:
        importlib.import_module(name)
    base_path = [p for p in sys.path if p not in ("", root)]
    # what those imports set in the environment (OpenBLAS' settings, …): a fresh interpreter's imports set it too
    imported_env = {k: v for k, v in os.environ.items() if k not in before}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # the path appears listening: a client never finds it before it listens
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting: dict[int, socket.socket] = {}
    worker = [sys.stdin]  # open while its test worker is: then it ends once its children have
    while worker or waiting:
        conns = {conn: pid for pid, conn in waiting.items()}
        ready = select.select([listener, wake_r, *worker, *conns], [], [])[0]
        if worker and worker[0] in ready and not os.read(sys.stdin.fileno(), 1):
            worker.clear()
        if wake_r in ready:
            os.read(wake_r, 4096)
        for conn in set(ready) & set(conns):  # its client is gone (killed, or it gave up waiting): so is the child
            if not conn.recv(1):
                os.kill(conns[conn], signal.SIGKILL)
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            with waiting.pop(pid) as conn:
                try:
                    conn.sendall(b"%d\n" % os.waitstatus_to_exitcode(status))
                except OSError:
                    pass
        if listener in ready and worker:
            conn, _ = listener.accept()
            head, fds, _, _ = socket.recv_fds(conn, 8, 3)
            size, data = int.from_bytes(head, "little"), b""
            while len(data) < size:
                data += conn.recv(size - len(data))
            request = json.loads(data)
            if _key({k: v for k, v in request["env"].items() if imported_env.get(k) != v}) != key:
                conn.sendall(b"0\n")
                conn.close()
            elif (pid := os.fork()) == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (listener.fileno(), conn.fileno(), wake_r, wake_w, *(c.fileno() for c in conns)):
                    os.close(fd)
                _child(request, fds, base_path, imported_env)
            else:
                conn.sendall(b"%d\n" % pid)
                waiting[pid] = conn
            for fd in fds:
                os.close(fd)


class _Preloaded:
    """One preloaded interpreter of this test worker, listening on a socket in a folder of its own."""

    def __init__(self, env: dict[str, str]) -> None:
        env = {k: v for k, v in env.items() if k not in CHILD_HANDLES and not k.startswith(client.SOCKET_ENV)}
        self.key = _key(env)
        self.folder = tempfile.mkdtemp(prefix="preloaded-")
        self.path = os.path.join(self.folder, "socket")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(ROOT), self.path, *PRELOAD],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,  # not a terminal: its children's streams are buffered as a fresh one's
            stderr=subprocess.DEVNULL,
            cwd=ROOT,
            env=env,
        )
        while not os.path.exists(self.path):
            if self.proc.poll() is not None:
                raise RuntimeError("the preloaded interpreter did not start")
            time.sleep(0.05)

    def shim_env(self) -> dict[str, str]:
        """What a shell block's environment needs for its ``python`` to be the shim in :attr:`folder`."""
        shim = os.path.join(self.folder, "python")
        if not os.path.exists(shim):
            source = (ROOT / "tests" / "preloaded_python.py").read_text()
            Path(shim).write_text(f"#!{sys.executable} -IS\n{source}")
            os.chmod(shim, 0o755)
        return {
            client.SOCKET_ENV: self.path,
            "OFFLOAD_CORE_TEST_PRELOADED_DIR": str(ROOT / "tests"),
            "OFFLOAD_CORE_TEST_PRELOADED_PYTHON": sys.executable,
            "PATH": self.folder + os.pathsep + os.environ.get("PATH", ""),
        }

    def close(self) -> None:
        """It takes no more commands, and ends once those it runs have."""
        self.proc.stdin.close()
        shutil.rmtree(self.folder, ignore_errors=True)


#: this worker's preloaded interpreters by the import-time environment they were started with, the latest last
_servers: dict[tuple, _Preloaded] = {}
#: how many it keeps (a test that sets such a variable starts one; a worker whose environment changed, another); the
#: one of the worker's own environment, which most commands use, is the last to go
KEPT = 3


def server(env: dict[str, str] | None = None) -> _Preloaded:
    """This worker's preloaded interpreter for environment ``env`` (this process's by default), started at first
    use."""
    env = dict(os.environ if env is None else env)
    key = _key(env)
    found = _servers.pop(key, None)
    if found is None or found.proc.poll() is not None:
        found = _Preloaded(env)
        atexit.register(found.close)
    _servers[key] = found
    own = _key(dict(os.environ))
    while len(_servers) > KEPT:
        _servers.pop(next((k for k in _servers if k != own), next(iter(_servers)))).close()
    return found


def shim(env: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The ``python`` and environment with which a ``Popen`` of ``python <script>.py …`` forks from the preloaded
    interpreter: the signals it gets go to the child, it ends as the child does, and the child dies with it."""
    found = server(env)
    return os.path.join(found.folder, "python"), {**env, **found.shim_env()}


def run(
    command,
    *,
    cwd=None,
    env=None,
    timeout=None,
    input=None,
    capture_output=False,
    text=False,
    check=False,
    nested=False,
):
    """As ``subprocess.run``; a captured ``python <script>.py …`` or ``python -m offload_core …`` forks from the
    preloaded interpreter. ``nested``: the child's ``sys.executable`` is the shim, so that the ``python`` commands it
    starts itself (a benchmark's runs) fork too."""
    command = [str(part) for part in command]
    env = dict(os.environ if env is None else env)

    def fresh() -> subprocess.CompletedProcess:
        return subprocess.run(
            command, cwd=cwd, env=env, timeout=timeout, input=input, capture_output=capture_output, text=text,
            check=check,
        )  # fmt: skip

    if not (capture_output and command[0] == sys.executable and client.routable(command[1:])):
        return fresh()
    if nested:
        python, env = shim(env)
        env[EXECUTABLE_ENV] = python
    cwd = os.path.abspath(cwd or os.getcwd())
    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        stdin.write(input.encode() if isinstance(input, str) else input or b"")
        stdin.seek(0)
        conn, pid = client.start(server(env).path, command[1:], cwd, env, [f.fileno() for f in (stdin, stdout, stderr)])
        with conn:
            if not pid:
                return fresh()
            code = client.wait(conn, timeout)
            if code is None:
                os.kill(pid, signal.SIGKILL)
                client.wait(conn, None)
                raise subprocess.TimeoutExpired(command, timeout)
        out, err = (f.seek(0) or f.read() for f in (stdout, stderr))
    if text:
        out, err = out.decode(), err.decode()
    done = subprocess.CompletedProcess(command, code, out, err)
    if check:
        done.check_returncode()
    return done


def _child(request: dict, fds: list[int], base_path: list[str], imported_env: dict[str, str]) -> None:
    """In the forked child: take the command's streams, folder, environment and path, run it, exit with its status."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    env = request["env"]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**imported_env, **env})
    if env.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    tempfile.tempdir = None
    importlib.invalidate_caches()  # what was installed since the interpreter started is found, as afresh
    argv = request["argv"]
    module = argv[1] if argv[0] == "-m" else None
    source = argv[1] if argv[0] == "-c" else None  # ``python -c`` (a docs block's): its folder is "", as afresh
    first = "" if source is not None else os.getcwd() if module else os.path.dirname(os.path.realpath(argv[0]))
    extra = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *base_path]
    sys.argv = argv[1:] if module else ["-c", *argv[2:]] if source is not None else list(argv)
    sys.executable = env.get(EXECUTABLE_ENV, sys.executable)
    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        elif source is not None:
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(source, "<string>", "exec"), main.__dict__)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)
