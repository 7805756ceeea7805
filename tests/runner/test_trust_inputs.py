"""Files a run reads and later trusts are validated on read (a cache of another shape is measured again with one line,
a user's binary file is one line), and error lines never share a line with a progress bar."""

from __future__ import annotations

import json
import os

import pytest

from offload_core.errors import ConfigError, StorageError


def test_calibration_of_another_shape_is_measured_again_with_one_line(tmp_path, monkeypatch, capsys):
    from offload_core.plan.calibrate import _read_cached, calibration_file

    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path))
    monkeypatch.delenv("OFFLOAD_CORE_CALIBRATION")  # beside that cache, as a user's is
    good = {
        "disks": {"1": {"write_bps": 1.0, "cold_read_bps": 2.0, "warm_read_bps": 3.0}},
        "h2d_bps": {},
        "compute": {"k": {"1x2": {"block_s": 0.1}, "2x2": {}}},
    }
    calibration_file().write_text(json.dumps(good))
    assert _read_cached() == good and capsys.readouterr().err == ""
    for bad in (
        {"disks": [1, 2], "compute": "x"},
        {"disks": {"1": {"write_bps": "fast"}}},
        [1],
        {"compute": {"k": {"1x2": {"block_s": None}}}},
        {"h2d_bps": {"cuda:0": -1}},
    ):
        calibration_file().write_text(json.dumps(bad))
        assert _read_cached() == {}
        err = capsys.readouterr().err
        assert "calibration.json is damaged" in err and "measuring the machine again" in err and err.count("\n") == 1
    calibration_file().write_bytes(os.urandom(256))
    assert _read_cached() == {} and "damaged" in capsys.readouterr().err


def test_a_binary_prompts_file_is_one_line(tmp_path):
    from offload_core.runner.inputs import read_prompts

    path = tmp_path / "prompts.bin"
    path.write_bytes(b"ok\n\xff\xfe\x00\x81" + bytes(range(256)))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        read_prompts(path)


def test_an_offload_index_of_another_shape_is_one_line(tmp_path):
    from offload_core.loading.offload_index import read_offload_index

    for content in (b"\xff\xfe", b"[1, 2]", b'{"w": {"dtype": "float32"}}', b"{"):
        (tmp_path / "index.json").write_bytes(content)
        with pytest.raises(StorageError, match="index"):
            read_offload_index(tmp_path)
    (tmp_path / "index.json").write_text(json.dumps({"w": {"dtype": "float32", "shape": [2]}}))
    assert read_offload_index(tmp_path) == {"w": {"dtype": "float32", "shape": [2]}}


def test_an_error_line_starts_its_own_line_after_a_progress_bar(capsys):
    from tqdm.auto import tqdm

    from offload_core.runner.console import print_line

    bar = tqdm(total=21, desc="loading", unit="tensor", leave=False, mininterval=0)
    bar.update(1)
    print_line("error: checkpoint tensor 'x' has shape [2]")
    err = capsys.readouterr().err  # not a terminal: the bar cleared in place must not share the error's line
    assert err.split("\n")[-2] == "offload_core: error: checkpoint tensor 'x' has shape [2]"


def test_from_pretrained_checks_budgets_as_the_command_line_does(tmp_path, caplog):
    import torch

    import offload_core
    from offload_core.runner.settings import max_memory
    from offload_core.testing import tiny_tied_llama

    path = tmp_path / "ckpt"
    tiny_tied_llama(path)
    cpu = torch.device("cpu")
    for given in ({0: "10GiB", "cpu": "20GiB"}, {"cpu": 0}, {"mps": "1GiB"}):
        with pytest.raises(ConfigError) as cli:
            max_memory({str(k): v for k, v in given.items()}, cpu)
        with pytest.raises(ConfigError) as api:
            offload_core.from_pretrained(path, offload={"execution_device": "cpu"}, max_memory=given)
        assert str(api.value) == str(cli.value)
    assert "not available" not in caplog.text


def _cfg(overrides):
    from hydra import compose, initialize_config_dir

    from offload_core.runner.config import register_configs
    from tests import ROOT

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=overrides)


def test_a_single_prompt_plans_its_kv_cache_as_a_batch_of_one(tmp_path):
    import re

    from offload_core.runner.job import run

    base = ["model=synthetic", "plan_only=true", "max_memory.cpu=12MiB"]
    short = run(_cfg([*base, "max_new_tokens=16"]), output_dir=tmp_path / "a", plot=False)
    long = run(_cfg([*base, "max_new_tokens=1000"]), output_dir=tmp_path / "b", plot=False)
    assert 3 * 2**20 < short.plan["headroom"] < long.plan["headroom"] < 12 * 2**20  # grows with the tokens, not fixed
    with pytest.raises(ConfigError, match=r"exceed the model's context of 2048 tokens") as caught:
        run(_cfg([*base, "max_new_tokens=100000000"]), output_dir=tmp_path / "c", plot=False)
    fits = int(re.search(r"use max_new_tokens=(\d+) or less", str(caught.value)).group(1))
    run(_cfg([*base, f"max_new_tokens={fits}", "max_memory.cpu=64MiB"]), output_dir=tmp_path / "d", plot=False)
    with pytest.raises(ConfigError, match="exceed the model's context"):
        run(_cfg([*base, f"max_new_tokens={fits + 1}", "max_memory.cpu=64MiB"]), output_dir=tmp_path / "e", plot=False)
    small = [*base, "max_memory.cpu=3MiB"]
    with pytest.raises(
        ConfigError,
        match=(
            r"more than max_memory.cpu=3.00 MiB leaves beside 768.00 KiB for the runtime; "
            r"use max_new_tokens=(\d+) or less"
        ),
    ) as caught:
        run(_cfg([*small, "max_new_tokens=2000"]), output_dir=tmp_path / "f", plot=False)
    fits = int(re.search(r"use max_new_tokens=(\d+) or less", str(caught.value)).group(1))
    run(_cfg([*small, f"max_new_tokens={fits}"]), output_dir=tmp_path / "g", plot=False)
    with pytest.raises(ConfigError, match="for the runtime"):
        run(_cfg([*small, f"max_new_tokens={fits + 1}"]), output_dir=tmp_path / "h", plot=False)
    given = run(_cfg([*base, "headroom=1MiB"]), output_dir=tmp_path / "i", plot=False)
    assert given.plan["headroom"] == 2**20  # a headroom the user gives is held back as given


def test_from_pretrained_checks_the_execution_device_as_the_command_line_does(tmp_path):
    import torch

    import offload_core
    from offload_core.runner.settings import execution_device
    from offload_core.testing import tiny_tied_llama

    path = tmp_path / "ckpt"
    tiny_tied_llama(path)
    for given in (f"cuda:{torch.cuda.device_count()}", "toaster", "mps"):
        with pytest.raises(ConfigError) as cli:
            execution_device(given)
        with pytest.raises(ConfigError) as api:
            offload_core.from_pretrained(path, offload={"execution_device": given}, max_memory={"cpu": "1MiB"})
        assert str(api.value) == str(cli.value)


def test_a_block_that_could_not_be_timed_is_said_and_timed_again_next_run(tmp_path, monkeypatch, capsys):
    import torch
    import transformers

    from offload_core.plan import calibrate as calibration

    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path))
    monkeypatch.delenv("OFFLOAD_CORE_CALIBRATION")  # beside that cache, as a user's is
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    cpu, folders = torch.device("cpu"), {"checkpoint": tmp_path}
    args = (model, ["LlamaDecoderLayer"], torch.float32, cpu, folders, {"decode": (1, 1)})
    real = calibration.compute_times

    def fails(*a, **k):
        raise RuntimeError("this block wants a mask\nand more")

    monkeypatch.setattr(calibration, "compute_times", fails)
    assert calibration.calibrate(*args)["compute"]["decode"] == {}
    out = capsys.readouterr().out
    assert "no time prediction: a block of this model could not be timed (RuntimeError: this block wants a mask)" in out
    monkeypatch.setattr(calibration, "compute_times", real)
    assert calibration.calibrate(*args)["compute"]["decode"]["block_s"] > 0  # not kept as "cannot": timed now
