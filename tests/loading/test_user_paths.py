"""What a user may plausibly give on the way to a model (a cache folder that cannot be written, a Hub tag, an Ollama
name, a folder as a download leaves it, a damaged GGUF header) ends in one ``offload_core: error:`` line saying what
to do, or runs; never a traceback, and nothing of theirs is changed."""

from __future__ import annotations

import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as T

import offload_core
from offload_core.errors import OffloadError
from tests import ROOT
from tests.end_to_end.helpers import assert_one_line, child_env, cli, snapshot
from tests.gguf_files import write_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return write_gguf(folder / "tiny-Q8_0.gguf", "llama", default=int(T.Q8_0), layers=2)


def test_a_cache_folder_that_cannot_be_written_is_one_line_naming_it(tiny_gguf, tmp_path, monkeypatch, capsys):
    taken = tmp_path / "not-a-folder"
    taken.write_text("the user's own file\n")
    for cache in (taken, taken / "below"):  # a file where the cache goes, a folder below a file
        monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(cache))
        for offload in ({"storage": "gguf"}, {}):  # its metadata folder; its converted float32 folder
            with pytest.raises(OffloadError, match="the model cache .* cannot be written .*set OFFLOAD_CORE_CACHE"):
                offload_core.from_pretrained(str(tiny_gguf), {"cpu": "1GiB"}, offload)
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(taken))
    code, err = cli(["model=local", f"model.path={tiny_gguf}", "storage=gguf"], tmp_path, capsys)
    assert code == 2
    assert_one_line(err, f"the model cache {taken} cannot be written", "OFFLOAD_CORE_CACHE")
    assert taken.read_text() == "the user's own file\n"


@pytest.mark.slow  # a run.py process
def test_as_a_process_an_unwritable_cache_is_one_line_and_exit_2(tiny_gguf, tmp_path):
    taken = tmp_path / "cache-file"
    taken.write_text("x")
    before = snapshot(tiny_gguf.parent)
    command = [sys.executable, "run.py", "model=local", f"model.path={tiny_gguf}", "progress=false"]
    env = {**child_env(), "OFFLOAD_CORE_CACHE": str(taken)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert_one_line(done.stderr, "cannot be written", "OFFLOAD_CORE_CACHE")
    assert taken.read_text() == "x" and snapshot(tiny_gguf.parent) == before


def test_a_hub_tag_names_the_quantization_it_is_before_those_it_is_part_of():
    from offload_core.errors import ConfigError
    from offload_core.loading.hub_gguf import pick_gguf

    files = ["M-Q4_K_M.gguf", "M-UD-Q4_K_M.gguf", "M-Q8_0.gguf", "M-UD-Q4_K_XL.gguf"]
    for tag in ("Q4_K_M", "q4_k_m", None):  # None: the default quantization, Q4_K_M, taken
        assert pick_gguf("acme/m-GGUF", files, tag) == ["M-Q4_K_M.gguf"]
    assert pick_gguf("acme/m-GGUF", files, "ud-q4_k_m") == ["M-UD-Q4_K_M.gguf"]
    two = ["Base-Q8_0.gguf", "Instruct-Q8_0.gguf"]  # the tag cannot tell them apart: said how to take one
    with pytest.raises(ConfigError, match=r"holds 2 GGUF models tagged Q8_0 .*\(hf download acme/m Base-Q8_0.gguf\)"):
        pick_gguf("acme/m", two, "Q8_0")


def test_a_hub_repo_named_by_its_address_is_one_line_giving_its_id(tmp_path, monkeypatch, capsys):
    from offload_core.errors import ConfigError
    from offload_core.loading.hub import resolve_model_path

    monkeypatch.chdir(tmp_path)  # no such local folder
    for given, bare in [
        ("hf.co/acme/m-GGUF:Q8_0", "acme/m-GGUF:Q8_0"),  # as Ollama names it
        ("https://huggingface.co/acme/m-GGUF/", "acme/m-GGUF"),
        ("huggingface.co/acme/tiny", "acme/tiny"),
    ]:
        with pytest.raises(
            ConfigError, match=rf"names a Hub repo by its address: give its id alone, model.path={bare}$"
        ):
            resolve_model_path(given)
    code, err = cli(["model=local", "model.path=hf.co/acme/m-GGUF:Q8_0"], tmp_path, capsys)
    assert code == 2
    assert_one_line(err, "give its id alone, model.path=acme/m-GGUF:Q8_0")
