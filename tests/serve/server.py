"""Starting ``python run.py mode=serve`` as a process on a loopback port for the tests, and plain HTTP calls to it."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import threading
import time
from pathlib import Path

from tests import ROOT, preloaded
from tests.end_to_end.helpers import child_env

#: a run of the tiny model with every weight offloaded to disk (memmap)
OFFLOADED = ["storage=memmap", "max_memory.cpu=1KiB", "headroom=0"]


class Printed:
    """What a process prints on stdout, read by a thread of its own as it comes (and waited for by line)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.lines.append("")  # the end
            self.changed.notify_all()

    def wait_for(self, wanted: str, timeout: float) -> str | None:
        """The first line holding ``wanted``, or None once the process ended or ``timeout`` seconds passed."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for line in self.lines:
                    if wanted in line:
                        return line
                left = deadline - time.monotonic()
                if (self.lines and self.lines[-1] == "") or left <= 0:
                    return None
                self.changed.wait(left)

    def text(self) -> str:
        self.thread.join(timeout=30)
        return "".join(self.lines)


#: the two commands that start a server
RUN_PY = ["run.py", "mode=serve"]
OFFLOAD_CORE_SERVE = ["-m", "offload_core", "serve"]


def start_server(model: Path, run_dir: Path, *overrides: str, door: list[str] = RUN_PY) -> tuple[subprocess.Popen, str]:
    """Start the server on a free loopback port; the process (``proc.printed``: its stdout) and its base URL once it
    says it is serving."""
    python, env = preloaded.shim({**child_env(), "TQDM_DISABLE": "1"})  # imports done once (tests/preloaded.py)
    proc = subprocess.Popen(
        [
            python,
            *door,
            "model=local",
            f"model.path={model}",
            *OFFLOADED,
            "serve.host=127.0.0.1",
            "serve.port=0",
            "progress=false",
            f"hydra.run.dir={run_dir}",
            *overrides,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    proc.printed = Printed(proc)
    line = proc.printed.wait_for("serving ", timeout=120)
    if line is None:
        proc.kill()
        proc.wait(timeout=30)
        raise AssertionError(f"the server did not start: {proc.printed.text()[-2000:]} {proc.stderr.read()[-2000:]}")
    url = re.search(r"http://127\.0\.0\.1:\d+", line).group(0)
    return proc, url


def stop_server(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    """SIGTERM, then the exit code, its stdout and stderr (killed, and failing, if it outlives ``timeout``)."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        raise AssertionError(f"the server ran on {timeout} s after SIGTERM: {proc.stderr.read()[-2000:]}") from None
    return proc.returncode, proc.printed.text(), proc.stderr.read()


def call(url: str, method: str, path: str, body: bytes | dict | None = None, key: str | None = None):
    """``method path`` with ``body`` (a dict is sent as JSON): the status and the decoded JSON (or text) answer."""
    host = url.split("//")[1]
    conn = http.client.HTTPConnection(host, timeout=60)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    try:
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        raw = response.read().decode()
    finally:
        conn.close()
    try:
        return response.status, json.loads(raw)
    except ValueError:
        return response.status, raw


def metric(url: str, name: str, key: str | None = None) -> float:
    """The value of the Prometheus sample ``name`` (no labels) the server reports now."""
    _, text = call(url, "GET", "/metrics", key=key)
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} is not in /metrics"
    return float(match.group(1))


def wait_until(check, timeout: float = 30, every: float = 0.1) -> bool:
    """Poll ``check()`` until it is true or ``timeout`` seconds pass; whether it became true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(every)
    return False
