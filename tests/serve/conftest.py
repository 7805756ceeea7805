"""The tiny chat model the server's tests serve: its folder, and the model loaded in memory (each once a module)."""

from __future__ import annotations

import pytest
import transformers

from tests.serve.tiny import save_tiny_chat_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module")
def model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
