"""Faults through the public entry points: SIGTERM, a stale checkpoint with the same size and mtime, tampered folders
reused by a real run, and a second dispatch into a folder this process already uses."""

from __future__ import annotations

import gc
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload_core.loading import sources
from offload_core.storage.folder import INDEX
from tests.end_to_end.helpers import cli
from tests.end_to_end.helpers import run_args, run_metrics, signal_after_load


@pytest.fixture(scope="module")
def tiny() -> Path:
    return sources.synthetic_checkpoint(**sources.synthetic_preset("tiny"))


def test_sigterm_removes_temporary_files_in_one_line_with_exit_143(tiny, tmp_path):
    returncode, err, scratch = signal_after_load(tiny, tmp_path, signal.SIGTERM)
    assert returncode == 143, err
    assert err.strip().splitlines()[-1] == "offload_core: terminated (SIGTERM); temporary files were removed"
    assert "Traceback" not in err
    assert not list(scratch.glob("offload_core-*"))


def _copy(tiny: Path, target: Path) -> Path:
    target.mkdir()
    for file in tiny.iterdir():
        if file.is_file():
            (target / file.name).write_bytes(file.read_bytes())
    return target


def test_a_stale_checkpoint_with_the_same_size_and_mtime_is_not_reused(tiny, tmp_path, capsys):
    ckpt = _copy(tiny, tmp_path / "ckpt")
    folder = tmp_path / "off"
    args = [
        "model=local",
        "storage=memmap",
        f"model.path={ckpt}",
        "max_memory.cpu=1KiB",
        "headroom=0",
        f"offload_folder={folder}",
    ]
    assert cli(args, tmp_path, capsys)[0] == 0
    first = run_metrics(tmp_path)
    shard = sorted(ckpt.glob("model-*.safetensors"))[-1]
    stat = shard.stat()
    tensors = load_file(shard)
    tensors = {name: torch.flip(value, dims=[0]).contiguous() for name, value in tensors.items()}
    save_file(tensors, shard, metadata={"format": "pt"})
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert shard.stat().st_size == stat.st_size and shard.stat().st_mtime_ns == stat.st_mtime_ns
    assert cli(args, tmp_path, capsys)[0] == 0
    second = run_metrics(tmp_path)
    assert second["store_reused"] is False
    # The rebuilt folder gives what a fresh temporary folder gives for the new weights.
    assert cli(args[:-1], tmp_path, capsys)[0] == 0
    assert run_metrics(tmp_path)["token_ids"] == second["token_ids"]
    assert first["store_reused"] is False


@pytest.mark.parametrize("tamper", ["flip", "swap", "truncate", "index"])
def test_a_tampered_folder_gives_the_same_tokens_as_a_fresh_one(tamper, tiny, tmp_path, capsys):
    folder = tmp_path / "off"
    assert cli(run_args(tiny, folder), tmp_path, capsys)[0] == 0
    expected = run_metrics(tmp_path)["token_ids"]
    dats = sorted(folder.glob("*.dat"), key=lambda p: (p.stat().st_size, p.name))
    if tamper == "flip":
        data = bytearray(dats[-1].read_bytes())
        data[len(data) // 2] ^= 0x55
        dats[-1].write_bytes(bytes(data))
    elif tamper == "swap":
        same = next(
            (a, b)
            for a, b in zip(dats, dats[1:])
            if a.stat().st_size == b.stat().st_size and a.read_bytes() != b.read_bytes()
        )
        a, b = same[0].read_bytes(), same[1].read_bytes()
        same[0].write_bytes(b)
        same[1].write_bytes(a)
    elif tamper == "truncate":
        os.truncate(dats[-1], 8)
    else:
        text = (folder / INDEX).read_text().replace('"bfloat16"', '"float16"', 1)
        (folder / INDEX).write_text(text)
    code, err = cli(run_args(tiny, folder), tmp_path, capsys)
    assert code == 0, err
    assert run_metrics(tmp_path)["store_reused"] is False
    assert run_metrics(tmp_path)["token_ids"] == expected
    assert "Traceback" not in err


def _dispatch(tiny: Path, folder: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from offload_core.loading.dispatch import load_checkpoint_and_dispatch
    from offload_core.loading.empty import init_empty_weights

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny)).eval()
    return load_checkpoint_and_dispatch(
        model,
        tiny,
        device_map="sequential",
        max_memory={"cpu": 1024},
        storage="memmap",
        offload_folder=folder,
        execution_device="cpu",
        progress=False,
        headroom=0,
    )


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(8).unsqueeze(0)).logits


@pytest.mark.parametrize("first", ["alive", "dropped", "removed"])
def test_a_second_dispatch_into_a_folder_this_process_uses(first, tiny, tmp_path):
    folder = tmp_path / "off"
    model = _dispatch(tiny, folder)
    expected = _logits(model)
    if first == "dropped":
        del model
        gc.collect()
    elif first == "removed":
        model.offload_state.remove()
    again = _dispatch(tiny, folder)  # must not wait on this process's own lock
    assert again.offload_state.store.reused
    assert torch.equal(_logits(again), expected)
    if first == "alive":
        assert torch.equal(_logits(model), expected)
        model.offload_state.remove()
    again.offload_state.remove()
