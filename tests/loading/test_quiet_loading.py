"""Loading says nothing the user did not cause: a config that names no dtype is read without transformers' deprecation
warning, checkpoint tensors the model makes itself (an old ``position_ids``) load silently while a truly unused one is
still said, and libraries' progress bars hidden for a block come back after it."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from offload_core.loading.quiet import library_bars
from offload_core.loading.tasks import config_dtype
from tests.checkpoints import TINY
from tests.logs import records_of


def test_a_config_naming_no_dtype_is_read_without_touching_torch_dtype(tmp_path, monkeypatch):
    config = transformers.BertConfig(**TINY)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.pop("dtype", None)
    (tmp_path / "config.json").write_text(json.dumps({**saved, "transformers_version": "4.40.0"}))
    read = transformers.AutoConfig.from_pretrained(tmp_path)

    def deprecated(self):
        raise AssertionError("torch_dtype read: transformers warns that it is deprecated")

    monkeypatch.setattr(transformers.PretrainedConfig, "torch_dtype", property(deprecated))
    assert config_dtype(read) == torch.float32
    read.dtype = "bfloat16"
    assert config_dtype(read) == torch.bfloat16


@pytest.fixture(scope="module")
def old_bert(tmp_path_factory):
    """A tiny BERT saved by transformers, then given what older releases saved beside its weights: the
    ``embeddings.position_ids`` buffer the model now makes itself."""
    folder = tmp_path_factory.mktemp("old-bert")
    config = transformers.BertConfig(**TINY, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["embeddings.position_ids"] = torch.arange(64).unsqueeze(0)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, tensors


def test_tensors_the_model_makes_itself_load_silently_and_an_unused_one_is_said(old_bert, tmp_path):
    import offload_core

    folder, tensors = old_bert
    with records_of("offload_core.loading.load_weights", logging.WARNING) as said:
        model = offload_core.from_pretrained(
            folder, {"cpu": "20KB"}, offload={"storage": "safetensors", "execution_device": "cpu", "headroom": 0}
        )
    model.offload_state.remove()
    assert said == []
    tensors["encoder.extra.weight"] = torch.ones(2)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with records_of("offload_core.loading.load_weights", logging.WARNING) as said:
        model = offload_core.from_pretrained(
            tmp_path, {"cpu": "20KB"}, offload={"storage": "safetensors", "execution_device": "cpu", "headroom": 0}
        )
    model.offload_state.remove()
    assert said == ["checkpoint has 1 tensor(s) the model does not use (ignored): encoder.extra.weight"]


def test_library_bars_are_hidden_for_the_block_and_restored_after():
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    with library_bars(False, "transformers"):
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
    with library_bars(True, "transformers"):
        assert hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with library_bars(False, "transformers"):
            pass
        assert not hf_logging.is_progress_bar_enabled()  # hidden before: left hidden
    finally:
        hf_logging.enable_progress_bar()
