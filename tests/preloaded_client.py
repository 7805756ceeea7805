"""The client side of the preloaded interpreter (tests/preloaded.py), in the standard library alone: the ``python``
that the docs' shell blocks find first on their ``PATH`` (tests/preloaded_python.py) imports it at startup."""

from __future__ import annotations

import json
import select
import socket

#: the preloaded interpreter's socket, in the environment of what the tests start
SOCKET_ENV = "OFFLOAD_CORE_TEST_PRELOADED"


#: the modules ``python -m`` runs from the preloaded interpreter (another, such as pip, runs afresh)
MODULES = {"offload_core"}


def routable(argv: list[str], code: bool = False) -> bool:
    """``python <script>.py …`` and ``python -m offload_core …``: what the preloaded interpreter runs; ``code``:
    ``python -c …`` too (the docs' shell blocks build their tiny models so; a test's own ``-c`` measures a fresh
    process)."""
    if code and len(argv) > 1 and argv[0] == "-c":
        return True
    return bool(argv) and (argv[0].endswith(".py") or (argv[0] == "-m" and len(argv) > 1 and argv[1] in MODULES))


def start(path: str, argv: list[str], cwd: str, env: dict[str, str], fds: list[int]) -> tuple[socket.socket, int]:
    """Ask the preloaded interpreter at ``path`` to run ``argv`` with standard streams ``fds``; the connection and
    the child's pid, or pid 0 when it declines (an environment read while importing differs): run it afresh."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    request = json.dumps({"argv": argv, "cwd": cwd, "env": env}).encode()
    socket.send_fds(conn, [len(request).to_bytes(8, "little")], fds)
    conn.sendall(request)
    return conn, int(_line(conn, None) or 0)


def wait(conn: socket.socket, timeout: float | None) -> int | None:
    """The child's exit status as ``subprocess`` gives it (minus the signal that ended it), or None at ``timeout``."""
    line = _line(conn, timeout)
    return None if line is None else int(line)


def _line(conn: socket.socket, timeout: float | None) -> str | None:
    data = b""
    while not data.endswith(b"\n"):
        if timeout is not None and not select.select([conn], [], [], timeout)[0]:
            return None
        chunk = conn.recv(64)
        if not chunk:
            raise ConnectionError("the preloaded interpreter closed the connection")
        data += chunk
    return data.decode().strip()
