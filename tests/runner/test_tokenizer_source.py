"""The tokenizer a run reads its text with (``model.tokenizer``): the folder's own, a named folder or repo id, or
``bytes``; a folder without one, or a name that holds none, is one line instead of a prompt read one id per byte."""

from __future__ import annotations

import pytest

from offload_core.errors import ConfigError
from offload_core.loading import sources
from offload_core.runner.inputs import read_tokenizer
from tests.checkpoints import minilm_folder


def test_bytes_and_a_synthetic_model_read_text_one_id_per_byte(tmp_path):
    assert read_tokenizer(sources.synthetic_checkpoint(**sources.synthetic_preset("tiny"))) is None
    assert read_tokenizer(tmp_path, "bytes") is None


def test_a_folder_without_a_tokenizer_is_one_line_naming_it_and_what_to_do(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError) as caught:
        read_tokenizer(tmp_path)
    message = str(caught.value)
    assert f"the checkpoint folder '{tmp_path}' holds no tokenizer" in message and "\n" not in message
    assert "copy the model's tokenizer files into that folder" in message and "model.tokenizer=" in message


def test_a_named_tokenizer_is_read_from_its_folder_and_a_name_holding_none_is_one_line(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read at import: the variable alone tried the network
    assert read_tokenizer(tmp_path, str(minilm_folder()))("the cat")["input_ids"][0] == 101  # BERT's [CLS]
    with pytest.raises(ConfigError, match=rf"^model.tokenizer='{tmp_path}' holds no tokenizer \(tokenizer.json"):
        read_tokenizer(tmp_path, str(tmp_path))
    with pytest.raises(ConfigError, match=r"^model.tokenizer='nobody/none' is neither a folder nor a Hub repo id"):
        read_tokenizer(tmp_path, "nobody/none")
