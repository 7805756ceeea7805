"""A GGUF model split across files as llama.cpp's gguf-split writes the large ones (``name-00001-of-00003.gguf``,
...; transformers reads one file only): named by any part or by its folder, read in place by storage=gguf and
converted once by the default store, it is transformers' in-memory model of the same model in one file; a missing
part, parts of different models, or a folder holding another GGUF beside them is one line."""

from __future__ import annotations

import shutil

import pytest
import torch
from gguf import GGMLQuantizationType as T

import offload_core
from offload_core.errors import CheckpointError, ConfigError
from tests.gguf_files import half_offloaded_map, transformers_model, write_gguf

IDS = torch.tensor([[256, 5, 77, 100, 258, 259, 33, 40]])
TYPES = {"ffn_down": int(T.Q4_K), "attn_q": int(T.Q6_K), "output.weight": int(T.Q8_0)}


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """The same model in one file and in three parts (the LM head in the last, so that the first part's tensors alone
    would make transformers tie it to the embedding)."""
    folder = tmp_path_factory.mktemp("gguf-split")
    (folder / "one").mkdir()
    (folder / "parts").mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OFFLOAD_CORE_CACHE", str(folder / "cache"))
        whole = write_gguf(folder / "one" / "m.gguf", "llama", TYPES, default=int(T.Q4_1))
        first = write_gguf(folder / "parts" / "m.gguf", "llama", TYPES, default=int(T.Q4_1), split_tensors=12)
        yield first, transformers_model(whole)


def _run(path, storage, policy="prefetch"):
    offload = {"policy": policy, "device_map": half_offloaded_map(), "over_budget": "warn"}
    return offload_core.from_pretrained(path, {"cpu": "3MiB"}, {**offload, **({"storage": storage} if storage else {})})


@pytest.mark.parametrize("storage", ["gguf", None])
def test_a_split_model_named_by_any_part_or_its_folder_is_the_whole_files_model(split, storage):
    first, reference = split
    parts = sorted(first.parent.glob("m-*-of-*.gguf"))
    assert len(parts) == 3 and parts[0] == first
    with torch.no_grad():
        want = reference(IDS).logits
        tokens = reference.generate(IDS, max_new_tokens=4, do_sample=False)
    for path in (first, parts[1], first.parent):
        model = _run(path, storage)
        try:
            assert {"cpu", "disk"} <= set(model.hf_device_map.values())
            with torch.no_grad():
                assert torch.equal(model(IDS).logits, want)
                assert torch.equal(model.generate(IDS, max_new_tokens=4, do_sample=False), tokens)
        finally:
            model.offload_state.release()


def test_the_in_memory_model_of_the_parts_is_transformers_model_of_the_whole_file(split):
    """What ``compare_in_memory=true`` compares with (transformers reads one file only): the model transformers
    builds from the parts merged into one file."""
    from transformers import AutoModelForCausalLM

    from offload_core.loading.gguf_sources import transformers_gguf_model

    first, reference = split
    model = transformers_gguf_model(first, AutoModelForCausalLM, None)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)


def test_a_missing_part_is_one_line_naming_it_and_writes_nothing(split, tmp_path, monkeypatch):
    first, _ = split
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "parts"
    shutil.copytree(first.parent, folder)
    (folder / "m-00002-of-00003.gguf").unlink()
    for storage in ("gguf", None):
        with pytest.raises(CheckpointError) as error:
            _run(folder / first.name, storage)
        message = str(error.value)
        assert "\n" not in message and "m-00002-of-00003.gguf" in message and "download every part" in message
    assert not list((tmp_path / "cache").glob("gguf-*/*"))


def test_parts_of_different_models_are_one_line(split, tmp_path, monkeypatch):
    first, _ = split
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "parts"
    shutil.copytree(first.parent, folder)
    shutil.copy(folder / "m-00002-of-00003.gguf", folder / "m-00003-of-00003.gguf")  # part 2 twice
    with pytest.raises(CheckpointError) as error:
        _run(folder / first.name, "gguf")
    message = str(error.value)
    assert "\n" not in message and "parts disagree" in message and "m-00003-of-00003.gguf" in message


def test_a_folder_holding_another_gguf_beside_the_parts_asks_which(split, tmp_path):
    first, _ = split
    folder = tmp_path / "parts"
    shutil.copytree(first.parent, folder)
    shutil.copy(first, folder / "other.gguf")
    with pytest.raises(ConfigError, match="holds 2 GGUF files"):
        _run(folder, "gguf")
