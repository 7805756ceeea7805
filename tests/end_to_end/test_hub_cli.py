"""``python run.py model=local model.path=<repo id or snapshot folder>`` on models in the Hugging Face Hub cache layout,
offline: SmolLM2 (three linked shards and an index) as a process, offloaded, with transformers' tokens for the same repo
id; a tiny model's sharded ``.bin`` at a tagged revision; a repo the cache lacks ends in one line. Nothing downloads."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import transformers

from offload_core.loading import sources
from tests import ROOT, preloaded
from tests.checkpoints import TINY
from tests.end_to_end.helpers import assert_one_line, cli, run_metrics
from tests.hub_cache import as_hub_cache, save_bin_shards

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPT = "What is the capital of France?"
#: our cache's own files, which a download from the Hub would not hold
OURS = (sources.CACHE_TAG, sources.COMPLETE_MARKER, ".checksums")


def cache_state(cache: Path) -> dict[str, tuple]:
    """Every entry under ``cache`` by path: a link's target, a file's size, mtime and inode (never its bytes)."""
    state = {}
    for path in sorted(cache.rglob("*")):
        if path.is_symlink():
            state[str(path)] = ("link", os.readlink(path))
        elif path.is_file():
            info = path.stat()
            state[str(path)] = (info.st_size, info.st_mtime_ns, info.st_ino)
    return state


def expected_tokens(repo: str, cache: Path, new_tokens: int, revision: str | None = None) -> list[int]:
    """transformers' own greedy answer for the repo id, read from the cache only, the prompt in its chat template."""
    kwargs = dict(cache_dir=cache, local_files_only=True, revision=revision)
    tokenizer = transformers.AutoTokenizer.from_pretrained(repo, **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(repo, **kwargs).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory) -> tuple[Path, Path]:
    """(Hub cache, snapshot folder) of SmolLM2 as ``hf download`` leaves it (blobs hard-linked to our converted one)."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    folder = as_hub_cache(sources.smollm2_checkpoint(), cache, SMOLLM2, skip=OURS, hardlink=True)
    assert (folder / "model.safetensors.index.json").is_symlink()
    return cache, folder


def hub_env(cache: Path) -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TQDM_DISABLE": "1",
        "PYTHONPATH": str(ROOT),
    }


@pytest.mark.parametrize("by", ["repo id", "snapshot folder"])
def test_smollm2_in_the_hub_cache_runs_offloaded_with_transformers_tokens(by, smollm2_cache, tmp_path):
    cache, folder = smollm2_cache
    before = cache_state(cache)
    path = SMOLLM2 if by == "repo id" else str(folder)
    args = [sys.executable, str(ROOT / "run.py"), "model=local", f"model.path={path}", "storage=safetensors"]
    args += ["max_memory.cpu=150MiB", "max_new_tokens=8", "compare_in_memory=true", f"hydra.run.dir={tmp_path}"]
    done = preloaded.run(args, cwd=tmp_path, env=hub_env(cache), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Paris" in done.stdout and "same tokens as in memory: True" in done.stdout, done.stdout[-2000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["devices"]["disk"]["bytes"] > 0  # read in place from the cache's blobs
    assert cache_state(cache) == before  # nothing in the cache written, added or removed
    if by == "repo id":
        assert metrics["token_ids"] == expected_tokens(SMOLLM2, cache, 8)


def test_a_repo_the_cache_lacks_offline_ends_in_one_line(smollm2_cache, tmp_path):
    """The cache above, which lacks the repo (and gives the run the environment of the runs above: no new imports)."""
    cache, _ = smollm2_cache
    before, state = sorted(cache.rglob("*")), cache_state(cache)
    args = [sys.executable, str(ROOT / "run.py"), "model=local", "model.path=acme/nope", "model.revision=v1"]
    args += ["plan_only=true", f"hydra.run.dir={tmp_path / 'run'}"]
    done = preloaded.run(args, cwd=tmp_path, env=hub_env(cache), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert_one_line(
        done.stderr,
        "model.path='acme/nope' is neither a local folder nor a model in the Hugging Face cache",
        "at revision 'v1'",
        "set model.path to a checkpoint folder, unset HF_HUB_OFFLINE",
        "hf download acme/nope --revision v1",
    )
    assert sorted(cache.rglob("*")) == before and cache_state(cache) == state  # nothing added, nothing written


def test_a_tagged_revision_of_sharded_bin_files_runs_by_repo_id(tmp_path, capsys, monkeypatch):
    """``model.revision`` picks the tag's snapshot; ``.bin`` shards (the index naming linked files) copy to disk."""
    from huggingface_hub import constants

    from offload_core.plan import calibrate, probe

    smollm2 = sources.smollm2_checkpoint()
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": len(tokenizer)}, num_key_value_heads=2)
    for layers, tag in [(1, "v1"), (2, "main")]:
        torch.manual_seed(layers)
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**{**config.to_dict(), "num_hidden_layers": layers})
        )
        folder = tmp_path / f"saved-{tag}"
        model.config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        save_bin_shards(model.state_dict(), folder)
        as_hub_cache(folder, tmp_path / "hub", "acme/smol", ref=tag)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    probed = []  # the folders calibrate=true measures by writing in them: never inside the Hub cache
    for module, name in [(calibrate, "disk_bandwidth"), (probe, "probe_times")]:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real: probed.append(Path(a[-1])) or real(*a))
    args = ["model=local", "model.path=acme/smol", "model.revision=v1", "storage=memmap", "max_memory.cpu=1MiB"]
    code, err = cli([*args, "max_new_tokens=4", "compare_in_memory=true", "calibrate=true"], tmp_path, capsys)
    assert code == 0, err
    assert len(probed) >= 2 and not any(p.resolve().is_relative_to((tmp_path / "hub").resolve()) for p in probed)
    metrics = run_metrics(tmp_path)
    assert metrics["matches_in_memory"] is True and metrics["devices"]["disk"]["bytes"] > 0
    assert metrics["token_ids"] == expected_tokens("acme/smol", tmp_path / "hub", 4, revision="v1")
    assert metrics["token_ids"] != expected_tokens("acme/smol", tmp_path / "hub", 4)[: len(metrics["token_ids"])]
