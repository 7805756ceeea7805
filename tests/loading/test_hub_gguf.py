"""GGUF repos on the Hub by repo id: one model in many quantizations (a file each, or parts in a folder each), one
named after a colon (``org/name-GGUF:Q8_0``, as llama.cpp's ``-hf`` takes it), the only one or ``Q4_K_M`` taken
otherwise; only the chosen model's files downloaded; from the offline cache the same choice, and it runs."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

import offload_core
from offload_core.errors import ConfigError
from offload_core.loading.hub import READ, resolve_model_path
from offload_core.loading.hub_gguf import pick_gguf, split_tag
from tests.gguf_files import transformers_model, write_gguf
from tests.hub_cache import as_hub_cache

REPO = "acme/tiny-GGUF"
LISTED = [
    "README.md",
    ".gitattributes",
    "Tiny-3B-Instruct-IQ4_XS.gguf",
    "Tiny-3B-Instruct-Q4_K.gguf",
    "Tiny-3B-Instruct-Q4_K_M.gguf",
    "Tiny-3B-Instruct-Q8_0.gguf",
    "Tiny-3B-Instruct-f16.gguf",
    "mmproj-Tiny-3B-f16.gguf",
]


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_tag_names_one_quantization_whole_not_a_prefix_of_another(capsys):
    assert split_tag("acme/x-GGUF:Q8_0") == ("acme/x-GGUF", "Q8_0") and split_tag("acme/x") == ("acme/x", None)
    assert pick_gguf(REPO, LISTED, "q8_0") == ["Tiny-3B-Instruct-Q8_0.gguf"]
    assert pick_gguf(REPO, LISTED, "Q4_K") == ["Tiny-3B-Instruct-Q4_K.gguf"]  # not Q4_K_M
    assert pick_gguf(REPO, LISTED, "F16") == ["Tiny-3B-Instruct-f16.gguf"]  # the projector is no model
    assert pick_gguf(REPO, LISTED, None) == ["Tiny-3B-Instruct-Q4_K_M.gguf"]
    said = capsys.readouterr().err
    assert "holds 5 GGUF models (F16, IQ4_XS, Q4_K, Q4_K_M, Q8_0); running Q4_K_M" in said and f"{REPO}:Q8_0" in said


def test_the_only_model_of_a_cached_copy_is_run_and_said_so(capsys):
    only = ["README.md", "Tiny-3B-Instruct-Q8_0.gguf"]
    assert pick_gguf(REPO, only, None) == ["Tiny-3B-Instruct-Q8_0.gguf"] and capsys.readouterr().err == ""
    assert pick_gguf(REPO, only, None, cached=True) == ["Tiny-3B-Instruct-Q8_0.gguf"]
    said = capsys.readouterr().err
    assert f"running Q8_0, the GGUF model of {REPO} in the Hugging Face cache" in said and said.count("\n") == 1


def test_a_split_model_in_a_folder_of_its_own_is_all_its_parts_first_part_first():
    parts = [f"Q4_K_M/Big-Q4_K_M-0000{i}-of-00003.gguf" for i in (2, 1, 3)]
    files = [*parts, "Q8_0/Big-Q8_0-00001-of-00002.gguf", "Q8_0/Big-Q8_0-00002-of-00002.gguf", "README.md"]
    assert pick_gguf("acme/big", files, "Q4_K_M") == sorted(parts)
    assert pick_gguf("acme/big", files, None) == sorted(parts)
    assert len(pick_gguf("acme/big", files, "Q8_0")) == 2


def test_what_cannot_be_chosen_is_one_line_listing_what_the_repo_holds():
    with pytest.raises(ConfigError) as error:
        pick_gguf(REPO, LISTED, "Q5_K_M")
    assert "\n" not in str(error.value) and "holds no GGUF model tagged Q5_K_M; it holds: F16, IQ4_XS" in str(
        error.value
    )
    several = ["a-Q8_0.gguf", "a-Q6_K.gguf"]
    with pytest.raises(ConfigError, match=r"holds 2 GGUF models \(Q6_K, Q8_0\); name one after a colon: "):
        pick_gguf(REPO, several, None)
    assert pick_gguf(REPO, ["config.json", "model.safetensors", "a-Q8_0.gguf"], None) is None  # its weights are read
    assert pick_gguf(REPO, ["config.json", "model.safetensors"], None) is None


def test_offline_a_tagged_repo_id_is_that_file_of_the_cached_snapshot_and_runs(offline_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    saved = tmp_path / "saved"
    saved.mkdir()
    q8 = write_gguf(saved / "tiny-Q8_0.gguf", "qwen2", default=int(T.Q8_0), layers=2)
    write_gguf(saved / "tiny-Q4_K_M.gguf", "qwen2", default=int(T.Q4_K), layers=2)
    snapshot = as_hub_cache(saved, offline_cache, REPO)
    assert resolve_model_path(f"{REPO}:Q8_0") == snapshot / "tiny-Q8_0.gguf"
    assert resolve_model_path(REPO) == snapshot / "tiny-Q4_K_M.gguf"
    ids = torch.tensor([[256, 5, 77, 100]])
    model = offload_core.from_pretrained(
        f"{REPO}:Q8_0", {"cpu": "1MiB"}, {"storage": "gguf", "over_budget": "warn", "headroom": 0}
    )
    try:
        with torch.no_grad():
            assert torch.equal(model(ids).logits, transformers_model(q8)(ids).logits)
    finally:
        model.offload_state.release()


def test_online_only_the_chosen_models_files_are_downloaded(offline_cache, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    saved = tmp_path / "saved"
    (saved / "Q8_0").mkdir(parents=True)
    for name in ("Q8_0/x-Q8_0-00001-of-00002.gguf", "Q8_0/x-Q8_0-00002-of-00002.gguf", "x-Q4_K_M.gguf"):
        (saved / name).write_bytes(b"GGUF")
    asked: dict = {}

    def model_info(self, repo_id, revision=None, **kwargs):
        files = [p.relative_to(saved).as_posix() for p in saved.rglob("*.gguf")]
        return type("Info", (), {"sha": "c" * 40, "siblings": [type("S", (), {"rfilename": f}) for f in files]})

    def snapshot_download(repo_id, **kwargs):
        asked.update(kwargs)
        return str(as_hub_cache(saved, offline_cache, repo_id, commit="c" * 40))

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    found = resolve_model_path(f"{REPO}:q8_0", progress=False)
    assert found.name == "x-Q8_0-00001-of-00002.gguf" and found.parent.name == "Q8_0"
    assert asked["allow_patterns"] == [*READ, "Q8_0/x-Q8_0-00001-of-00002.gguf", "Q8_0/x-Q8_0-00002-of-00002.gguf"]
    with pytest.raises(ConfigError, match="tagged Q2_K; it holds: Q4_K_M, Q8_0"):
        resolve_model_path(f"{REPO}:Q2_K", progress=False)
