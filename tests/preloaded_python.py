"""``python`` for the docs' shell blocks (copied, behind a ``#!`` line naming the real interpreter, as ``python`` into a
folder first on their ``PATH``): ``python <script>.py …`` / ``python -m offload_core …`` / ``python -c …`` run in a
child of the preloaded interpreter (tests/preloaded.py) with this process's streams, folder and environment; the
signals this process gets go to that child, and it exits as the child did. Anything else, or a declined command, is
the real interpreter."""

import os
import signal
import sys

sys.path.insert(0, os.environ["OFFLOAD_CORE_TEST_PRELOADED_DIR"])

import preloaded_client as client  # noqa: E402

REAL = os.environ["OFFLOAD_CORE_TEST_PRELOADED_PYTHON"]
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main() -> None:
    argv = sys.argv[1:]
    path = os.environ.get(client.SOCKET_ENV)
    if not path or not client.routable(argv, code=True):
        os.execv(REAL, [REAL, *argv])
    pending: list[int] = []
    child = [0]

    def forward(signum, frame):
        if child[0]:
            os.kill(child[0], signum)
        else:
            pending.append(signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    conn, child[0] = client.start(path, argv, os.getcwd(), dict(os.environ), [0, 1, 2])
    if not child[0]:
        os.execv(REAL, [REAL, *argv])
    for signum in pending:
        os.kill(child[0], signum)
    code = client.wait(conn, None)
    if code < 0:  # ended by a signal: so is this process, as its parent expects
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


main()
