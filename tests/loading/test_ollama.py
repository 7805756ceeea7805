"""A model Ollama has pulled, named as Ollama names it (``ollama:tiny:q8``; the models folder laid out as Ollama keeps
it: a manifest per name and tag, the weights as a GGUF blob named by its digest): run from its blob, in place or
converted, as a process too; a model Ollama lacks, a damaged manifest or a missing blob is one line."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as T

import offload_core
from offload_core.errors import ConfigError
from tests import ROOT, preloaded
from tests.end_to_end.helpers import child_env, snapshot
from tests.gguf_files import transformers_model, write_gguf

IDS = torch.tensor([[256, 5, 77, 100]])


@pytest.fixture
def ollama(tmp_path, monkeypatch):
    """``$OLLAMA_MODELS`` holding ``tiny:q8`` (a qwen2 Q8_0 GGUF) as ``ollama pull`` leaves it; the GGUF's path."""
    models = tmp_path / "ollama" / "models"
    gguf = write_gguf(tmp_path / "tiny.gguf", "qwen2", default=int(T.Q8_0), layers=2)
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    (models / "blobs").mkdir(parents=True)
    (models / "blobs" / f"sha256-{digest}").write_bytes(gguf.read_bytes())
    manifest = models / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "q8"
    manifest.parent.mkdir(parents=True)
    layers = [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": 1},
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 1},
    ]
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    monkeypatch.setenv("OLLAMA_MODELS", str(models))
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    return gguf


@pytest.mark.parametrize("storage", ["gguf", None])
def test_an_ollama_model_runs_from_its_blob(ollama, storage):
    offload = {"over_budget": "warn", "headroom": 0, **({"storage": storage} if storage else {})}
    before = snapshot(ollama.parent / "ollama")
    model = offload_core.from_pretrained("ollama:tiny:q8", {"cpu": "1MiB"}, offload)
    try:
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, transformers_model(ollama)(IDS).logits)
    finally:
        model.offload_state.release()
    assert snapshot(ollama.parent / "ollama") == before  # Ollama's files are only read


@pytest.mark.slow  # a run.py process
def test_as_a_process_it_answers_with_the_in_memory_tokens(ollama, tmp_path):
    command = [sys.executable, "run.py", "model=local", "model.path=ollama:tiny:q8", "storage=gguf", "progress=false"]
    command += ["max_memory.cpu=1MiB", "over_budget=warn", "compare_in_memory=true", "max_new_tokens=4"]
    command += ["prompt=the th", f"hydra.run.dir={tmp_path / 'hydra'}"]
    done = preloaded.run(command, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same tokens as in memory: True" in done.stdout


def test_what_ollama_lacks_is_one_line(ollama):
    models = ollama.parent / "ollama" / "models"
    for name, said in (
        ("ollama:tiny", "pull it first (`ollama pull tiny`)"),  # tag latest: not pulled
        ("ollama:other:q8", "Ollama has no such model"),
        ("ollama:../tiny:q8", "is no Ollama model name"),
    ):
        with pytest.raises(ConfigError) as error:
            offload_core.from_pretrained(name, {"cpu": "1MiB"})
        assert "\n" not in str(error.value) and said in str(error.value), str(error.value)
    manifest = models / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "q8"
    blob = next((models / "blobs").iterdir())
    blob.rename(blob.with_name("elsewhere"))
    with pytest.raises(ConfigError, match=r"its weights \(sha256-[0-9a-f]{64}\) are missing"):
        offload_core.from_pretrained("ollama:tiny:q8", {"cpu": "1MiB"})
    manifest.write_text('{"layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:../x"}]}')
    with pytest.raises(ConfigError, match="manifest .* is damaged or names no model weights"):
        offload_core.from_pretrained("ollama:tiny:q8", {"cpu": "1MiB"})
