"""Checkpoints in the Hugging Face Hub cache layout (relative links into ``blobs/``, ``refs/main``), opened from their
snapshot folder and by repo id while offline, in every weight format, equal to transformers' own load of the same repo;
the resolver's rules (a local path wins, revisions, one line when the cache lacks a repo) and links that still cannot
lead a store to write outside its offload folder."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
import transformers

from offload_core import from_pretrained
from offload_core.errors import CheckpointError, OffloadError, StorageError
from offload_core.loading.checkpoint import Checkpoint
from offload_core.loading.hub import looks_like_repo_id, probe_folder, resolve_model_path, wanted_files
from tests import ROOT
from tests.checkpoints import TINY
from tests.end_to_end.helpers import snapshot
from tests.hub_cache import as_hub_cache, repo_folder, save_bin_shards

REPO = "acme/smol"
IDS = torch.tensor([[5, 17, 99, 3, 64, 12, 7]])


def _save(model: transformers.PreTrainedModel, folder: Path, layout: str) -> None:
    """``model`` saved as ``layout``: transformers' own safetensors (sharded or one file), or ``.bin`` files as older
    transformers wrote them (one ``pytorch_model.bin``, or shards with ``pytorch_model.bin.index.json``)."""
    if layout.startswith("safetensors"):
        model.save_pretrained(folder, max_shard_size="20KB" if layout == "safetensors-sharded" else "1GB")
        return
    model.config.save_pretrained(folder)
    save_bin_shards(model.state_dict(), folder, shards=1 if layout == "bin" else 2)


@pytest.fixture(scope="module", params=["safetensors-sharded", "safetensors-single", "bin", "bin-sharded"])
def cached(request, tmp_path_factory) -> tuple[Path, Path, str]:
    """(Hub cache folder, snapshot folder, layout) of a tiny seeded Llama laid out as huggingface_hub downloads it."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, num_key_value_heads=2)).eval()
    root = tmp_path_factory.mktemp("hub")
    _save(model, root / "saved", request.param)
    return root / "cache", as_hub_cache(root / "saved", root / "cache", REPO), request.param


def _reference(cache: Path) -> transformers.PreTrainedModel:
    """transformers' own in-memory model of the repo id, from the cache only."""
    return transformers.AutoModelForCausalLM.from_pretrained(REPO, cache_dir=cache, local_files_only=True).eval()


@pytest.mark.parametrize("by", ["snapshot folder", "repo id"])
def test_a_cached_checkpoint_of_each_format_runs_offloaded_as_transformers_loads_it(cached, by, tmp_path):
    cache, snapshot_folder, layout = cached
    files = [p for p in snapshot_folder.iterdir()]
    assert files and all(p.is_symlink() and not os.path.isabs(os.readlink(p)) for p in files)
    before = snapshot(cache)
    source = (
        dict(path=snapshot_folder)
        if by == "snapshot folder"
        else dict(path=REPO, hub={"cache_dir": cache, "local_files_only": True})
    )
    model = from_pretrained(
        offload={
            "offload_folder": tmp_path / "off",
            "execution_device": "cpu",
            "storage": "safetensors" if layout.startswith("safetensors") else "memmap",
            "headroom": 0,
        },
        max_memory={"cpu": "40KiB"},
        **source,
    )
    assert "disk" in set(model.hf_device_map.values()), model.hf_device_map
    reference = _reference(cache)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)
        kwargs = dict(max_new_tokens=4, do_sample=False)
        assert model.generate(IDS, **kwargs).tolist() == reference.generate(IDS, **kwargs).tolist()
    model.offload_state.remove()
    assert snapshot(cache) == before  # read in place or copied out: the cache is only ever read
    assert not list((tmp_path / "off").rglob("*")) or all(
        p.resolve().is_relative_to((tmp_path / "off").resolve()) for p in (tmp_path / "off").rglob("*")
    )


def test_the_snapshot_folder_opens_with_every_shard_of_its_index(cached):
    cache, snapshot_folder, layout = cached
    with Checkpoint.open(snapshot_folder) as checkpoint:
        assert all(file.parent == snapshot_folder and file.is_symlink() for file in checkpoint.files)
        weights = [p for p in snapshot_folder.iterdir() if p.suffix in (".safetensors", ".bin")]
        assert sorted(checkpoint.files) == sorted(weights)
        assert len(weights) > 1 if "sharded" in layout else len(weights) == 1
        assert checkpoint.fingerprint()["path"] == str(snapshot_folder.resolve())


@pytest.mark.parametrize("shard", ["../elsewhere/x.safetensors", "/etc/passwd", ".", "sub/../../x.safetensors", ""])
def test_an_index_still_cannot_name_a_shard_outside_its_folder(shard, tmp_path):
    """Links in the folder are followed; names that leave it are not, wherever a link would take them."""
    root = tmp_path / "ckpt"
    (tmp_path / "elsewhere").mkdir()
    root.mkdir()
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "elsewhere" / "x.safetensors")
    (root / "x.safetensors").symlink_to(os.path.relpath(tmp_path / "elsewhere" / "x.safetensors", root))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    with pytest.raises(CheckpointError, match="not a file inside that folder"):
        Checkpoint.open(root)
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "x.safetensors"}}))
    with Checkpoint.open(root) as checkpoint:  # the same file through the folder's own link is read
        assert torch.equal(checkpoint.get("w"), torch.ones(2))


def test_a_planted_link_in_the_offload_folder_still_cannot_redirect_a_write(tmp_path):
    """A checkpoint read through the cache's links; the store's folder holds a link named as a file it writes."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, num_key_value_heads=2))
    model.save_pretrained(tmp_path / "saved")
    folder = as_hub_cache(tmp_path / "saved", tmp_path / "cache", REPO)
    budget = dict(execution_device="cpu", storage="memmap", headroom=0)
    first = from_pretrained(folder, {"cpu": "40KiB"}, {"offload_folder": tmp_path / "learn", **budget})
    written = sorted(p.name for p in (tmp_path / "learn").iterdir() if p.suffix == ".dat")
    first.offload_state.remove()
    assert written
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "off").mkdir()
    (tmp_path / "off" / written[0]).symlink_to(victim)
    with pytest.raises(StorageError, match=r"holds files offload_core did not create"):
        from_pretrained(
            REPO,
            {"cpu": "40KiB"},
            {"offload_folder": tmp_path / "off", **budget},
            hub={"cache_dir": tmp_path / "cache", "local_files_only": True},
        )
    assert victim.read_text() == "precious"


# -- the resolver ------------------------------------------------------------------------------------------------


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache that huggingface_hub uses, offline (as ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE=1`` make it)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _tiny_folder(folder: Path, layers: int = 1) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, "num_hidden_layers": layers}, num_key_value_heads=2)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_a_repo_id_is_its_snapshot_at_main_a_tag_or_a_commit(offline_cache, tmp_path):
    main = as_hub_cache(_tiny_folder(tmp_path / "one"), offline_cache, REPO)
    tagged = as_hub_cache(_tiny_folder(tmp_path / "two", layers=2), offline_cache, REPO, ref="v2")
    assert main != tagged
    assert resolve_model_path(REPO) == main
    assert resolve_model_path(REPO, revision="v2") == tagged
    assert resolve_model_path(REPO, revision=main.name) == main
    assert (repo_folder(offline_cache, REPO) / "refs" / "main").read_text() == main.name


def test_an_existing_local_path_wins_over_a_repo_id(offline_cache, tmp_path, monkeypatch):
    as_hub_cache(_tiny_folder(tmp_path / "one"), offline_cache, REPO)
    monkeypatch.chdir(tmp_path)
    _tiny_folder(tmp_path / "acme" / "smol", layers=2)
    assert resolve_model_path(REPO) == Path(REPO)
    model = from_pretrained(REPO, offload={"execution_device": "cpu"})
    assert model.config.num_hidden_layers == 2


@pytest.mark.parametrize(
    "how,parts",
    [
        ("offline", ["HF_HUB_OFFLINE=1 forbids downloading it", "unset HF_HUB_OFFLINE", "hf download acme/nope"]),
        ("local_files_only", ["local_files_only=True forbids", "pass local_files_only=False"]),
    ],
)
def test_a_repo_the_cache_lacks_offline_is_one_line_saying_what_to_do(offline_cache, how, parts, monkeypatch):
    if how == "local_files_only":
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(OffloadError) as caught:
        from_pretrained("acme/nope", hub={"local_files_only": how == "local_files_only"})
    message = str(caught.value)
    assert "\n" not in message and "path='acme/nope' is neither a local folder nor a model" in message
    assert str(offline_cache) in message and all(part in message for part in parts), message


def test_a_revision_the_cache_lacks_is_named_with_its_download_command(offline_cache, tmp_path):
    as_hub_cache(_tiny_folder(tmp_path / "one"), offline_cache, REPO)
    with pytest.raises(OffloadError, match=r"at revision 'v9'.*hf download acme/smol --revision v9$"):
        resolve_model_path(REPO, revision="v9")


@pytest.mark.parametrize(
    "name,repo",
    [
        ("acme/smol", True),
        ("gpt2", True),
        ("/no/such/folder", False),
        ("./smol", False),
        ("~/models/smol", False),
        ("a/b/c", False),
        ("model.safetensors", False),
        ("x.gguf", False),
        ("", False),
    ],
)
def test_what_counts_as_a_repo_id(name, repo):
    assert looks_like_repo_id(name) is repo


def test_a_path_that_is_no_repo_id_says_it_does_not_exist(tmp_path):
    with pytest.raises(OffloadError, match=r"does not exist: give a local Hugging Face checkpoint folder or a Hub"):
        resolve_model_path(tmp_path / "nowhere")


def test_the_files_downloaded_are_those_transformers_reads():
    both = ["config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json", "original/consolidated.pth"]
    allow, ignore = wanted_files(both)
    assert "*.safetensors" in allow and "*.bin" not in allow and "*.json" in allow and not ignore
    assert "*.bin" in wanted_files(["config.json", "pytorch_model.bin"])[0]
    unet = ["unet/diffusion_pytorch_model.safetensors", "unet/diffusion_pytorch_model.fp16.safetensors"]
    assert wanted_files(unet)[1] == ["unet/diffusion_pytorch_model.fp16.safetensors"]
    assert wanted_files(unet[1:])[1] == []  # only a variant: it is the weights


def test_a_gguf_in_the_cache_resolves_to_its_snapshot_or_stays_the_file_given(offline_cache, tmp_path):
    """A repo of a GGUF file alone (no config.json) is that file in its snapshot folder; a linked ``.gguf`` path is
    kept as given, for the GGUF reader to open as any local GGUF file."""
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "model.Q4_1.gguf").write_bytes(b"GGUF" + bytes(60))
    folder = as_hub_cache(tmp_path / "gguf", offline_cache, "acme/smol-gguf")
    assert resolve_model_path("acme/smol-gguf") == folder / "model.Q4_1.gguf"
    file = folder / "model.Q4_1.gguf"
    assert file.is_symlink() and resolve_model_path(file) == file


def test_the_troubleshooting_page_quotes_the_offline_line_as_the_code_says_it(offline_cache):
    page = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    row = next(line for line in page.splitlines() if "is neither a local folder nor a model" in line)
    quoted = re.findall(r"`([^`]*)`", row.split(" | ")[1])[0]
    with pytest.raises(OffloadError) as caught:
        resolve_model_path("org/name")
    assert all(piece in str(caught.value) for piece in quoted.split("…")), (quoted, str(caught.value))


# -- online: the Hub's two calls stand in here (tests never download) ------------------------------------------------


@pytest.fixture
def online(offline_cache, tmp_path, monkeypatch):
    """The Hub as huggingface_hub's ``HfApi.model_info`` and ``snapshot_download`` answer it for a repo holding both
    safetensors and ``.bin`` weights; the download lays the saved files out in the cache. Returns what they were
    asked."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils import are_progress_bars_disabled

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    real_snapshot_download = huggingface_hub.snapshot_download
    saved = _tiny_folder(tmp_path / "remote")
    files = [p.name for p in saved.iterdir()] + ["pytorch_model.bin", "original/consolidated.00.pth"]
    commit = "c" * 40
    asked: dict = {}

    def model_info(self, repo_id, revision=None, **kwargs):
        asked["info"] = (repo_id, revision, self.token)
        return type("Info", (), {"sha": commit, "siblings": [type("S", (), {"rfilename": f}) for f in files]})

    def snapshot_download(repo_id, **kwargs):
        if kwargs.get("local_files_only"):
            return real_snapshot_download(repo_id, **kwargs)
        asked["download"] = {**kwargs, "bars_hidden": are_progress_bars_disabled()}
        return str(as_hub_cache(saved, offline_cache, repo_id, commit=commit))

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return asked


def test_online_a_repo_id_downloads_the_files_transformers_reads_at_the_asked_revision(online, offline_cache):
    model = from_pretrained(REPO, offload={"execution_device": "cpu"}, hub={"revision": "v1", "token": "hf_secret"})
    assert type(model).__name__ == "LlamaForCausalLM"
    assert online["info"] == (REPO, "v1", "hf_secret")
    download = online["download"]
    assert download["revision"] == "c" * 40 and download["token"] == "hf_secret" and not download["bars_hidden"]
    assert "*.safetensors" in download["allow_patterns"] and "*.bin" not in download["allow_patterns"]
    resolve_model_path(REPO, progress=False)
    assert online["download"]["bars_hidden"]


def test_online_without_a_network_the_cached_repo_is_used_or_one_line_says_why(
    online, offline_cache, tmp_path, capsys, monkeypatch
):
    import huggingface_hub

    def unreachable(self, repo_id, revision=None, **kwargs):
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    with pytest.raises(OffloadError) as caught:
        resolve_model_path(REPO)
    assert "\n" not in str(caught.value)
    assert "is no local folder and could not be downloaded ([Errno -2]" in str(caught.value)
    folder = as_hub_cache(_tiny_folder(tmp_path / "local"), offline_cache, REPO)
    assert resolve_model_path(REPO) == folder
    assert f"the Hub could not be reached ([Errno -2] Name or service not known); using the cached {REPO}" in (
        capsys.readouterr().err
    )


def test_online_a_repo_the_hub_does_not_have_is_one_line_naming_the_token(online, monkeypatch):
    httpx2 = pytest.importorskip("httpx2")
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    def missing(self, repo_id, revision=None, **kwargs):
        response = httpx2.Response(404, request=httpx2.Request("GET", "http://hub.invalid/api/models/acme/nope"))
        raise RepositoryNotFoundError("404 Client Error: Repository Not Found", response=response)

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", missing)
    with pytest.raises(OffloadError) as caught:
        from_pretrained("acme/nope")
    message = str(caught.value)
    assert "\n" not in message and "the Hub repo acme/nope was not found (or is private)" in message
    assert "HF_TOKEN" in message and "path='acme/nope'" in message


def test_probes_beside_a_snapshot_are_written_beside_the_hub_cache_never_inside_it(tmp_path):
    snapshot_folder = tmp_path / "hf" / "hub" / "models--acme--smol" / "snapshots" / ("a" * 40)
    assert probe_folder(snapshot_folder) == tmp_path / "hf"
    assert probe_folder(snapshot_folder / "model.Q4_1.gguf") == tmp_path / "hf"
    assert probe_folder(tmp_path / "models" / "smol") == tmp_path / "models"
