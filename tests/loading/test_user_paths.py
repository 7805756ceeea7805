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


def test_a_folder_of_a_gguf_file_and_a_config_json_runs_the_file(tiny_gguf, tmp_path, monkeypatch):
    """Some GGUF repos hold a ``config.json`` beside the file (downloaded with ``--local-dir``, the folder is that):
    the GGUF file runs, its metadata its config, whatever the ``config.json`` says."""
    import torch

    from tests.gguf_files import transformers_model

    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "download"
    folder.mkdir()
    (folder / tiny_gguf.name).write_bytes(tiny_gguf.read_bytes())
    (folder / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 64}')
    before = snapshot(folder)
    ids = torch.tensor([[256, 5, 77, 100]])
    expected = transformers_model(tiny_gguf)(ids).logits
    for offload in ({"storage": "gguf"}, {}):
        model = offload_core.from_pretrained(str(folder), {"cpu": "1GiB"}, offload)
        try:
            with torch.no_grad():
                assert torch.equal(model(ids).logits, expected)
        finally:
            model.offload_state.release()
    assert snapshot(folder) == before


def _pulled(models, name: str, tag: str, data: bytes, registry: str = "registry.ollama.ai/library") -> None:
    """``name:tag`` laid out in Ollama's ``models`` folder as ``ollama pull`` leaves it, its weights ``data``."""
    import hashlib
    import json

    digest = hashlib.sha256(data).hexdigest()
    (models / "blobs").mkdir(parents=True, exist_ok=True)
    (models / "blobs" / f"sha256-{digest}").write_bytes(data)
    manifest = models / "manifests" / registry / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    layer = {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": len(data)}
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [layer]}))


def test_ollama_names_in_any_case_and_blobs_that_are_not_gguf(tiny_gguf, tmp_path, monkeypatch, capsys):
    from offload_core.errors import ConfigError
    from offload_core.loading.hub import resolve_model_path

    models = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(models))
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    _pulled(models, "tiny", "q6_K", tiny_gguf.read_bytes())
    _pulled(models, "Repo-GGUF", "Q8_0", tiny_gguf.read_bytes(), "hf.co/acme")
    _pulled(models, "broken", "latest", b"\x00\x01 not weights")
    before = snapshot(models)
    for name in ("tiny:q6_K", "tiny:Q6_k", "TINY:q6_k", "hf.co/acme/repo-gguf:q8_0"):  # Ollama's names: any case
        assert resolve_model_path(f"ollama:{name}").read_bytes()[:4] == b"GGUF", name
    with pytest.raises(ConfigError, match=r"is no Ollama model name"):
        resolve_model_path("ollama:tiny:../../x")
    code, err = cli(["model=local", "model.path=ollama:broken", "storage=gguf"], tmp_path, capsys)
    assert code == 2
    assert_one_line(err, "ollama:broken: its weights blob", "is not a GGUF file", "`ollama pull broken`")
    assert snapshot(models) == before


@pytest.mark.parametrize(
    "numbers, said",
    [
        ({"attention.head_count": 0}, "llama.attention.head_count is 0"),
        ({"attention.head_count_kv": 0}, "llama.attention.head_count_kv is 0"),
        ({"attention.head_count": 3}, "not a multiple of the number of attention heads"),  # transformers' own check
        ({"block_count": 0}, "llama.block_count is 0"),  # it held two layers' tensors, and ran none
    ],
)
def test_a_gguf_header_whose_numbers_make_no_model_is_one_line(numbers, said, tmp_path, monkeypatch):
    from offload_core.errors import CheckpointError

    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    bad = write_gguf(tmp_path / "bad.gguf", "llama", default=int(T.Q8_0), layers=2, metadata=numbers)
    for offload in ({"storage": "gguf"}, {}):
        with pytest.raises(CheckpointError, match="its metadata makes no model transformers can build") as error:
            offload_core.from_pretrained(str(bad), {"cpu": "1GiB"}, offload)
        assert said in str(error.value) and "\n" not in str(error.value)


def test_a_missing_checkpoint_given_to_load_checkpoint_and_dispatch_names_gguf_among_what_it_takes(tmp_path):
    import transformers

    from offload_core.errors import CheckpointError
    from offload_core.loading.empty import init_empty_weights
    from tests.gguf_files import tiny_config

    with init_empty_weights():
        model = transformers.LlamaForCausalLM(tiny_config("llama", layers=1))
    with pytest.raises(CheckpointError, match=r"does not exist; give a checkpoint directory or a .* or .gguf file"):
        offload_core.load_checkpoint_and_dispatch(model, tmp_path / "model-Q8_0.gguf", device_map="auto")


def test_a_budget_too_small_for_align_per_call_does_not_advise_align_per_call(tiny_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    args = ["model=local", f"model.path={tiny_gguf}", "storage=gguf", "max_memory.cpu=1MiB"]
    code, err = cli([*args, "hook=align_per_call", "storage.resident=quantized"], tmp_path, capsys)
    assert code == 2
    assert_one_line(err, "hook=align_per_call holds", "raise max_memory.cpu to at least")
    assert "choose a policy" not in err
    code, err = cli([*args, "hook=prefetch"], tmp_path, capsys)
    assert code == 2
    assert_one_line(
        err, "hook=prefetch holds", "choose a policy that holds fewer units (hook.depth, hook=align_per_call)"
    )
    code, err = cli([*args, "hook=chained"], tmp_path, capsys)  # no hook.depth of its own
    assert code == 2
    assert_one_line(err, "hook=chained holds", "choose a policy that holds fewer units (hook=align_per_call)")


def test_offline_a_tagged_repo_not_cached_says_to_download_that_quantization_only(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from offload_core.errors import ConfigError
    from offload_core.loading.hub import resolve_model_path
    from offload_core.loading.hub_gguf import pick_gguf
    from offload_core.loading.sources import ModelSourceError

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelSourceError, match=r'HF_HUB_OFFLINE=1 .*hf download acme/big-GGUF --include "\*Q8_0\*"$'):
        resolve_model_path("acme/big-GGUF:Q8_0")
    with pytest.raises(
        ConfigError, match=r"acme/plain:Q8_0: the repo holds no GGUF files; drop the tag: .*=acme/plain$"
    ):
        pick_gguf("acme/plain", ["config.json", "model.safetensors"], "Q8_0")


def test_a_gguf_named_as_a_part_that_is_none_says_so(tiny_gguf, tmp_path):
    from offload_core.errors import CheckpointError

    for no in (1, 2):  # a whole model's file, renamed as gguf-split names its parts
        (tmp_path / f"tiny-0000{no}-of-00002.gguf").write_bytes(tiny_gguf.read_bytes())
    with pytest.raises(CheckpointError, match="tiny-00001-of-00002.gguf holds no split.no and split.count: it is no"):
        offload_core.from_pretrained(str(tmp_path / "tiny-00002-of-00002.gguf"), {"cpu": "1GiB"}, {"storage": "gguf"})


def test_a_folder_as_lm_studio_keeps_a_model_runs_its_gguf_whatever_the_case_beside_its_projector(tiny_gguf, tmp_path):
    from offload_core.loading.gguf_checkpoint import find_gguf

    folder = tmp_path / "lmstudio" / "acme" / "Tiny-GGUF"
    folder.mkdir(parents=True)
    (folder / "Tiny-Q8_0.GGUF").write_bytes(tiny_gguf.read_bytes())
    (folder / "mmproj-Tiny-F16.gguf").write_bytes(tiny_gguf.read_bytes())  # a vision projector: no model
    assert find_gguf(folder) == folder / "Tiny-Q8_0.GGUF"


def test_an_offload_folder_of_the_users_own_files_and_links_is_refused_as_theirs(tiny_gguf, tmp_path, capsys):
    mine = tmp_path / "models"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    (mine / "current.gguf").symlink_to(tiny_gguf)  # a link of theirs: not ours to ask them to remove
    before = snapshot(mine)
    args = ["model=local", f"model.path={tiny_gguf}", "storage=memmap", f"offload_folder={mine}"]
    code, err = cli([*args, "max_memory.cpu=1MiB", "over_budget=warn"], tmp_path, capsys)
    assert code == 2
    assert_one_line(err, "holds files offload_core did not create (current.gguf, notes.txt); give an empty or new")
    assert "remove the link" not in err and snapshot(mine) == before and (mine / "current.gguf").is_symlink()


def test_a_store_given_as_a_dict_of_its_name_and_options_is_built_from_them(tiny_gguf, tmp_path, monkeypatch):
    import torch

    from offload_core.errors import ConfigError, PluginError
    from tests.gguf_files import transformers_model

    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    ids = torch.tensor([[256, 5, 77, 100]])
    store = {"name": "gguf", "resident": "quantized"}  # as speculative takes a dict, and run.py's storage.resident=
    model = offload_core.from_pretrained(str(tiny_gguf), {"cpu": "3MiB"}, {"storage": store, "over_budget": "warn"})
    try:
        assert model.offload_state.store.held_nbytes() > 0  # the offloaded blocks held in memory
        with torch.no_grad():
            assert torch.equal(model(ids).logits, transformers_model(tiny_gguf)(ids).logits)
    finally:
        model.offload_state.release()
    auto = {"storage": store, "over_budget": "warn", "auto": True}  # ranked with the options it was given
    model = offload_core.from_pretrained(str(tiny_gguf), {"cpu": "3MiB"}, auto)
    try:
        assert model.offload_state.store.held_nbytes() > 0
    finally:
        model.offload_state.release()
    with pytest.raises(PluginError, match="storage 'gguf' has no option"):
        offload_core.from_pretrained(str(tiny_gguf), None, {"storage": {"name": "gguf", "resident_": "quantized"}})
    with pytest.raises(ConfigError, match=r"storage=\{'resident': 'quantized'\} names no storage: give its name"):
        offload_core.from_pretrained(str(tiny_gguf), None, {"storage": {"resident": "quantized"}})


def test_an_empty_path_or_an_integer_dtype_is_one_line_naming_it(tiny_gguf):
    import torch

    from offload_core.errors import ConfigError

    for empty in ("", " ", None):  # "" was the working folder, read as a checkpoint
        with pytest.raises(ConfigError, match="^path is empty: give a checkpoint folder, a GGUF file"):
            offload_core.from_pretrained(empty, {"cpu": "1GiB"})
    with pytest.raises(ConfigError, match=r"^dtype=torch.int8 is no floating-point dtype"):  # it named the task
        offload_core.from_pretrained(str(tiny_gguf), {"cpu": "1GiB"}, dtype=torch.int8)


def test_offline_a_tag_the_cache_lacks_is_said_of_the_cache_not_of_the_repo(tiny_gguf, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from offload_core.errors import ConfigError
    from offload_core.loading.hub import resolve_model_path
    from tests.hub_cache import as_hub_cache

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    downloaded = tmp_path / "downloaded"  # only the quantization run before was downloaded
    downloaded.mkdir()
    (downloaded / "Tiny-Q8_0.gguf").write_bytes(tiny_gguf.read_bytes())
    snapshot_folder = as_hub_cache(downloaded, cache, "acme/tiny-GGUF")
    assert resolve_model_path("acme/tiny-GGUF:Q8_0") == snapshot_folder / "Tiny-Q8_0.gguf"
    with pytest.raises(ConfigError, match=r"cache's copy of the repo holds no GGUF model tagged Q4_K_M \(it holds: "):
        resolve_model_path("acme/tiny-GGUF:Q4_K_M")


def test_a_cached_gguf_whose_blob_is_gone_says_to_download_it_again(tiny_gguf, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from offload_core.loading.hub import resolve_model_path
    from offload_core.loading.sources import ModelSourceError
    from tests.hub_cache import as_hub_cache

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    (downloaded / "Tiny-Q8_0.gguf").write_bytes(tiny_gguf.read_bytes())
    snapshot_folder = as_hub_cache(downloaded, cache, "acme/tiny-GGUF")
    (snapshot_folder / "Tiny-Q8_0.gguf").resolve().unlink()  # the blob gone, its link left
    with pytest.raises(ModelSourceError, match=r"holds Tiny-Q8_0.gguf only as a link to a missing file .* hf download"):
        resolve_model_path("acme/tiny-GGUF:Q8_0")
